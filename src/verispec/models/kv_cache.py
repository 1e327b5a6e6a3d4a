"""Preallocated KV cache with an explicit length counter.

Slots [0, length) hold keys/values of committed-or-computed tokens. A forward over T new tokens
writes slots [length, length + T) in every layer and then advances ``length`` by T. Rollback after a
rejected draft is ``truncate(n)``: an O(1) counter change, the stale slots are simply overwritten
later (nanochat ``cache_seqlens``; vLLM ``num_computed_tokens -= num_rejected``).
"""

from __future__ import annotations

import threading

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


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two sequences share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


class PrefixCache:
    """One model's KV cache from the last finished request, kept for the next: requests that open alike (a chat
    template's system prompt, the earlier turns of a conversation) feed the model only what follows the common
    prefix. Used for the draft model, whose cache never bears on exactness (the verifier judges whatever it
    proposes); the target's prefill is not shared this way (a prefill in other chunks need not give the same bits
    with dequantized weights, so an AR output could depend on the request before it).

    Thread-safe: ``put`` runs in a finalizer when a request's drafter is dropped, which may be on another thread (the
    server's event loop) than the engine's ``take``."""

    def __init__(self):
        self.entry: tuple | None = None  # (model, cache, tokens): cache holds tokens[:cache.length]
        self._lock = threading.Lock()

    def put(self, model, cache: KVCache, tokens: list[int]) -> None:
        """Keep ``cache`` (holding ``tokens[:cache.length]``) for the next request on ``model``."""
        with self._lock:
            self.entry = (model, cache, tokens)

    def limit(self, n: int) -> None:
        """Keep at most the first n tokens (0: forget everything)."""
        with self._lock:
            if self.entry is not None:
                self.entry[1].truncate(min(n, self.entry[1].length))

    def reusable(self, model, context: list[int]) -> int:
        """How many leading tokens of ``context`` the kept cache holds for ``model``; never all of them (the
        model must be fed at least one token to give logits)."""
        return _reusable(self.entry, model, context)

    def take(self, model, context: list[int], capacity: int, dtype, device) -> KVCache:
        """A cache of ``capacity`` for ``model`` holding the reusable prefix of ``context`` (0 tokens if none). The
        kept cache is handed over (or copied from, when too small) and forgotten: a request running at the same
        time gets a fresh one."""
        with self._lock:  # one read of the entry: a put between two reads would pair one cache with another's count
            entry, self.entry = self.entry, None
        n = _reusable(entry, model, context)
        kept = entry[1] if entry is not None else None
        if n and kept.capacity >= capacity:
            kept.truncate(n)
            return kept
        cache = KVCache.for_model(model.config, 1, capacity, dtype, device)
        if n:
            cache.k[:, :, :, :n] = kept.k[:, :, :, :n]
            cache.v[:, :, :, :n] = kept.v[:, :, :, :n]
            cache.length = n
        return cache


def _reusable(entry: tuple | None, model, context: list[int]) -> int:
    if entry is None or entry[0] is not model:
        return 0
    _, cache, tokens = entry
    limit = min(cache.length, len(tokens), len(context) - 1)  # tokens: a request may end mid-round
    return common_prefix(tokens[:limit], context[:limit])


class PagedKVCache:
    """One model's KV cache in fixed-size blocks that many sequences share (vLLM PagedAttention): k, v
    [L, num_blocks, Hkv, block_size, hd]. Which blocks a sequence holds, and so where its position p lives (block
    ``table[p // block_size]``, slot ``p % block_size``), is the engine's business (engine/block_manager.py); a
    forward is told by a :class:`PagedBatch`."""

    def __init__(self, num_layers: int, num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int,
                 dtype: torch.dtype, device: str | torch.device = "cpu"):
        shape = (num_layers, num_blocks, num_kv_heads, block_size, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)  # [L, num_blocks, Hkv, block_size, hd]
        self.v = torch.empty(shape, dtype=dtype, device=device)  # [L, num_blocks, Hkv, block_size, hd]
        self.num_blocks, self.block_size = num_blocks, block_size

    @classmethod
    def for_model(cls, cfg, num_blocks: int, block_size: int, dtype: torch.dtype, device="cpu") -> "PagedKVCache":
        return cls(cfg.num_layers, num_blocks, cfg.num_kv_heads, block_size, cfg.head_dim, dtype, device)


class PagedBatch:
    """The rows of one batched forward, grouped by sequence: sequence s feeds ``rows`` tokens at positions
    [start, start + rows), its keys/values in the blocks of its ``table``.

    seqs: [S, 3] int64 (first row, rows, start); tables: [S, max_blocks] int32 (each table padded with its last
    block); positions: [N] int64.
    """

    def __init__(self, chunks: list[tuple[int, int, list[int]]], device: str | torch.device = "cpu"):
        """chunks: (rows, start, block table) per sequence, in row order."""
        if not chunks or any(rows < 1 or not table for rows, _, table in chunks):
            raise VerispecError("a paged batch needs at least one sequence, each with rows and a block table")
        firsts = [0]
        for rows, _, _ in chunks[:-1]:
            firsts.append(firsts[-1] + rows)
        width = max(len(table) for _, _, table in chunks)
        self.seqs = torch.tensor([[f, rows, start] for f, (rows, start, _) in zip(firsts, chunks)], dtype=torch.long)
        self.tables = torch.tensor([table + table[-1:] * (width - len(table)) for _, _, table in chunks],
                                   dtype=torch.int32)
        self.positions = torch.cat([torch.arange(start, start + rows) for rows, start, _ in chunks]).to(device)
        self.chunks = chunks
        self._slots: tuple[torch.Tensor, torch.Tensor] | None = None
        self._context_slots: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    @property
    def num_rows(self) -> int:
        return int(self.positions.shape[0])

    def slots(self, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, offset) of every row's position: [N] int64 each (computed once per batch)."""
        if self._slots is None:
            blocks = torch.cat([torch.tensor(table, dtype=torch.long)[torch.arange(start, start + rows) // block_size]
                                for rows, start, table in self.chunks])
            self._slots = blocks.to(self.positions.device), self.positions % block_size
        return self._slots

    def context_slots(self, block_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per sequence, (block, offset) of each position its rows attend to, [0, start + rows): [S] int64 each
        (computed once per batch)."""
        if self._context_slots is None:
            device = self.positions.device
            self._context_slots = []
            for rows, start, table in self.chunks:
                pos = torch.arange(start + rows)
                blocks = torch.tensor(table, dtype=torch.long)[pos // block_size]
                self._context_slots.append((blocks.to(device), (pos % block_size).to(device)))
        return self._context_slots
