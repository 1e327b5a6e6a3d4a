"""An EAGLE-3 draft head: one decoder layer that reads the target's own hidden states (Li et al. 2024/2025).

Per position r the head takes the target's residual stream after three of its layers (low / middle / high,
concatenated: 3D) projected by ``fc`` to D, and the embedding of the token that follows (the target's own
table, frozen). One decoder layer of the target's shape whose q/k/v read [norm(embedding), norm(hidden)] (2D
wide), a final norm and an LM head over a reduced draft vocabulary; ``d2t`` maps a draft row to a target id.
Its output hidden state is the next step's input in place of the target's features.

The tensors are named as the EAGLE authors and SpecForge publish them (``fc``, ``midlayer.*``, ``norm``,
``lm_head``, ``d2t``, ``t2d``), so a public head for a supported target loads (heads/io.py). Training:
training/recipes/eagle3.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..models.config import ModelConfig
from ..models.kv_cache import KVCache
from ..models.linear import Linear
from ..models.llama import (
    MASKED,
    SMALL_T,
    RMSNorm,
    grouped_attention,
    rope_inv_freq,
    rotate_half,
)
from .base import DraftHead, HeadConfig, check_layers


@dataclass(frozen=True)
class Eagle3Config(HeadConfig):
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int  # the target's
    draft_vocab_size: int
    layers: tuple[int, ...]  # target residual streams read: 0 = embeddings, i = after layer i
    rope_theta: float = 10000.0
    attention_bias: bool = False
    max_position_embeddings: int = 32768
    num_layers: int = 1  # decoder layers: the first reads [embedding, hidden] (midlayer), the rest its output

    family = "eagle3"  # a class attribute (HeadConfig.family is a ClassVar), not a field

    @classmethod
    def for_target(cls, cfg: ModelConfig, layers: tuple[int, ...] | None, draft_vocab_size: int) -> Eagle3Config:
        """A head of the target's shape. layers default: ``default_layers`` (EAGLE-3: low / middle / high, 2, L/2,
        L-3)."""
        layers = tuple(layers) if layers else cls.default_layers(cfg.num_layers)
        check_layers(layers, cfg.num_layers)
        return cls(cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                   cfg.rms_norm_eps, cfg.vocab_size, min(draft_vocab_size, cfg.vocab_size), layers, cfg.rope_theta,
                   cfg.qkv_bias, cfg.max_position_embeddings)

    @staticmethod
    def default_layers(num_layers: int) -> tuple[int, ...]:
        return default_layers(num_layers)

    @classmethod
    def from_json(cls, raw: dict, target_cfg: ModelConfig) -> Eagle3Config:
        D = int(raw["hidden_size"])
        H = int(raw["num_attention_heads"])
        eagle = raw.get("eagle_config") or {}
        layers = eagle.get("eagle_aux_hidden_state_layer_ids")
        if layers is None:  # vLLM's ids name the residual stream entering layer i: our "after i layers", the same
            layers = default_layers(target_cfg.num_layers)
        return cls(D, int(raw["intermediate_size"]), H, int(raw.get("num_key_value_heads", H)),
                   int(raw.get("head_dim") or D // H), float(raw.get("rms_norm_eps", 1e-6)),
                   int(raw.get("vocab_size", target_cfg.vocab_size)),
                   int(raw.get("draft_vocab_size") or raw.get("vocab_size", target_cfg.vocab_size)),
                   tuple(int(i) for i in layers), float(raw.get("rope_theta", 10000.0)),
                   bool(raw.get("attention_bias", False)),
                   int(raw.get("max_position_embeddings", target_cfg.max_position_embeddings)),
                   int(raw.get("num_hidden_layers", 1)))

    def to_json(self) -> dict:
        return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
                "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
                "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
                "head_dim": self.head_dim, "rms_norm_eps": self.rms_norm_eps, "vocab_size": self.vocab_size,
                "draft_vocab_size": self.draft_vocab_size, "rope_theta": self.rope_theta,
                "attention_bias": self.attention_bias, "max_position_embeddings": self.max_position_embeddings,
                "num_hidden_layers": self.num_layers,
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.layers)}}


def default_layers(num_layers: int) -> tuple[int, ...]:
    L = num_layers
    return tuple(sorted({min(2, L), max(L // 2, 1), max(L - 3, 1)}))


class HeadAttention(nn.Module):
    """A head's attention (grouped heads, RoPE): q/k/v read ``in_features`` (EAGLE-3: 2D, [embedding, hidden])."""

    def __init__(self, c, in_features: int | None = None):
        super().__init__()
        self.h, self.hkv, self.hd = c.num_heads, c.num_kv_heads, c.head_dim
        D_in, bias = in_features or 2 * c.hidden_size, c.attention_bias
        self.q_proj = Linear(D_in, self.h * self.hd, bias=bias)
        self.k_proj = Linear(D_in, self.hkv * self.hd, bias=bias)
        self.v_proj = Linear(D_in, self.hkv * self.hd, bias=bias)
        self.o_proj = Linear(self.h * self.hd, c.hidden_size, bias=False)

    def qkv(self, x, cos, sin):
        """x: [B, T, D_in]; cos, sin: [B, 1, T, hd] -> q [B, H, T, hd], k, v [B, Hkv, T, hd] (RoPE applied)."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.h, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.hkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.hkv, self.hd).transpose(1, 2)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def out(self, o):
        """o: [B, H, T, hd] -> [B, T, D]."""
        B, _, T, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.h * self.hd))


class MidLayer(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        D, I = c.hidden_size, c.intermediate_size
        self.input_layernorm = RMSNorm(D, c.rms_norm_eps)  # on the token embedding
        self.hidden_norm = RMSNorm(D, c.rms_norm_eps)  # on the fused target features (or the head's own output)
        self.self_attn = HeadAttention(c)
        self.post_attention_layernorm = RMSNorm(D, c.rms_norm_eps)
        self.gate_proj = Linear(D, I, bias=False)  # public layout: mlp.gate_proj / up_proj / down_proj
        self.up_proj = Linear(D, I, bias=False)
        self.down_proj = Linear(I, D, bias=False)

    def mlp(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def inputs(self, emb, hidden):
        return torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)  # [B, T, 2D]

    def finish(self, hidden, attn_out):
        h = hidden + attn_out
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderLayer(nn.Module):
    """The Llama / Qwen2 decoder layer (pre-norm attention and SwiGLU MLP) on a head's own KV cache: an MTP module's
    layer, and a deeper head's layers after its first."""

    def __init__(self, c):
        super().__init__()
        D, I = c.hidden_size, c.intermediate_size
        self.input_layernorm = RMSNorm(D, c.rms_norm_eps)
        self.self_attn = HeadAttention(c, D)
        self.post_attention_layernorm = RMSNorm(D, c.rms_norm_eps)
        self.gate_proj = Linear(D, I, bias=False)  # published: mlp.gate_proj / up_proj / down_proj
        self.up_proj = Linear(D, I, bias=False)
        self.down_proj = Linear(I, D, bias=False)

    def mlp(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def forward(self, h, attend):
        """h [B, T, D]; ``attend(self_attn, x)`` -> attention output [B, T, D] (the caller's mask and cache)."""
        h = h + attend(self.self_attn, self.input_layernorm(h))
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Head(DraftHead):
    Config = Eagle3Config
    PUBLIC_NAMES = {f"midlayer.{m}.": f"midlayer.mlp.{m}." for m in ("gate_proj", "up_proj", "down_proj")}

    def __init__(self, c: Eagle3Config):
        super().__init__(c)
        D = c.hidden_size
        self.fc = Linear(len(c.layers) * D, D, bias=False)
        self.midlayer = MidLayer(c)
        self.extra = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_layers - 1))  # deeper heads (P-EAGLE)
        self.norm = RMSNorm(D, c.rms_norm_eps)
        self.lm_head = Linear(D, c.draft_vocab_size, bias=False)
        self.inv_freq = rope_inv_freq(_rope_cfg(c))  # [hd/2] float32 (a plain attribute: never rounded)

    def rope(self, positions: torch.Tensor, dtype):
        freqs = positions[..., None].float() * self.inv_freq.to(positions.device)  # [B, T, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]  # [B, 1, T, hd]

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """features [B, T, nD] -> fc(features) [B, T, D]."""
        return self.fc(features)

    def step_inputs(self, j: int, emb: torch.Tensor, hidden: torch.Tensor, first: torch.Tensor | None = None):
        """What chain step ``j`` reads (training's unroll): the next token's embedding and the previous step's hidden
        state [B, T, D] each (P-EAGLE: learned mask inputs from step 1 on; ``first``: step 0's output)."""
        return emb, hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, T, D] -> draft-vocabulary logits [B, T, Vd] float32."""
        return self.lm_head(self.norm(hidden)).float()

    # -- inference: one sequence, its own KV cache ---------------------------------------------------------------
    @torch.inference_mode()
    def step(self, hidden: torch.Tensor, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Feed T rows at the cache's next positions: hidden [1, T, D] (fc(features) or the head's own output),
        tokens [1, T] (the token each row's next-token input is) -> output hidden [1, T, D]."""
        return self.layers_forward(self.embed(tokens).to(hidden.dtype), hidden, cache)

    def layers_forward(self, emb: torch.Tensor, hidden: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """The decoder layers on T rows at the cache's next positions: emb, hidden [1, T, D] -> [1, T, D]."""
        m, T = self.midlayer, emb.shape[1]
        h = m.finish(hidden, cached_attention(m.self_attn, m.inputs(emb, hidden), self.rope, cache, 0))
        for i, layer in enumerate(self.extra, 1):
            h = layer(h, lambda a, x, i=i: cached_attention(a, x, self.rope, cache, i))
        cache.advance(T)
        return h

    def new_cache(self, capacity: int, dtype, device) -> KVCache:
        c = self.config
        return KVCache(c.num_layers, 1, c.num_kv_heads, capacity, c.head_dim, dtype, device)


def cached_attention(attn: HeadAttention, x: torch.Tensor, rope, cache: KVCache, layer: int = 0) -> torch.Tensor:
    """x [1, T, D_in] at the cache's next positions -> attention output [1, T, D] over the cache and these rows
    (causal); the rows' keys and values stay in the cache's ``layer`` (the caller advances it once all its layers
    have run). ``rope(positions [1, T], dtype)`` -> cos, sin."""
    T, start = x.shape[1], cache.reserve(x.shape[1])
    cos, sin = rope(torch.arange(start, start + T, device=x.device)[None], x.dtype)
    q, k, v = attn.qkv(x, cos, sin)
    k_all, v_all = cache.update(layer, k, v)  # [1, Hkv, S, hd]
    mask = None
    if T > 1:
        S = start + T
        mask = (torch.arange(S, device=x.device)[None] <= torch.arange(start, S, device=x.device)[:, None])[None, None]
    if T <= SMALL_T:
        o = grouped_attention(q, k_all, v_all, mask)
    else:
        add = None if mask is None else torch.zeros(mask.shape, dtype=q.dtype).masked_fill_(~mask, MASKED)
        o = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=add, enable_gqa=attn.h != attn.hkv)
    return attn.out(o)


def _rope_cfg(c: Eagle3Config) -> ModelConfig:
    return ModelConfig("llama", c.vocab_size, c.hidden_size, c.intermediate_size, 1, c.num_heads, c.num_kv_heads,
                       c.head_dim, c.rms_norm_eps, c.max_position_embeddings, c.rope_theta)
