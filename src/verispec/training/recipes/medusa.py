"""Medusa-1's training recipe (Cai et al. 2024): the target frozen, its features as they are; head k's cross-entropy
against the target's distribution for the token at r + k + 2, weighted 0.8^k (their lambda_k). The LM head is the
target's rows for the draft vocabulary, frozen; each ResBlock starts at zero (the identity: every head first predicts
what the target's own LM head does, one token early). The head itself: heads/medusa.py."""

from __future__ import annotations

import torch
from torch import nn

from ...heads.medusa import MedusaHead
from .base import Recipe, random_init
from .eagle3 import chain_loss


def init(head: MedusaHead, target: nn.Module, init: str, seed: int) -> None:
    """ResBlocks at zero (``init`` "target") or random (``init`` "random"); the LM head the target's rows."""
    random_init(head, seed)
    head.freeze_target_rows(target)
    if init == "target":
        with torch.no_grad():
            for block in head.blocks:
                for res in block:
                    res.linear.weight.zero_()


def unroll(head: MedusaHead, features: torch.Tensor, tokens: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """features [B, T, D] (the last residual stream at positions 0..T-1) -> per head k the logits [B, T, Vd]; head k
    row r predicts token x_{r+k+2}: what EAGLE-3's step k row r predicts, so its loss serves (``steps`` unused: every
    head is trained)."""
    return head.head_logits(head.fuse(features))


RECIPE = Recipe(head=MedusaHead, init=init, unroll=unroll, loss=chain_loss)
