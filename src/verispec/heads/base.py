"""A draft head: a small network that reads the target's own hidden states and proposes the next tokens.

Every family (EAGLE-3, Medusa, MTP; P-EAGLE next) is one ``DraftHead`` subclass in its own file, and one
training recipe (training/recipes/). The drafter (drafters/head.py), the loader (heads/io.py) and the trainer ask
a head only for what is here:

    config              a frozen dataclass (HeadConfig): family, hidden_size, vocab_size, draft_vocab_size, layers
    feature_layers      the target residual streams it reads (0 = embeddings, i = after layer i)
    d2t                 [Vd] int64: the target id each draft-vocabulary row proposes
    new_cache(capacity, dtype, device)            its own KV cache for one sequence
    catch_up(features [1, T, F], tokens [1, T], cache) -> hidden [1, 1, D]   the committed rows it has not read
    step(hidden [1, T, D], tokens [1, T], cache) -> hidden [1, T, D]          one step on its own output
    logits(hidden [B, T, D]) -> [B, T, Vd] float32                            over the draft vocabulary

Shared parts: the target's embedding table used as it is (``attach_embedding``), an LM head that is the target's
rows for the draft vocabulary, frozen (``freeze_target_rows``), int8 / 4-bit matrices on the CPU kernels
(``quantize``), and ``to_target_vocab`` (draft-vocabulary logits at their target ids).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from ..errors import VerispecError
from ..models.config import ModelConfig
from ..models.kv_cache import KVCache
from ..models.linear import Linear, can_quantize
from ..models.vocab import to_target_vocab

__all__ = ["DraftHead", "HeadConfig", "check_layers", "frozen_rows", "to_target_vocab"]


class HeadConfig:
    """What every family's config holds (its subclass is a frozen dataclass with these fields, and more):
    hidden_size, vocab_size (the target's), draft_vocab_size, layers (feature layers); ``family`` names it."""

    family: ClassVar[str]

    @classmethod
    def for_target(cls, cfg: ModelConfig, layers: tuple[int, ...] | None, draft_vocab_size: int) -> HeadConfig:
        """A head of this family for the target ``cfg`` (layers None: the family's default)."""
        raise NotImplementedError

    @staticmethod
    def default_layers(num_layers: int) -> tuple[int, ...]:
        """The target residual streams the family reads by default: the last (Medusa, MTP)."""
        return (num_layers,)

    @classmethod
    def from_json(cls, raw: dict, target_cfg: ModelConfig) -> HeadConfig:
        """From config.json (ours or the family's published layout); KeyError / ValueError / TypeError if unreadable."""
        raise NotImplementedError

    def to_json(self) -> dict:
        """config.json in the family's published layout (the loader adds ``family``)."""
        raise NotImplementedError

    def check_target(self, cfg: ModelConfig, name: str, target: str) -> None:
        """One line naming both when the head cannot run on this target."""
        pairs = [("hidden_size", self.hidden_size, cfg.hidden_size), ("vocab_size", self.vocab_size, cfg.vocab_size)]
        for key, mine, theirs in pairs:
            if mine != theirs:
                raise VerispecError(f"draft head {name} does not fit target {target}: {key} {mine} != {theirs}")
        if max(self.layers) > cfg.num_layers:
            raise VerispecError(f"draft head {name} does not fit target {target}: it reads layer "
                                f"{max(self.layers)}, the target has {cfg.num_layers}")


def check_layers(layers: tuple[int, ...], num_layers: int) -> None:
    """--layers within the target's residual streams 0..L."""
    bad = [i for i in layers if not 0 <= i <= num_layers]
    if bad:
        raise VerispecError(f"--layers {bad[0]} outside the target's 0..{num_layers}")


class DraftHead(nn.Module):
    """The interface every family implements (see the module docstring); ``Config`` is its HeadConfig class and
    ``PUBLIC_NAMES`` maps fragments of our tensor names to the family's published ones (heads/io.py)."""

    Config: ClassVar[type[HeadConfig]]
    PUBLIC_NAMES: ClassVar[dict[str, str]] = {}

    def __init__(self, config: HeadConfig):
        super().__init__()
        self.config = config
        self.register_buffer("d2t", torch.arange(config.draft_vocab_size), persistent=False)  # [Vd] target ids
        self.embed: nn.Embedding | None = None  # the target's table (attach_embedding)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.config.layers

    @property
    def dtype(self) -> torch.dtype:
        return next(p.dtype for p in self.parameters() if p.is_floating_point())

    # -- what a family implements ----------------------------------------------------------------------------------
    def new_cache(self, capacity: int, dtype, device) -> KVCache:
        raise NotImplementedError

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """features [B, T, F] (the target's streams at ``feature_layers``, concatenated) -> hidden [B, T, D]."""
        raise NotImplementedError

    def step(self, hidden: torch.Tensor, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """hidden [1, T, D], tokens [1, T] (each row's next-token input) at the cache's next positions -> [1, T, D]."""
        raise NotImplementedError

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, T, D] -> draft-vocabulary logits [B, T, Vd] float32."""
        raise NotImplementedError

    # -- shared ----------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def catch_up(self, features: torch.Tensor, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """The committed rows the head has not read: features [1, T, F] at positions r, tokens [1, T] (the token at
        r + 1) -> the last row's output hidden [1, 1, D], the first draft step's input."""
        return self.step(self.fuse(features), tokens, cache)[:, -1:]

    def attach_embedding(self, embed: nn.Embedding) -> None:
        """The target's embedding table, used as it is (not a submodule: never saved with the head)."""
        self.__dict__["embed"] = embed

    def attach_target(self, target: nn.Module) -> None:
        """The target's parts the head uses as they are (never saved with it): its embedding table, and whatever
        else a family reads (Medusa: the final norm)."""
        self.attach_embedding(target.embed_tokens)

    def public_name(self, ours: str) -> str:
        """Our tensor name -> the family's published one."""
        for mine, public in self.PUBLIC_NAMES.items():
            ours = ours.replace(mine, public)
        return ours

    def our_name(self, public: str) -> str | None:
        """The family's published tensor name -> ours (None: a tensor that is not the head's, skipped)."""
        for mine, theirs in self.PUBLIC_NAMES.items():
            public = public.replace(theirs, mine)
        return public

    def freeze_target_rows(self, target: nn.Module) -> None:
        """The LM head becomes the target's rows for the draft vocabulary (EAGLE-1 style), frozen."""
        with torch.no_grad():
            self.lm_head.weight.copy_(frozen_rows(target.lm_head, self.d2t))
        self.lm_head.weight.requires_grad_(False)

    def quantize(self, bits: int = 8) -> bool:
        """int8 / 4-bit matrices on verispec's CPU kernels for draft steps (not the frozen LM head if it is the
        target's native rows); whether it did."""
        if not can_quantize(next(self.parameters()).device):
            return False
        for mod in self.modules():
            if isinstance(mod, Linear) and mod.weight is not None and mod.native is None:
                mod.quantize(bits)
        return True


def frozen_rows(lm_head: Linear, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of a target's LM head as a dense float32 [len(ids), D], whatever its format. A head kept in GGUF
    blocks is read through its own kernel: unit vectors in, one column of the matrix out each (a one-hot row
    quantizes to int8 without loss, so the columns are the dequantized weights)."""
    ids = ids.long()
    if lm_head.native is None:
        return lm_head.dense_weight().detach()[ids.to(lm_head.dense_weight().device)].float().cpu()
    D = lm_head.in_features
    cols = []
    for i in range(0, D, 256):
        eye = torch.zeros(min(256, D - i), D, dtype=torch.bfloat16)
        eye[torch.arange(eye.shape[0]), torch.arange(i, i + eye.shape[0])] = 1
        with torch.inference_mode():
            cols.append(lm_head(eye)[:, ids].float())  # [chunk, len(ids)]
    return torch.cat(cols).t().contiguous()  # [len(ids), D]
