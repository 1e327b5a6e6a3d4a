"""Drafters: one small file each, all behind the protocol in base.py.

METHODS maps a method name to a factory ``(llm, spec) -> Drafter``; adding a drafter is adding a file and
one entry here, never a branch in the decoding loop.
"""

from ..errors import ConfigError, VerispecError
from .auto import AutoDrafter
from .base import Draft, Drafter, DraftRequest
from .draft_model import DraftModelDrafter
from .head import HeadDrafter, MtpDrafter, PEagleDrafter
from .medusa import MedusaDrafter
from .ngram import NgramDrafter, NgramIndex

# a draft head's family -> (the method that drafts with it, its drafter)
HEAD_METHODS = {"eagle3": ("eagle", HeadDrafter), "peagle": ("peagle", PEagleDrafter),
                "medusa": ("medusa", MedusaDrafter), "mtp": ("mtp", MtpDrafter)}


def _head(family: str):
    """The factory of the method that drafts with heads of ``family``: the LLM's head, checked to be one."""
    method, drafter = HEAD_METHODS[family]
    return lambda llm, spec: drafter(llm.draft_head(method, family))


def _draft_model(llm, spec) -> DraftModelDrafter:
    """The draft model; its confidence calibration (early stops) and its last KV cache are kept by the LLM across
    requests."""
    return DraftModelDrafter(llm.draft_model().model, spec.early_stop, llm.draft_calibrations, llm.draft_prefixes)


def _auto(llm, spec) -> AutoDrafter:
    """Every drafter that can run here, cheapest first (n-gram; a draft head and a draft model when the target has
    them); plain decoding is always an option too (drafters/auto.py). What it measures is kept by the LLM for the next
    request."""
    candidates = {"ngram": NgramDrafter(spec.ngram_min, spec.ngram_max)}
    if llm.has_head:  # heads given, or one that ships for this target (a broken one is an error, not skipped)
        for head in llm.draft_heads():
            method, drafter = HEAD_METHODS[head.config.family]
            candidates[method] = drafter(head)
    try:
        candidates["draft"] = _draft_model(llm, spec)
    except VerispecError:
        pass  # no draft model for this target: n-gram lookup alone
    return AutoDrafter(candidates, spec.min_draft_tokens, spec.num_draft_tokens, memory=llm.auto_memory)


METHODS = {
    "draft": lambda llm, spec: _draft_model(llm, spec),
    "ngram": lambda llm, spec: NgramDrafter(spec.ngram_min, spec.ngram_max),
    **{method: _head(family) for family, (method, _) in HEAD_METHODS.items()},
    "auto": _auto,
}

AR = "ar"  # plain autoregressive decoding: no drafter


def check_method(method: str) -> None:
    """The one check of a method name (LLM, CLI, server, bench): a ConfigError naming the choices."""
    if method != AR and method not in METHODS:
        raise ConfigError(f"unknown method {method!r} (available: {', '.join([AR, *METHODS])})")


__all__ = ["AR", "check_method", "AutoDrafter", "Draft", "Drafter", "DraftRequest", "DraftModelDrafter", "HEAD_METHODS",
           "HeadDrafter", "MedusaDrafter", "MtpDrafter", "PEagleDrafter", "METHODS", "NgramDrafter", "NgramIndex"]
