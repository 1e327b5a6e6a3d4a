"""The drafter protocol (:class:`Drafter`: all of it, defaults included), what a drafter is given
(:class:`DraftRequest`) and what it returns (:class:`Draft`)."""

from __future__ import annotations

from dataclasses import dataclass
import torch

from ..config import SamplingParams
from ..sampling import ProcessorChain
from ..spec.costs import Costs


@dataclass
class Draft:
    """K proposed tokens and the distribution each was drawn from.

    tokens: [B, K] int64, K <= the requested number (a drafter may propose fewer, even none: the round
        is then a plain target step).
    draft_probs: [B, K, V] float32 — q, after the same temperature/top-k/top-p transform as the
        target's p — or None for a deterministic draft (n-gram, argmax heads, greedy), which the
        verifier treats as one-hot q.
    """

    tokens: torch.Tensor
    draft_probs: torch.Tensor | None = None
    source: str | None = None  # which drafter made it, when one drafter delegates to others (auto)


@dataclass
class DraftRequest:
    """What a drafter may look at: the committed context and how to sample."""

    context: list[int]  # prompt + every committed token, in order
    num_tokens: int  # K: how many tokens to propose this round (>= 1)
    params: SamplingParams
    generator: torch.Generator | None
    capacity: int  # the most tokens the context will ever hold (prompt + max_new_tokens + K + 1)
    vocab_size: int  # the target's vocabulary rows: draft_probs must be [B, K, vocab_size]
    logit_mask: torch.Tensor | None  # [vocab_size] bool, True = never propose (padding rows)
    device: torch.device | str = "cpu"  # where the target runs: Draft tensors go here
    costs: Costs | None = None  # the engine's store of measured costs (spec/costs.py): read it, never write it
    # the request's processors (padding mask, then its transforms: sampling/), applied to each drafted row given its
    # prefix (the context plus the drafts before it) as the verifier applies them to p: None = the params' own
    chain: ProcessorChain | None = None
    # [>= len(context) - 1, F]: the target's residual streams after the drafter's ``feature_layers``, concatenated,
    # row r = position r; rows 0 .. len(context) - 2 are committed (the last context token is not yet fed)
    features: torch.Tensor | None = None


def chain_of(request: DraftRequest) -> ProcessorChain:
    """The processors a drafter applies to its logits: the request's, else those of its sampling params."""
    return request.chain if request.chain is not None else ProcessorChain.from_params(request.params, request.logit_mask)


class Drafter:
    """The whole protocol between a drafter and the engine (and auto, which drives other drafters): every attribute
    and method the engine or auto reads is declared here, with its default. A drafter subclasses this and overrides
    what applies to it; nothing outside this file probes a drafter with getattr / hasattr.

    A drafter never touches the target's KV cache: the engine alone commits. A drafter with state of its own (a draft
    model's KV cache) rolls it back in ``update``.
    """

    # target layer indices (0 = embeddings, i = after layer i) whose hidden states the engine keeps for every
    # committed position and hands over as ``DraftRequest.features`` (a draft head); () = none, features None
    feature_layers: tuple[int, ...] = ()
    # the key of its costs in the store (Costs.draft / catch_up) and of its rounds in the stats
    name: str = ""
    # proposing costs ~nothing and a proposal may be dropped without ``update`` (n-gram lookup): auto asks it first
    # and values the draft it really made
    cheap: bool = False
    # it may end a round before K on its own (the draft model's confidence): auto offers it the request's bound
    early_stop: bool = False
    # it chooses its own K per round (auto): never wrapped in another auto for ``adaptive``
    adaptive: bool = False
    # K is chosen per round (adaptive) unless the request fixes it: a draft head, whose later positions are accepted
    # too rarely on most prompts to pay a fixed K's verify rows
    adaptive_by_default: bool = False
    # (tokens, seconds) this round's proposal spent catching up on committed tokens it had not read, beyond drafting
    catch_up: tuple[int, float] = (0, 0.0)
    # the length of the context suffix this round's draft was matched on (n-gram lookup), None if it does not match
    last_match: int | None = None

    def lag(self, context: list[int]) -> int:
        """Tokens of ``context`` its own state has not read: what its next proposal must catch up on first."""
        return 0

    def delegates(self) -> dict[str, Drafter]:
        """The drafters it chooses among (auto), by name; none for a drafter that drafts itself."""
        return {}

    def propose(self, request: DraftRequest) -> Draft:
        """Up to ``request.num_tokens`` tokens (fewer, even none, is allowed: the round is then a plain step)."""
        raise NotImplementedError

    def update(self, num_accepted: int) -> None:
        """The verifier accepted the first ``num_accepted`` proposed tokens; roll back the rest."""
