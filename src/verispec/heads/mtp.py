"""A multi-token-prediction (MTP) module as DeepSeek-V3, MiMo and Qwen3.5 ship inside their checkpoints: the
next token's embedding and the target's last hidden state, each normed, concatenated, projected back to D, one decoder
layer of the target's shape, a final norm and the target's LM head. Fed (features at r, token x_{r+1}) it predicts
x_{r+2}; its output hidden state is the next step's input, so it drafts in a chain (drafters/head.py, as EAGLE does).

One module, three published namings, all read by heads/io.py (ours is MiMo's, so a file we write is a MiMo one):

    ours                     MiMo (model.mtp_layers.0.)   DeepSeek-V3 (model.layers.{L}.)   Qwen3.5 (mtp.)
    token_layernorm          token_layernorm              enorm                             pre_fc_norm_embedding
    hidden_layernorm         hidden_layernorm             hnorm                             pre_fc_norm_hidden
    input_proj               input_proj                   eh_proj                           fc
    layer.<decoder layer>    <decoder layer>              <decoder layer>                   layers.0.<decoder layer>
    final_layernorm          final_layernorm              shared_head.norm                  norm

Tensors of the trunk around them (a whole checkpoint) are skipped, as is a shipped copy of the LM head (the target's
own is used). The decoder layer is the Llama / Qwen2 one (q/k/v/o, gate/up/down); DeepSeek-V3's MLA attention and
Qwen3.5's gated attention on a Gated DeltaNet trunk are not: their names map, their layers do not run here
(docs/BENCHMARKS.md, "Draft heads"). Training (recipes/mtp.py): the next-next-token objective.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..errors import ConfigError
from ..models.config import ModelConfig
from ..models.kv_cache import KVCache
from ..models.linear import Linear
from ..models.llama import RMSNorm, rope_inv_freq
from .base import DraftHead
from .eagle3 import DecoderLayer, Eagle3Config, _rope_cfg, cached_attention


@dataclass(frozen=True)
class MtpConfig(Eagle3Config):
    """The shape fields of EAGLE-3's head (one decoder layer of the target's shape, a draft vocabulary); ``layers``
    holds one: the target's last residual stream (before its final norm)."""

    family = "mtp"

    def __post_init__(self):
        if len(self.layers) != 1:
            raise ConfigError(f"--layers: an MTP module reads one layer (the last), got {self.layers}")
        if self.num_layers != 1:
            raise ConfigError(f"--head-layers: an MTP module is one decoder layer, got {self.num_layers}")

    @staticmethod
    def default_layers(num_layers: int) -> tuple[int, ...]:
        return (num_layers,)  # the last residual stream

    @classmethod
    def from_json(cls, raw: dict, target_cfg: ModelConfig) -> MtpConfig:
        """Ours (MiMo's model config plus ``draft_vocab_size``), or a published model's config.json: the module has
        the trunk's shapes."""
        D, H = int(raw.get("hidden_size", target_cfg.hidden_size)), int(raw.get("num_attention_heads",
                                                                                 target_cfg.num_heads))
        V = int(raw.get("vocab_size", target_cfg.vocab_size))
        return cls(D, int(raw.get("intermediate_size", target_cfg.intermediate_size)), H,
                   int(raw.get("num_key_value_heads", H)), int(raw.get("head_dim") or D // H),
                   float(raw.get("rms_norm_eps", target_cfg.rms_norm_eps)), V, int(raw.get("draft_vocab_size", V)),
                   (int(raw.get("num_hidden_layers", target_cfg.num_layers)),),
                   float(raw.get("rope_theta", target_cfg.rope_theta)),
                   bool(raw.get("attention_bias", target_cfg.qkv_bias)),
                   int(raw.get("max_position_embeddings", target_cfg.max_position_embeddings)))

    def to_json(self) -> dict:
        return {"architectures": ["MiMoForCausalLM"], "model_type": "mimo", "num_nextn_predict_layers": 1,
                "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
                "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
                "head_dim": self.head_dim, "rms_norm_eps": self.rms_norm_eps, "vocab_size": self.vocab_size,
                "draft_vocab_size": self.draft_vocab_size, "num_hidden_layers": self.layers[0],
                "rope_theta": self.rope_theta, "attention_bias": self.attention_bias,
                "max_position_embeddings": self.max_position_embeddings}


# ours -> MiMo's (the names we write); the other layouts' module parts -> ours
_MLP = {f"layer.{m}.": f"layer.mlp.{m}." for m in ("gate_proj", "up_proj", "down_proj")}
_DEEPSEEK = {"enorm.": "token_layernorm.", "hnorm.": "hidden_layernorm.", "eh_proj.": "input_proj.",
             "shared_head.norm.": "final_layernorm."}
_QWEN35 = {"pre_fc_norm_embedding.": "token_layernorm.", "pre_fc_norm_hidden.": "hidden_layernorm.",
           "fc.": "input_proj.", "norm.": "final_layernorm.", "layers.0.": ""}
_MODULE = ("token_layernorm.", "hidden_layernorm.", "input_proj.", "final_layernorm.")


class MtpHead(DraftHead):
    Config = MtpConfig

    def __init__(self, c: MtpConfig):
        super().__init__(c)
        D = c.hidden_size
        self.token_layernorm = RMSNorm(D, c.rms_norm_eps)
        self.hidden_layernorm = RMSNorm(D, c.rms_norm_eps)
        self.input_proj = Linear(2 * D, D, bias=False)
        self.layer = DecoderLayer(c)
        self.final_layernorm = RMSNorm(D, c.rms_norm_eps)
        self.lm_head = Linear(D, c.draft_vocab_size, bias=False)  # the target's rows for d2t, frozen
        self.inv_freq = rope_inv_freq(_rope_cfg(c))  # [hd/2] float32

    # -- names: ours are MiMo's ("model.mtp_layers.0." + the module's names) ----------------------------------------
    def public_name(self, ours: str) -> str:
        for mine, theirs in _MLP.items():
            ours = ours.replace(mine, theirs)
        return "model.mtp_layers.0." + ours.removeprefix("layer.")

    def our_name(self, public: str) -> str | None:
        """Any layout's name -> ours; None for a tensor that is not the module's (the trunk, the LM head copy)."""
        L = self.config.layers[0]
        if public.startswith("mtp_layers.0."):
            name = public.removeprefix("mtp_layers.0.")
        elif public.startswith(f"layers.{L}."):
            name = public.removeprefix(f"layers.{L}.")
            for theirs, mine in _DEEPSEEK.items():
                name = name.replace(theirs, mine) if name.startswith(theirs) else name
        elif public.startswith("mtp."):
            name = public.removeprefix("mtp.")
            for theirs, mine in _QWEN35.items():
                name = mine + name.removeprefix(theirs) if name.startswith(theirs) else name
        else:
            return None  # the trunk around the module
        if name.startswith(("shared_head.head.", "embed_tokens.", "lm_head.")):
            return None  # copies of the target's own tables
        if not name.startswith(_MODULE):
            name = "layer." + re.sub(r"^mlp\.", "", name)
        return name

    def rope(self, positions: torch.Tensor, dtype):
        freqs = positions[..., None].float() * self.inv_freq.to(positions.device)  # [B, T, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]  # [B, 1, T, hd]

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """features [B, T, D]: the target's last residual stream, used as it is (the module norms it)."""
        return features

    def inputs(self, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] (each row's next token), hidden [B, T, D] -> the layer's input [B, T, D]."""
        emb = self.embed(tokens).to(hidden.dtype)
        return self.input_proj(torch.cat([self.token_layernorm(emb), self.hidden_layernorm(hidden)], dim=-1))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.final_layernorm(hidden)).float()

    @torch.inference_mode()
    def step(self, hidden: torch.Tensor, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """hidden [1, T, D] (the target's features or the module's own output), tokens [1, T] -> output [1, T, D]."""
        h = self.layer(self.inputs(tokens, hidden), lambda a, x: cached_attention(a, x, self.rope, cache))
        cache.advance(tokens.shape[1])
        return h

    def new_cache(self, capacity: int, dtype, device) -> KVCache:
        c = self.config
        return KVCache(1, 1, c.num_kv_heads, capacity, c.head_dim, dtype, device)
