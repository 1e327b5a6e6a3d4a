"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, SmolLM2) in plain PyTorch.

One forward takes the new token ids, their positions, an optional attention mask and a KV cache;
it returns logits and, on request, the residual stream after chosen layers (draft heads need it).
Q/K/V and gate/up projections are fused into one matrix each: one matrix product instead of three
(or two) per layer, and a wider one, which is what a memory-bound decode step wants.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from ..config import env_flag
from . import hugepages
from .config import ModelConfig
from .kv_cache import KVCache, PagedBatch, PagedKVCache
from .linear import PACK_MIN_WEIGHTS, Linear, can_pack, can_quantize
from .vocab import to_target_vocab


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] (float32, on the CPU whatever the default device: on the meta device
    these ops would import torch._dynamo, seconds of a load: docs/BENCHMARKS.md, "Load time"), with linear /
    llama3 / per-frequency scaling."""
    hd = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64, device="cpu").float() / hd))
    rs = cfg.rope_scaling or {}
    kind = rs.get("rope_type", "default")
    if kind == "linear":
        inv_freq = inv_freq / float(rs["factor"])
    elif kind == "llama3":
        factor, lo, hi = float(rs["factor"]), float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
        old_ctx = float(rs["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_ctx / lo, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_ctx / hi) * ~(wavelen > old_ctx / lo)
        inv_freq = torch.where(medium, smoothed, scaled)
    elif kind == "freq_factors":  # GGUF rope_freqs tensor (llama.cpp divides each frequency by it)
        inv_freq = inv_freq / torch.tensor(rs["factors"], dtype=torch.float32, device="cpu")
    return inv_freq


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


SMALL_T = 16  # decode and verify chunks up to this many tokens take the grouped float32 attention path
MASKED = -1e30  # finite "minus infinity": a query that may see no key gets uniform weights, never NaN


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None):
    """Attention for a few new tokens against a long cache, in float32.

    q: [B, H, T, hd]; k, v: [B, Hkv, S, hd]; mask: [B|1, 1, T, S] bool or None -> [B, H, T, hd].
    The H/Hkv query heads that share a KV head are stacked as extra rows of one matrix product, so
    K and V are read once per KV head (no repeat). On CPU this beats the fused SDPA kernels at T=1
    (docs/BENCHMARKS.md, "Kernel design choices").
    """
    B, H, T, hd = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = H // Hkv
    qg = q.reshape(B * Hkv, G * T, hd).float()
    scores = torch.bmm(qg, k.reshape(B * Hkv, S, hd).float().transpose(1, 2)) * hd**-0.5  # [B Hkv, G T, S]
    if mask is not None:
        scores = scores.view(B, Hkv, G, T, S).masked_fill(~mask[:, :, None], MASKED).view(B * Hkv, G * T, S)
    probs = torch.softmax(scores, dim=-1)
    out = torch.bmm(probs, v.reshape(B * Hkv, S, hd).float())  # [B Hkv, G T, hd]
    return out.view(B, H, T, hd).to(q.dtype)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """q: [B, H, T, hd]; k, v: [B, Hkv, S, hd]; mask: [B|1, 1, T, S] bool or None -> [B, H, T, hd]. A few new
    tokens take grouped_attention, longer chunks the fused SDPA kernels."""
    if q.shape[2] <= SMALL_T:
        return grouped_attention(q, k, v, mask)
    if mask is not None and mask.dtype == torch.bool:  # additive: a row with no visible key stays finite
        mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, MASKED)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def causal_mask(T: int, start: int, window: int | None, device) -> torch.Tensor | None:
    """Causal (and sliding-window) mask [1, 1, T, start+T] for T new tokens after ``start`` cached ones; None if
    every new token sees every key."""
    S = start + T
    if T == 1 and (window is None or S <= window):
        return None
    q_pos = torch.arange(start, S, device=device)[:, None]  # [T, 1]
    k_pos = torch.arange(S, device=device)[None, :]  # [1, S]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask[None, None]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in float32, scale in the model dtype (as the reference implementations do).
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer, self.h, self.hkv, self.hd = layer, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, (self.h + 2 * self.hkv) * self.hd, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.h * self.hd, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x, cos, sin, cache: KVCache, mask):
        # x: [B, T, D]; cos, sin: [B, 1, T, hd]; mask: [B|1, 1, T, S] bool or None (attend to all)
        B, T, _ = x.shape
        qkv = self.qkv_proj(x)  # [B, T, (H + 2 Hkv) hd]
        q, k, v = qkv.split([self.h * self.hd, self.hkv * self.hd, self.hkv * self.hd], dim=-1)
        q = q.view(B, T, self.h, self.hd)
        k = k.view(B, T, self.hkv, self.hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.transpose(1, 2)  # [B, H, T, hd]
        k = k.transpose(1, 2)  # [B, Hkv, T, hd]
        v = v.view(B, T, self.hkv, self.hd).transpose(1, 2)  # [B, Hkv, T, hd]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k_all, v_all = cache.update(self.layer, k, v)  # [B, Hkv, S, hd] each, S = cached + T
        o = attend(q, k_all, v_all, mask)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.h * self.hd))  # [B, T, D]


    def forward_paged(self, x, cos, sin, cache: PagedKVCache, batch: PagedBatch, window: int | None):
        """The same attention for the rows of several sequences on a paged cache, a sequence's chunk at a time as
        the contiguous cache computes it. x: [N, D]; cos, sin: [N, hd] -> [N, D]."""
        N = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.h * self.hd, self.hkv * self.hd, self.hkv * self.hd], dim=-1)
        q, k, v = q.view(N, self.h, self.hd), k.view(N, self.hkv, self.hd), v.view(N, self.hkv, self.hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q * cos[:, None] + rotate_half(q) * sin[:, None]  # [N, H, hd]
        k = k * cos[:, None] + rotate_half(k) * sin[:, None]  # [N, Hkv, hd]
        blocks, offsets = batch.slots(cache.block_size)  # [N] each
        k_pool, v_pool = cache.k[self.layer], cache.v[self.layer]  # [num_blocks, Hkv, block_size, hd]
        k_pool[blocks, :, offsets] = k
        v_pool[blocks, :, offsets] = v
        o = torch.empty_like(q)  # [N, H, hd]
        first = 0
        for (rows, start, _), (blk, off) in zip(batch.chunks, batch.context_slots(cache.block_size)):
            keys = k_pool[blk, :, off].transpose(0, 1)[None]  # [1, Hkv, S, hd]
            values = v_pool[blk, :, off].transpose(0, 1)[None]
            mine = q[first:first + rows].transpose(0, 1)[None]  # [1, H, rows, hd]
            mask = causal_mask(rows, start, window, x.device)
            o[first:first + rows] = attend(mine, keys, values, mask)[0].transpose(0, 1)
            first += rows
        return self.o_proj(o.reshape(N, self.h * self.hd))  # [N, D]


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)  # [B, T, I] each
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self._fused = None  # weight list for forward_fused, built on first use

    def forward(self, x, cos, sin, cache, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, mask)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_fused(self, x, cos, sin, cache: KVCache, window: int):
        """The same layer in one C++ call (csrc/decoder_layer.cpp): one sequence, <= 16 new tokens,
        quantized matrices, causal mask. x: [T, D]; cos, sin: [T, hd] -> [T, D] (batch row 0 only: no
        per-layer slicing on the way in and out)."""
        weights, dims, eps = self.fused_weights()
        k, v = cache.rows0[self.self_attn.layer]
        return kernels._C.decoder_layer_quantized(x, cos, sin, k, v, cache.length, window, weights, dims, eps)

    def forward_paged(self, x, cos, sin, cache: PagedKVCache, batch: PagedBatch, window: int | None, fused: bool):
        """The rows of several sequences on a paged cache. x: [N, D]; cos, sin: [N, hd] -> [N, D]. ``fused``: in one
        C++ call (decoder_layer_paged); otherwise per op, attention a sequence's chunk at a time."""
        if fused:
            weights, dims, eps = self.fused_weights()
            layer = self.self_attn.layer
            return kernels._C.decoder_layer_paged(x, cos, sin, cache.k[layer], cache.v[layer], batch.seqs,
                                                  batch.tables, window or 0, weights, dims, eps)
        x = x + self.self_attn.forward_paged(self.input_layernorm(x), cos, sin, cache, batch, window)
        return x + self.mlp(self.post_attention_layernorm(x))

    def fused_weights(self):
        """(weights, dims, eps) for the C++ layers, built on first use."""
        a, m = self.self_attn, self.mlp
        if self._fused is None:
            def lin(l):
                return [*l.qweights, l.qbias]
            norm = [None if n is None else n.weight.detach() for n in (a.q_norm, a.k_norm)]
            self._fused = ([self.input_layernorm.weight.detach(), *lin(a.qkv_proj), *norm, *lin(a.o_proj),
                            self.post_attention_layernorm.weight.detach(), *lin(m.gate_up_proj), *lin(m.down_proj)],
                           [a.h, a.hkv, a.hd, m.inter], self.input_layernorm.eps)
        return self._fused


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        # No random init: the loader assigns every weight (on the meta device nn.Embedding's init imports
        # torch._dynamo, seconds of every load: docs/BENCHMARKS.md, "Load time").
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.tie_weights()
        # A plain attribute, not a buffer: model.to(bfloat16) must not round the RoPE frequencies.
        self.inv_freq = rope_inv_freq(cfg)  # [hd/2] float32
        self.fused_quantized = False  # quantized matrices: short chunks of one sequence run each layer in one C++ call
        self.head_ids: torch.Tensor | None = None  # [Vh] the token ids of a restricted LM head (restrict_head)

    def tie_weights(self) -> None:
        self.lm_head.weight = self.embed_tokens.weight
        self.lm_head.shared_weight = True

    def pack_weights(self) -> bool:
        """Pre-pack the matrices for oneDNN (CPU), in float32 only those of at least PACK_MIN_WEIGHTS; returns
        whether it packed any. VERISPEC_PACK=0 disables."""
        linears = [m for m in self.modules() if isinstance(m, Linear) and m.weight is not None]
        if not env_flag("VERISPEC_PACK") or not linears or not can_pack(linears[0].weight):
            return False
        big = [m for m in linears if m.weight.dtype != torch.float32 or m.weight.numel() >= PACK_MIN_WEIGHTS]
        for m in big:
            m.pack()
        return bool(big)

    def quantize_weights(self, bits: int = 8) -> bool:
        """int8 or 4-bit weights for every matrix (drafts only: cheaper steps, slightly different q); whether it did."""
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        if not linears or not can_quantize(self.embed_tokens.weight.device):
            return False
        for m in linears:
            if m.native is None:  # GGUF matrices kept native are quantized already
                m.quantize(bits)
        for layer in self.layers:
            layer._fused = None  # the fused layer's weight list is rebuilt from the new matrices
        hugepages.place_model(self)
        self.fused_quantized = True
        return True

    def restrict_head(self, ids: torch.Tensor) -> None:
        """Keep only rows ``ids`` of the LM head; every other token's logit becomes -inf (a draft that
        proposes only frequent tokens reads fewer bytes per step: draft_vocab.py). Call before
        quantize_weights, which then quantizes the smaller head."""
        ids = torch.unique(ids.long()).to(self.embed_tokens.weight.device)  # [Vh] sorted
        w = self.lm_head.dense_weight().detach()[ids]  # [Vh, D]
        head = Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
        head.weight = nn.Parameter(w.clone(), requires_grad=False)
        if self.lm_head.packed is not None:
            head.pack()
        self.lm_head, self.head_ids = head, ids

    def dense_state_dict(self) -> dict[str, torch.Tensor]:
        """state_dict() with packed matrices restored to plain [out, in] tensors."""
        sd = dict(self.state_dict())
        for name, m in self.named_modules():
            if isinstance(m, Linear) and m.packed is not None:
                sd[f"{name}.weight"] = m.dense_weight()
        return sd

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        # positions: [B, T] -> cos, sin: [B, 1, T, hd] in the model dtype
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions[..., None].float() * self.inv_freq  # [B, T, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]

    def default_mask(self, T: int, start: int, device) -> torch.Tensor | None:
        """Causal (and sliding-window) mask [1, 1, T, start+T] for a contiguous chunk; None if all-visible."""
        return causal_mask(T, start, self.config.sliding_window, device)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                mask: torch.Tensor | None = None, num_logits: int | None = None,
                hidden_layers: tuple[int, ...] = ()):
        """Run T new tokens per row through the model, appending their keys/values to ``cache``.

        input_ids, positions: [B, T] (positions: absolute, used for RoPE).
        mask: [B|1, 1, T, cache.length + T] bool (True = may attend), or None for the causal default
            over a contiguous chunk (trees and padded batches pass their own).
        num_logits: compute logits only for the last n positions (None: all T). Prefill wants 1.
        hidden_layers: indices i of the residual stream to return: 0 = embeddings, i = after layer i.
        Returns (logits [B, n, V] float32, {i: hidden [B, T, D]}).
        """
        B, T = input_ids.shape
        start = cache.reserve(T)
        # one sequence, a few tokens, default causal mask, quantized bf16 model: each layer in one C++ call
        fused = (self.fused_quantized and mask is None and B == 1 and T <= kernels.MAX_ROWS
                 and self.dtype == torch.bfloat16)
        if mask is None:
            mask = self.default_mask(T, start, input_ids.device)
        x = self.embed_tokens(input_ids)  # [B, T, D]
        cos, sin = self.rope(positions, x.dtype)
        hidden = {0: x} if 0 in hidden_layers else {}
        if fused:  # [T, D] from layer to layer
            h, cos0, sin0, window = x[0], cos[0, 0], sin[0, 0], self.config.sliding_window or 0
            for i, layer in enumerate(self.layers, start=1):
                h = layer.forward_fused(h, cos0, sin0, cache, window)
                if i in hidden_layers:
                    hidden[i] = h[None]
            x = h[None]
        else:
            for i, layer in enumerate(self.layers, start=1):
                x = layer(x, cos, sin, cache, mask)
                if i in hidden_layers:
                    hidden[i] = x
        cache.advance(T)
        if num_logits is not None:
            x = x[:, T - num_logits:]
        logits = self.lm_head(self.norm(x)).float()  # [B, n, V], or [B, n, Vh] for a restricted head
        if self.head_ids is not None:
            logits = to_target_vocab(logits, self.head_ids, self.config.vocab_size)  # [B, n, V]
        return logits, hidden

    @torch.inference_mode()
    def forward_paged(self, input_ids: torch.Tensor, batch: PagedBatch, cache: PagedKVCache,
                      logit_rows: torch.Tensor | None = None, hidden_layers: tuple[int, ...] = ()):
        """One forward over the new tokens of several sequences (the engine's batched step): prefill chunks,
        decodes and verify chunks together, each sequence's keys/values in the blocks ``batch`` names.

        input_ids: [N], rows grouped by sequence as in ``batch``. logit_rows: [n] rows that need logits (None: all).
        Returns (logits [n, V] float32, {i: hidden [N, D]}). Each row's result does not depend on the other rows
        (with quantized bf16 matrices bitwise: csrc/decoder_layer.cpp).
        """
        x = self.embed_tokens(input_ids)  # [N, D]
        cos, sin = self.rope(batch.positions[None], x.dtype)  # [1, 1, N, hd] each
        cos, sin = cos[0, 0], sin[0, 0]  # [N, hd]
        hidden = {0: x} if 0 in hidden_layers else {}
        window = self.config.sliding_window
        # quantized bf16 matrices in one C++ call per layer (the int8 / 4-bit draft kernels take <= 16 rows)
        native = self.layers[0].self_attn.qkv_proj.native is not None
        fused = (self.fused_quantized and x.dtype == torch.bfloat16
                 and (native or input_ids.shape[0] <= kernels.MAX_ROWS))
        for i, layer in enumerate(self.layers, start=1):
            x = layer.forward_paged(x, cos, sin, cache, batch, window, fused)
            if i in hidden_layers:
                hidden[i] = x
        if logit_rows is not None:
            x = x[logit_rows]
        logits = self.lm_head(self.norm(x)).float()  # [n, V], or [n, Vh] for a restricted head
        if self.head_ids is not None:
            logits = to_target_vocab(logits, self.head_ids, self.config.vocab_size)  # [n, V]
        return logits, hidden

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype
