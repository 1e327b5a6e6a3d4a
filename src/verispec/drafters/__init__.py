"""Drafters: one small file each, all behind the protocol in base.py.

METHODS maps a method name to a factory ``(llm, spec) -> Drafter``; adding a drafter is adding a file and
one entry here, never a branch in the decoding loop.
"""

from ..errors import VerispecError
from .auto import AutoDrafter
from .base import Draft, Drafter, DraftRequest
from .draft_model import DraftModelDrafter
from .eagle import EagleDrafter
from .ngram import NgramDrafter, NgramIndex


def _draft_model(llm, spec) -> DraftModelDrafter:
    """The draft model; its confidence calibration (early stops) and its last KV cache are kept by the LLM across
    requests."""
    return DraftModelDrafter(llm.draft_model().model, spec.early_stop, llm.draft_calibrations, llm.draft_prefixes)


def _auto(llm, spec) -> AutoDrafter:
    """Every drafter that can run here, cheapest first (n-gram; a draft head and a draft model when the target has
    them); plain decoding is always an option too (drafters/auto.py). What it measures is kept by the LLM for the next
    request."""
    candidates = {"ngram": NgramDrafter(spec.ngram_min, spec.ngram_max)}
    if llm.has_head:  # a head given, or one that ships for this target (a broken one is an error, not skipped)
        candidates["eagle"] = EagleDrafter(llm.eagle_head())
    try:
        candidates["draft"] = _draft_model(llm, spec)
    except VerispecError:
        pass  # no draft model for this target: n-gram lookup alone
    return AutoDrafter(candidates, spec.min_draft_tokens, spec.num_draft_tokens, memory=llm.auto_memory)


METHODS = {
    "draft": lambda llm, spec: _draft_model(llm, spec),
    "ngram": lambda llm, spec: NgramDrafter(spec.ngram_min, spec.ngram_max),
    "eagle": lambda llm, spec: EagleDrafter(llm.eagle_head()),
    "auto": _auto,
}

__all__ = ["AutoDrafter", "Draft", "Drafter", "DraftRequest", "DraftModelDrafter", "EagleDrafter", "METHODS", "NgramDrafter",
           "NgramIndex"]
