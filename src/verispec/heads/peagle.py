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

from dataclasses import dataclass

import torch
from torch import nn

from ..models.kv_cache import KVCache
from .eagle3 import Eagle3Config, Eagle3Head


@dataclass(frozen=True)
class PEagleConfig(Eagle3Config):
    family = "peagle"

    def to_json(self) -> dict:
        return {**super().to_json(), "architectures": ["LlamaForCausalLMPEagle"]}


class PEagleHead(Eagle3Head):
    Config = PEagleConfig

    def __init__(self, c: PEagleConfig):
        super().__init__(c)
        self.mask_hidden = nn.Parameter(torch.zeros(c.hidden_size))  # [D]: stands for the unknown previous hidden
        self.mask_embed = nn.Parameter(torch.zeros(c.hidden_size))  # [D]: stands for the unknown previous draft

    def step_inputs(self, j: int, emb: torch.Tensor, hidden: torch.Tensor):
        if j == 0:
            return emb, hidden
        return self.mask_embed.to(emb.dtype).expand_as(emb), self.mask_hidden.to(hidden.dtype).expand_as(hidden)

    @torch.inference_mode()
    def parallel(self, n: int, cache: KVCache) -> torch.Tensor:
        """n mask rows at the cache's next positions -> their output hidden states [1, n, D] (row i: draft i + 2)."""
        D, dtype = self.config.hidden_size, self.dtype
        mask_embed, mask_hidden = (p.to(dtype).expand(1, n, D) for p in (self.mask_embed, self.mask_hidden))
        return self.layers_forward(mask_embed, mask_hidden, cache)
