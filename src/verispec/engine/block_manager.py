"""Paged KV cache bookkeeping: fixed-size blocks, one block table per sequence, prefix reuse of full blocks.

The physical cache is ``num_blocks * block_size`` slots. A sequence's position p lives at slot
``block_table[p // block_size] * block_size + p % block_size`` (vLLM PagedAttention). ``reserve`` grows a table
before a forward writes new positions; rollback after rejected drafts is ``truncate``: a counter change that frees
the whole blocks past the kept slots (stale slots inside a kept block are overwritten later).

Prefix reuse (vLLM automatic prefix caching, nano-vllm's chained hash): a full block is named by a hash of every
token from position 0 to its end, chained block to block. ``commit_prefix`` names a sequence's full, computed,
verified blocks; ``share_prefix`` attaches a new sequence to the named blocks its tokens open with (refcount + 1).
Only such blocks are shared and a sequence writes only past them, so a shared block is never written. A freed
block keeps its name until it is handed out for something else (oldest-freed first), so a later identical prompt
can still hit it.
"""

from __future__ import annotations

import hashlib
from array import array

from ..errors import ConfigError, VerispecError


def block_hash(parent: bytes, tokens: list[int]) -> bytes:
    """The chained name of a full block: its tokens and the name of the block before it (b"" for the first)."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


class BlockManager:
    """Which physical blocks each sequence (an int id) holds, with a refcount per block."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ConfigError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._refs = [0] * num_blocks  # sequences holding each block
        self._names: list[bytes | None] = [None] * num_blocks  # each block's chained hash, once committed
        self._named: dict[bytes, int] = {}  # chained hash -> block
        self._free = dict.fromkeys(range(num_blocks))  # an ordered set: oldest-freed first
        self._tables: dict[int, list[int]] = {}  # seq_id -> block table
        self._slots: dict[int, int] = {}  # seq_id -> slots reserved (positions 0..n-1)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def blocks_for(self, num_slots: int) -> int:
        """Blocks that ``num_slots`` slots occupy."""
        return -(-num_slots // self.block_size)

    def block_table(self, seq_id: int) -> list[int]:
        return list(self._tables.get(seq_id, ()))

    def num_slots(self, seq_id: int) -> int:
        return self._slots.get(seq_id, 0)

    def ref_count(self, block_id: int) -> int:
        return self._refs[block_id]

    def slot(self, seq_id: int, position: int) -> int:
        """The physical slot of ``position`` in a sequence (a reserved one)."""
        if not 0 <= position < self.num_slots(seq_id):
            raise IndexError(f"position {position} of sequence {seq_id} is not reserved")
        return self._tables[seq_id][position // self.block_size] * self.block_size + position % self.block_size

    def can_reserve(self, seq_id: int, num_slots: int) -> bool:
        return self.blocks_for(num_slots) - len(self._tables.get(seq_id, ())) <= len(self._free)

    def reserve(self, seq_id: int, num_slots: int) -> list[int]:
        """Grow the sequence's table to hold slots 0..num_slots-1 (never shrinks); return the table."""
        table = self._tables.get(seq_id, [])
        need = self.blocks_for(num_slots) - len(table)
        if need > len(self._free):
            raise VerispecError(f"KV cache full: sequence {seq_id} needs {need} more blocks, {len(self._free)} free")
        table.extend(self._take() for _ in range(need))
        self._tables[seq_id] = table
        self._slots[seq_id] = max(self.num_slots(seq_id), num_slots)
        return list(table)

    def truncate(self, seq_id: int, num_slots: int) -> None:
        """Keep slots 0..num_slots-1 (rollback); the whole blocks past them go back to the free pool."""
        if not 0 <= num_slots <= self.num_slots(seq_id):
            raise ValueError(f"truncate({num_slots}) outside [0, {self.num_slots(seq_id)}] for sequence {seq_id}")
        if seq_id in self._tables:
            table, keep = self._tables[seq_id], self.blocks_for(num_slots)
            self._release(table[keep:])
            del table[keep:]
            self._slots[seq_id] = num_slots

    def free(self, seq_id: int) -> None:
        """Release every block of the sequence (finished, aborted or preempted); idempotent."""
        self._release(self._tables.pop(seq_id, []))
        self._slots.pop(seq_id, None)

    def share_prefix(self, seq_id: int, tokens: list[int], align: int | None = None) -> int:
        """Attach the named blocks ``tokens`` opens with to a sequence that holds none yet; return how many tokens
        they cover (already computed). At least one token is left to compute, and the count is a multiple of
        ``align`` (a multiple of block_size; default block_size)."""
        bs, align = self.block_size, align or self.block_size
        if align % bs:
            raise ValueError(f"align {align} is not a multiple of block_size {bs}")
        if self._tables.get(seq_id):
            raise VerispecError(f"sequence {seq_id} already holds blocks: share_prefix comes before its first reserve")
        hits, name = [], b""
        for start in range(0, (len(tokens) - 1) // align * align, bs):
            name = block_hash(name, tokens[start:start + bs])
            if name not in self._named:
                break
            hits.append(self._named[name])
        hits = hits[: len(hits) * bs // align * align // bs]
        for block in hits:
            self._free.pop(block, None)
            self._refs[block] += 1
        if hits:
            self._tables[seq_id], self._slots[seq_id] = hits, len(hits) * bs
        return len(hits) * bs

    def commit_prefix(self, seq_id: int, tokens: list[int], num_computed: int) -> None:
        """Name the sequence's full blocks among its first ``num_computed`` tokens (computed and verified), so
        later sequences that open with the same tokens can share them."""
        table, bs, name = self._tables.get(seq_id, []), self.block_size, b""
        for i in range(min(num_computed, len(tokens), self.num_slots(seq_id)) // bs):
            if self._names[table[i]] is None:
                self._names[table[i]] = block_hash(name, tokens[i * bs:(i + 1) * bs])
                self._named[self._names[table[i]]] = table[i]
            name = self._names[table[i]]

    def _take(self) -> int:
        """Hand out the oldest-freed block, forgetting its name."""
        block = next(iter(self._free))
        del self._free[block]
        name, self._names[block] = self._names[block], None
        if name is not None and self._named.get(name) == block:
            del self._named[name]
        self._refs[block] = 1
        return block

    def _release(self, blocks: list[int]) -> None:
        for block in reversed(blocks):  # a table's tail is handed out again before its (more shareable) head
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free[block] = None
