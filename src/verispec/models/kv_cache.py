"""Preallocated KV cache with an explicit length counter.

Slots [0, length) hold keys/values of committed-or-computed tokens. A forward over T new tokens
writes slots [length, length + T) in every layer and then advances ``length`` by T. Rollback after a
rejected draft is ``truncate(n)``: an O(1) counter change, the stale slots are simply overwritten
later (nanochat ``cache_seqlens``; vLLM ``num_computed_tokens -= num_rejected``).
"""

from __future__ import annotations

import torch

from ..errors import VerispecError


class KVCache:
    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, capacity: int, head_dim: int,
                 dtype: torch.dtype, device: str | torch.device = "cpu"):
        shape = (num_layers, batch, num_kv_heads, capacity, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)  # [L, B, Hkv, capacity, hd]
        self.v = torch.empty(shape, dtype=dtype, device=device)  # [L, B, Hkv, capacity, hd]
        self.capacity = capacity
        self.length = 0
        self.rows0 = [(self.k[i, 0], self.v[i, 0]) for i in range(num_layers)]  # each layer's batch row 0 (fused layers)

    @classmethod
    def for_model(cls, cfg, batch: int, capacity: int, dtype: torch.dtype, device="cpu") -> "KVCache":
        return cls(cfg.num_layers, batch, cfg.num_kv_heads, capacity, cfg.head_dim, dtype, device)

    def reserve(self, num_new: int) -> int:
        """Check that ``num_new`` more tokens fit; return the first slot they will occupy."""
        if self.length + num_new > self.capacity:
            raise VerispecError(f"KV cache full: {self.length} + {num_new} tokens > capacity {self.capacity}")
        return self.length

    def update(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor):
        """Write this layer's new keys/values at [length, length+T); return views of [0, length+T).

        k_new, v_new: [B, Hkv, T, hd]. Does not advance ``length`` (see :meth:`advance`).
        """
        start, end = self.length, self.length + k_new.shape[2]
        self.k[layer, :, :, start:end] = k_new
        self.v[layer, :, :, start:end] = v_new
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]  # [B, Hkv, end, hd] each

    def advance(self, num_new: int) -> None:
        self.length += num_new

    def truncate(self, n: int) -> None:
        """Roll back to the first ``n`` tokens (O(1))."""
        if not 0 <= n <= self.length:
            raise ValueError(f"truncate({n}) outside [0, {self.length}]")
        self.length = n
