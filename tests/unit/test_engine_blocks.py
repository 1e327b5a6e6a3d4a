"""The paged KV block manager: accounting against a reference model, slots, rollback, prefix sharing."""

from __future__ import annotations

import random

import pytest

from verispec import ConfigError, VerispecError
from verispec.engine import BlockManager


def check_invariants(bm: BlockManager, expected_slots: dict[int, int]) -> None:
    """Tables match the reference slot counts; every block's refcount is the number of tables holding it."""
    holders = [0] * bm.num_blocks
    for seq_id, slots in expected_slots.items():
        table = bm.block_table(seq_id)
        assert bm.num_slots(seq_id) == slots
        assert len(table) == -(-slots // bm.block_size)
        for block in table:
            holders[block] += 1
    assert holders == [bm.ref_count(b) for b in range(bm.num_blocks)]
    assert bm.num_used == sum(1 for h in holders if h) and bm.num_free + bm.num_used == bm.num_blocks
    assert bm.usage == pytest.approx(bm.num_used / bm.num_blocks)


@pytest.mark.parametrize("seed", range(3))
def test_random_reserve_truncate_free_match_a_reference(seed):
    rng = random.Random(seed)
    bm = BlockManager(num_blocks=24, block_size=4)
    slots: dict[int, int] = {}  # the reference: slots reserved per sequence
    rejected = 0
    for _ in range(3000):
        seq_id, op = rng.randrange(6), rng.random()
        old = bm.block_table(seq_id)
        if op < 0.5:
            n = rng.randrange(0, 40)
            grow = max(0, -(-n // 4) - len(old))
            assert bm.can_reserve(seq_id, n) == (grow <= bm.num_free)
            if grow > bm.num_free:
                with pytest.raises(VerispecError):
                    bm.reserve(seq_id, n)
                rejected += 1
            else:
                table = bm.reserve(seq_id, n)
                assert table[: len(old)] == old  # never shrinks, never moves
                slots[seq_id] = max(slots.get(seq_id, 0), n)
        elif op < 0.8 and slots.get(seq_id):
            n = rng.randrange(0, slots[seq_id] + 1)
            bm.truncate(seq_id, n)
            assert bm.block_table(seq_id) == old[: -(-n // 4)]  # the kept blocks stay in place
            slots[seq_id] = n
        else:
            bm.free(seq_id)
            bm.free(seq_id)  # idempotent
            slots.pop(seq_id, None)
        check_invariants(bm, slots)
        physical = [bm.slot(s, p) for s, n in slots.items() for p in range(n)]
        assert len(set(physical)) == len(physical) and all(0 <= x < 24 * 4 for x in physical)
    assert rejected > 50  # the cache did run full
    for seq_id in list(slots):
        bm.free(seq_id)
    assert bm.num_free == bm.num_blocks and bm.usage == 0


def test_slots_follow_the_block_table():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.reserve(7, 2)
    bm.reserve(8, 5)
    table = bm.reserve(7, 9)  # grows from 1 block to 3
    assert len(table) == 3 and bm.num_used == 5
    assert [bm.slot(7, p) for p in (0, 3, 4, 8)] == [table[0] * 4, table[0] * 4 + 3, table[1] * 4, table[2] * 4]
    with pytest.raises(IndexError):
        bm.slot(7, 9)  # not reserved
    bm.reserve(7, 3)  # never shrinks
    assert bm.num_slots(7) == 9 and len(bm.block_table(7)) == 3


def test_truncate_frees_only_whole_blocks_past_the_kept_slots():
    bm = BlockManager(num_blocks=8, block_size=4)
    table = list(bm.reserve(1, 11))  # 3 blocks
    bm.truncate(1, 5)  # slots 0-4: blocks 0 and 1 (slots 5-7 in block 1 are stale, overwritten later)
    assert bm.block_table(1) == table[:2] and bm.num_free == 6 and bm.num_slots(1) == 5
    bm.truncate(1, 4)
    assert bm.block_table(1) == table[:1]
    with pytest.raises(ValueError):
        bm.truncate(1, 5)  # past the reserved slots
    bm.truncate(1, 0)
    assert bm.num_free == 8


def test_reserve_refuses_past_the_free_blocks():
    bm = BlockManager(num_blocks=3, block_size=4)
    bm.reserve(1, 8)
    assert bm.can_reserve(1, 12) and not bm.can_reserve(2, 5)
    with pytest.raises(VerispecError, match="KV cache full"):
        bm.reserve(2, 5)
    assert bm.block_table(2) == [] and bm.num_free == 1  # nothing taken by the refused call
    with pytest.raises(ConfigError):
        BlockManager(0, 4)


def test_prefix_sharing_hits_full_committed_blocks_with_refcounts():
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(100, 110))  # 10 tokens: 2 full blocks
    assert bm.share_prefix(1, prompt) == 0  # nothing committed yet
    a = bm.reserve(1, 10)
    bm.commit_prefix(1, prompt, 7)  # only block 0 is full and computed
    assert bm.share_prefix(2, prompt) == 4
    bm.free(2)
    bm.commit_prefix(1, prompt, 10)

    assert bm.share_prefix(2, prompt) == 8  # both full blocks
    b = bm.reserve(2, 11)
    assert b[:2] == a[:2] and b[2] not in a
    assert [bm.ref_count(x) for x in a] == [2, 2, 1]
    assert bm.share_prefix(3, prompt[:8]) == 4  # never the whole prompt: one token is left to compute
    assert bm.share_prefix(4, prompt[:4] + [0] * 6) == 4  # the first block only
    assert bm.share_prefix(5, [0] + prompt[1:]) == 0  # the chain starts at position 0
    assert bm.share_prefix(6, prompt + [1] * 10, align=8) == 8
    assert [bm.ref_count(x) for x in a[:2]] == [5, 3]  # sequences 1, 2, 3, 4, 6 and 1, 2, 6
    with pytest.raises(VerispecError):
        bm.share_prefix(2, prompt)  # only before a sequence's first reserve
    with pytest.raises(ValueError):
        bm.share_prefix(7, prompt, align=6)

    for seq_id in (1, 2, 3, 4, 5, 6):
        bm.free(seq_id)
    assert bm.num_free == 16 and bm.usage == 0
    assert bm.share_prefix(9, prompt) == 8  # a freed block keeps its name until it is handed out again
    assert bm.num_free == 14 and bm.block_table(9) == a[:2]
    bm.free(9)
    bm.reserve(10, 16 * 4)  # every block handed out for something else
    bm.free(10)
    assert bm.share_prefix(11, prompt) == 0 and bm.num_free == 16


def test_freed_named_blocks_are_handed_out_last():
    bm = BlockManager(num_blocks=6, block_size=2)
    prompt = [5, 6, 7, 8, 9]
    bm.reserve(1, 5)
    bm.commit_prefix(1, prompt, 5)
    bm.free(1)  # its tail block (unnamed) is handed out before its named head
    bm.reserve(2, 8)  # four blocks: the three never used, then sequence 1's tail
    assert bm.share_prefix(3, prompt) == 4
