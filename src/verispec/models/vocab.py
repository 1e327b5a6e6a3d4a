"""Logits over a restricted vocabulary placed at their token ids in the full one.

A restricted LM head (a draft model's FR-Spec rows, a draft head's draft vocabulary) scores ``ids`` only; every
other token can never be proposed, so its logit is -inf (its q is 0). One helper for every such head: the target
runtime (models/llama.py) and the draft heads (heads/base.py) both call it.
"""

from __future__ import annotations

import torch

NEVER = float("-inf")  # the logit of a token outside the restricted vocabulary


def to_target_vocab(logits: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """logits [..., Vd] over the rows ``ids`` [Vd] (distinct target ids, int64) -> [..., vocab_size], -inf elsewhere."""
    full = logits.new_full((*logits.shape[:-1], vocab_size), NEVER)  # [..., V]
    return full.index_copy_(-1, ids, logits)
