"""What a training recipe is: one head family's init, training forward (unroll) and loss; the trainer does the rest
(training/trainer.py). Shared by every recipe: the target's distribution over the draft vocabulary (Labels) and the
plain random start (random_init)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn

from ...heads.base import DraftHead
from ...models.config import ModelConfig


@dataclass(frozen=True)
class Recipe:
    head: type[DraftHead]  # the family's head class (its Config builds one for a target)
    # (head, target Transformer, init: "target" | "random", seed) -> None: the weights before training
    init: Callable[[DraftHead, nn.Module, str, int], None]
    # (head, features [B, T, F], tokens [B, T], steps) -> per step draft-vocabulary logits [B, T, Vd]
    unroll: Callable[[DraftHead, torch.Tensor, torch.Tensor, int], list[torch.Tensor]]
    # (forward module, batch, Labels, steps, step weight, answers only) -> (loss, [steps] greedy hits, [steps] rows
    # reached)
    loss: Callable[[nn.Module, dict, Labels, int, float, bool], tuple[torch.Tensor, list[int], list[int]]]

    def build(self, cfg: ModelConfig, layers: tuple[int, ...] | None, draft_vocab_size: int, depth: int = 1,
              **options) -> DraftHead:
        """A head of this family for the target ``cfg`` (its d2t the identity until the caller sets it); ``depth``:
        its config's ``num_layers`` (decoder layers, Medusa's ResBlocks per head); ``options``: more config fields."""
        config = self.head.Config.for_target(cfg, layers, draft_vocab_size)
        return self.head(replace(config, num_layers=depth, **options))


class Labels:
    """The target's distribution over the draft vocabulary, from its stored top-k."""

    def __init__(self, d2t: torch.Tensor, vocab_size: int):
        self.t2d = torch.full((vocab_size,), -1, dtype=torch.long)
        self.t2d[d2t] = torch.arange(len(d2t))
        self.Vd = len(d2t)

    def __call__(self, topk_ids: torch.Tensor, topk_logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, T, k] each -> (p [B, T, Vd] float32, the target's top-1 as a draft row or -1 [B, T])."""
        rows = self.t2d[topk_ids.long()]  # [B, T, k]
        p = topk_logp.float().exp() * (rows >= 0)
        p = p / p.sum(-1, keepdim=True).clamp(min=1e-9)
        dense = torch.zeros(*rows.shape[:2], self.Vd).scatter_add_(-1, rows.clamp(min=0), p)
        return dense, rows[..., 0]


def random_init(head: DraftHead, seed: int) -> None:
    """Matrices N(0, 0.02), norms 1, anything else 0 (in the order of ``named_parameters``: a function of seed)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
            elif "norm" in name:
                p.fill_(1.0)
            else:
                p.zero_()


def start(head: DraftHead, target: nn.Module, seed: int, norm: nn.Module) -> None:
    """What every chained head starts from: random weights (random_init), the LM head the target's rows for its draft
    vocabulary (frozen), ``norm`` (its final norm) the target's."""
    random_init(head, seed)
    head.freeze_target_rows(target)
    with torch.no_grad():
        norm.weight.copy_(target.norm.weight.float())
