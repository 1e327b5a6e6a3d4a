"""The drafter protocol: ``propose(request) -> Draft`` and ``update(num_accepted)``; nothing else.

A drafter never touches the target's KV cache: the engine alone commits. A drafter with state of
its own (a draft model's KV cache) rolls it back in ``update``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..config import SamplingParams


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
    verify_s: dict[int, float] | None = None  # verify size T -> recent seconds of a round besides drafting
    # [>= len(context) - 1, F]: the target's residual streams after the drafter's ``feature_layers``, concatenated,
    # row r = position r; rows 0 .. len(context) - 2 are committed (the last context token is not yet fed)
    features: torch.Tensor | None = None


class Drafter(Protocol):
    """A drafter may also set ``feature_layers`` (a tuple of target layer indices, 0 = embeddings, i = after layer
    i): the engine then keeps those hidden states of every committed position and passes them as
    ``DraftRequest.features``. Drafters without it get None."""

    def propose(self, request: DraftRequest) -> Draft: ...

    def update(self, num_accepted: int) -> None:
        """The verifier accepted the first ``num_accepted`` proposed tokens; roll back the rest."""
        ...
