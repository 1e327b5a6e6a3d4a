"""A P-EAGLE head (parallel EAGLE): an EAGLE-3 head that drafts all K tokens in one forward.

The first draft comes as in EAGLE-3 from the row of the last committed position (the target's features and the newest
token). Drafts 2..K come from K-1 more rows in one pass, each reading a learned mask hidden state and a learned mask
embedding in place of the previous draft's (which it does not know), at the next positions, attending to the committed
rows and to each other causally: K drafts for one catch-up and one K-1-row pass instead of K-1 steps. Trained with the
same unroll as EAGLE-3 (training-time test) whose steps 1.. read the mask inputs (recipes/eagle3.py's loss); published
per-position acceptance is lower than EAGLE-3's, the drafting cost K times lower. Our files: EAGLE-3's layout plus
``mask_hidden`` and ``mask_embed``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from ..models.kv_cache import KVCache
from .eagle3 import Eagle3Config, Eagle3Head


@dataclass(frozen=True)
class PEagleConfig(Eagle3Config):
    first_hidden: bool = False  # mask rows read mask_hidden + the first draft's hidden state (not mask_hidden alone)

    family = "peagle"

    @classmethod
    def from_json(cls, raw: dict, target_cfg) -> PEagleConfig:
        return replace(super().from_json(raw, target_cfg), first_hidden=bool(raw.get("mask_reads_first_hidden", False)))

    def to_json(self) -> dict:
        return {**super().to_json(), "architectures": ["LlamaForCausalLMPEagle"],
                "mask_reads_first_hidden": self.first_hidden}


class PEagleHead(Eagle3Head):
    Config = PEagleConfig

    def __init__(self, c: PEagleConfig):
        super().__init__(c)
        self.mask_hidden = nn.Parameter(torch.zeros(c.hidden_size))  # [D]: stands for the unknown previous hidden
        self.mask_embed = nn.Parameter(torch.zeros(c.hidden_size))  # [D]: stands for the unknown previous draft

    def step_inputs(self, j: int, emb: torch.Tensor, hidden: torch.Tensor, first: torch.Tensor | None = None):
        if j == 0:
            return emb, hidden
        return self.mask_embed.to(emb.dtype).expand_as(emb), self.mask_input(first)

    def mask_input(self, first: torch.Tensor) -> torch.Tensor:
        """What a mask row reads as its hidden state: mask_hidden [D], plus (first_hidden) the first draft's [B, T, D]."""
        mask = self.mask_hidden.to(first.dtype).expand_as(first)
        return mask + first if self.config.first_hidden else mask

    @torch.inference_mode()
    def parallel(self, n: int, cache: KVCache, first: torch.Tensor) -> torch.Tensor:
        """n mask rows at the cache's next positions, first [1, 1, D] (the first draft's hidden state) -> their output
        hidden states [1, n, D] (row i: draft i + 2)."""
        D, dtype = self.config.hidden_size, self.dtype
        return self.layers_forward(self.mask_embed.to(dtype).expand(1, n, D), self.mask_input(first.expand(1, n, D)),
                                   cache)
