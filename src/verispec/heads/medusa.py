"""A Medusa draft head (Cai et al. 2024, arXiv:2401.10774): K small heads on the target's last hidden state, all drafted
in one pass.

Head k (k = 0..K-1) is ``num_layers`` ResBlocks (x + SiLU(W x + b)) on norm(h_r), the target's residual stream after its
last layer at position r through the target's own final norm, then an LM head: it predicts the token at r + k + 2
(the target's LM head on the same state gives r + 1). Our heads share one LM head, the target's rows for a draft
vocabulary (frozen, not stored: ``d2t``), so a head of 4 is ~19 M parameters (int8 on file); the Medusa authors'
files give each head its own full LM head (``medusa_lm_head.safetensors``: ``{k}.{j}.linear.weight`` / ``.bias`` for
ResBlock j, ``{k}.{num_layers}.weight`` for the LM head; config.json ``medusa_num_heads``, ``medusa_num_layers``),
which heads/io.py reads too. The final norm is always the target's (attach_target), never the file's.

Drafting (drafters/medusa.py) reads one feature row and proposes min(K, heads) tokens; training (recipes/medusa.py)
is Medusa-1: the target frozen, head k's cross-entropy against the target's distribution at r + k + 1, weighted 0.8^k.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError, VerispecError
from ..models.config import ModelConfig
from ..models.linear import Linear
from .base import DraftHead, HeadConfig, check_layers

DEFAULT_HEADS = 4


@dataclass(frozen=True)
class MedusaConfig(HeadConfig):
    hidden_size: int
    vocab_size: int  # the target's
    draft_vocab_size: int  # rows of each LM head (the target's vocabulary for a head with its own LM heads)
    layers: tuple[int, ...]  # one: the target's last residual stream
    num_heads: int = DEFAULT_HEADS
    num_layers: int = 1  # ResBlocks per head
    rms_norm_eps: float = 1e-6
    own_lm_heads: bool = False  # the Medusa authors' layout: one full LM head per head, in the file

    family = "medusa"

    def __post_init__(self):
        if len(self.layers) != 1 or self.num_heads < 1 or self.num_layers < 0:
            raise ConfigError(f"a Medusa head reads one layer with >= 1 heads, got layers {self.layers}, "
                             f"{self.num_heads} heads of {self.num_layers} ResBlocks")

    @classmethod
    def for_target(cls, cfg: ModelConfig, layers: tuple[int, ...] | None, draft_vocab_size: int,
                   num_heads: int = DEFAULT_HEADS) -> MedusaConfig:
        layers = tuple(layers) if layers else cls.default_layers(cfg.num_layers)
        check_layers(layers, cfg.num_layers)
        if len(layers) != 1:
            raise VerispecError(f"--layers: a Medusa head reads one layer (the last, {cfg.num_layers}), got "
                                f"{','.join(map(str, layers))}")
        return cls(cfg.hidden_size, cfg.vocab_size, min(draft_vocab_size, cfg.vocab_size), layers, num_heads, 1,
                   cfg.rms_norm_eps)

    @classmethod
    def from_json(cls, raw: dict, target_cfg: ModelConfig) -> MedusaConfig:
        """Ours, or the Medusa authors' (``medusa_num_heads``, ``medusa_num_layers``, no sizes: the target's)."""
        own = "draft_vocab_size" not in raw  # the authors' files carry a full LM head per head
        V = int(raw.get("vocab_size", target_cfg.vocab_size))
        return cls(int(raw.get("hidden_size", target_cfg.hidden_size)), V, int(raw.get("draft_vocab_size", V)),
                   tuple(int(i) for i in raw.get("medusa_feature_layers", [target_cfg.num_layers])),
                   int(raw["medusa_num_heads"]), int(raw.get("medusa_num_layers", 1)),
                   float(raw.get("rms_norm_eps", target_cfg.rms_norm_eps)), own)

    def to_json(self) -> dict:
        out = {"medusa_num_heads": self.num_heads, "medusa_num_layers": self.num_layers,
               "hidden_size": self.hidden_size, "vocab_size": self.vocab_size, "rms_norm_eps": self.rms_norm_eps,
               "medusa_feature_layers": list(self.layers)}
        return out if self.own_lm_heads else {**out, "draft_vocab_size": self.draft_vocab_size}


class ResBlock(nn.Module):
    def __init__(self, D: int):
        super().__init__()
        self.linear = Linear(D, D, bias=True)

    def forward(self, x):
        return x + F.silu(self.linear(x))


class MedusaHead(DraftHead):
    Config = MedusaConfig

    def __init__(self, c: MedusaConfig):
        super().__init__(c)
        D = c.hidden_size
        self.blocks = nn.ModuleList(nn.Sequential(*(ResBlock(D) for _ in range(c.num_layers)))
                                    for _ in range(c.num_heads))
        if c.own_lm_heads:
            self.lm_heads = nn.ModuleList(Linear(D, c.draft_vocab_size, bias=False) for _ in range(c.num_heads))
        else:
            self.lm_head = Linear(D, c.draft_vocab_size, bias=False)  # the target's rows for d2t, frozen
        self.__dict__["norm"] = None  # the target's final norm (attach_target): not the head's to store

    # the authors' names: "{k}.{j}.linear.*" for our "blocks.{k}.{j}.linear.*", "{k}.{J}.weight" for "lm_heads.{k}"
    def public_name(self, ours: str) -> str:
        if ours.startswith("lm_heads."):
            return f"{ours.split('.')[1]}.{self.config.num_layers}.weight"
        return ours.removeprefix("blocks.")

    def our_name(self, public: str) -> str:
        parts = public.split(".")
        if self.config.own_lm_heads and len(parts) == 3 and parts[1] == str(self.config.num_layers):
            return f"lm_heads.{parts[0]}.weight"
        return public if not parts[0].isdigit() else f"blocks.{public}"

    def attach_target(self, target: nn.Module) -> None:
        super().attach_target(target)
        self.__dict__["norm"] = target.norm

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """features [B, T, D] (the last residual stream) -> the target's final norm of it [B, T, D]."""
        return self.norm(features.to(self.norm.weight.dtype)).to(features.dtype)

    def head_logits(self, hidden: torch.Tensor, heads: int | None = None) -> list[torch.Tensor]:
        """hidden [B, T, D] (fused) -> per head k < ``heads`` (default all) the draft-vocabulary logits [B, T, Vd]
        float32 of the token at r + k + 2."""
        out = []
        for k, block in enumerate(self.blocks[:heads]):
            h = block(hidden)
            lm = self.lm_heads[k] if self.config.own_lm_heads else self.lm_head
            out.append(lm(h).float())
        return out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, T, D] -> the first head's logits [B, T, Vd] (DraftHead's one-step view)."""
        return self.head_logits(hidden, 1)[0]

    def freeze_target_rows(self, target: nn.Module) -> None:
        if not self.config.own_lm_heads:
            super().freeze_target_rows(target)
