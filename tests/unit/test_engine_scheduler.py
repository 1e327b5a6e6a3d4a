"""The continuous-batching scheduler, driven by a fake model that accepts a random number of drafts per verify.

Every step is checked for: the token budget, max_num_seqs, fixed prefill chunk boundaries, drafts within
max_new_tokens, reserved slots for everything fed, and no write into a shared block.
"""

from __future__ import annotations

import random

import pytest

from verispec import ConfigError, VerispecError
from verispec.engine import BlockManager, Scheduler, Sequence, SequenceStatus


def token(seq_id: int, position: int) -> int:
    """The fake model's token at a position: a function of the position, so a lost or repeated token shows."""
    return (seq_id * 7919 + position * 31) % 1000


def make(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=16, chunk_size=8, **kw):
    return Scheduler(BlockManager(num_blocks, block_size), max_num_seqs, max_num_batched_tokens, chunk_size, **kw)


def step(sched: Scheduler, rng: random.Random, accept_all: bool = False):
    """One scheduled step: check the schedule, then commit what a fake model produced."""
    chunks, bm = sched.schedule(), sched.blocks
    assert chunks or not sched.has_work  # progress whenever there is work
    assert sum(c.num_tokens for c in chunks) <= sched.max_num_batched_tokens
    assert len(chunks) <= sched.num_running <= sched.max_num_seqs
    assert len({id(c.seq) for c in chunks}) == len(chunks)
    assert [(c.is_prefill, c.seq.arrival) for c in chunks] == sorted((c.is_prefill, c.seq.arrival) for c in chunks)
    for c in chunks:
        seq = c.seq
        assert c.start == seq.num_computed and seq.status is SequenceStatus.RUNNING
        if c.is_prefill:
            assert c.start % sched.chunk_size == 0 and c.num_draft == 0
            assert c.start + c.num_tokens == min(c.start + sched.chunk_size, len(seq.tokens))
        else:
            assert c.start == len(seq.tokens) - 1 and c.num_tokens == 1 + c.num_draft
            assert seq.num_generated + c.num_tokens <= seq.max_new_tokens
        for p in range(c.start, c.start + c.num_tokens):  # slot() raises for an unreserved position
            assert bm.ref_count(bm.slot(seq.seq_id, p) // bm.block_size) == 1  # a shared block is never written
    for c in chunks:
        seq, n = c.seq, len(c.seq.tokens)
        if c.is_prefill:
            new = [token(seq.seq_id, n)] if c.start + c.num_tokens == n else []
        else:
            accepted = c.num_draft if accept_all else rng.randint(0, c.num_draft)
            new = [token(seq.seq_id, n + i) for i in range(accepted + 1)]
        sched.commit(c, new)
    holders = [0] * bm.num_blocks  # a block is held by two sequences only through prefix sharing, refcounted
    for seq in sched.running:
        assert seq.in_prefill or seq.num_computed == len(seq.tokens) - 1
        assert seq.num_computed <= bm.num_slots(seq.seq_id)
        for block in bm.block_table(seq.seq_id):
            holders[block] += 1
    assert holders == [bm.ref_count(b) for b in range(bm.num_blocks)]
    assert bm.num_used == sum(map(bool, holders)) and all(not bm.block_table(s.seq_id) for s in sched.waiting)
    return chunks


def run(sched: Scheduler, seqs: list[Sequence], seed: int = 0, max_steps: int = 5000):
    rng = random.Random(seed)
    for seq in seqs:
        sched.add(seq)
    for _ in range(max_steps):
        if not sched.has_work:
            return
        step(sched, rng)
    raise AssertionError("the scheduler did not finish")


def assert_finished_exactly(seqs: list[Sequence]) -> None:
    for seq in seqs:
        assert seq.status is SequenceStatus.FINISHED
        n = len(seq.prompt)
        assert seq.tokens[n:] == [token(seq.seq_id, n + i) for i in range(seq.max_new_tokens)]


def test_constructor_checks():
    with pytest.raises(ConfigError):
        make(block_size=4, chunk_size=6)  # chunks must cover whole blocks
    with pytest.raises(ConfigError):
        make(max_num_batched_tokens=4, chunk_size=8)  # a chunk must fit a step
    with pytest.raises(ConfigError):
        make(max_num_seqs=32, max_num_batched_tokens=16)  # so must one token per sequence


def test_the_documented_position_convention():
    sched = make(num_blocks=8, block_size=4, chunk_size=4)
    bm = sched.blocks
    seq = Sequence(1, prompt=[10, 11, 12, 13, 14], max_new_tokens=10, num_draft_tokens=3)
    sched.add(seq)
    [c] = sched.schedule()
    assert (c.start, c.num_tokens, c.is_prefill) == (0, 4, True) and bm.num_slots(1) == 5
    with pytest.raises(VerispecError):
        sched.commit(c, [99])  # not the last chunk: no token yet
    sched.commit(c, [])
    assert seq.num_computed == 4
    [c] = sched.schedule()
    assert (c.start, c.num_tokens, c.is_prefill) == (4, 1, True)
    sched.commit(c, [15])
    assert (seq.num_computed, len(seq.tokens)) == (5, 6)
    [c] = sched.schedule()
    assert (c.start, c.num_tokens, c.is_prefill, c.num_draft) == (5, 4, False, 3) and bm.num_slots(1) == 9
    with pytest.raises(VerispecError):
        sched.commit(c, [1, 2, 3, 4, 5])  # at most K + 1 tokens
    sched.commit(c, [16, 17])  # one accepted draft and the recovered token
    assert (seq.num_computed, len(seq.tokens), bm.num_slots(1), len(bm.block_table(1))) == (7, 8, 7, 2)
    [c] = sched.schedule()
    assert (c.start, c.num_tokens) == (7, 4)


def test_drafts_never_overshoot_max_new_tokens():
    sched = make()
    seq = Sequence(1, prompt=[1, 2, 3], max_new_tokens=3, num_draft_tokens=8)
    sched.add(seq)
    sched.commit(sched.schedule()[0], [7])
    [c] = sched.schedule()
    assert c.num_draft == 1  # 3 new tokens: the prefill's, then 1 draft + 1 bonus
    assert sched.commit(c, [8, 9]) and seq.status is SequenceStatus.FINISHED
    assert sched.blocks.num_free == sched.blocks.num_blocks and not sched.has_work


def test_prefill_chunks_are_fixed_and_wait_whole():
    sched = make(max_num_batched_tokens=10, chunk_size=8)
    rng = random.Random(0)
    a = Sequence(1, prompt=[1, 2, 3], max_new_tokens=50, num_draft_tokens=3)
    b = Sequence(2, prompt=list(range(20)), max_new_tokens=5)
    sched.add(a)
    step(sched, rng)
    sched.add(b)
    chunks = step(sched, rng)
    assert [(c.seq, c.num_tokens) for c in chunks] == [(a, 4)]  # 6 tokens left: the 8-token chunk waits whole
    assert b.status is SequenceStatus.WAITING
    a.num_draft_tokens = 1
    spans = [(c.start, c.num_tokens) for c in step(sched, rng) if c.seq is b]
    a.num_draft_tokens = 3
    assert [c.seq for c in step(sched, rng)] == [a] and b.in_prefill  # a running prefill's chunk waits whole too
    a.num_draft_tokens = 1
    while b.status is not SequenceStatus.FINISHED:
        spans += [(c.start, c.num_tokens) for c in step(sched, rng) if c.seq is b and c.is_prefill]
    assert spans == [(0, 8), (8, 8), (16, 4)]


def prefill_spans(seq_id: int, crowd: int) -> list[tuple[int, int]]:
    """The prefill chunks of one request, run with ``crowd`` other requests around it."""
    sched, rng = make(num_blocks=256, max_num_seqs=8, max_num_batched_tokens=24), random.Random(crowd)
    for i in range(crowd):
        sched.add(Sequence(100 + i, prompt=list(range(3 + 5 * i)), max_new_tokens=6, num_draft_tokens=i % 4))
    target = Sequence(seq_id, prompt=list(range(500, 537)), max_new_tokens=4, num_draft_tokens=2)
    sched.add(target)
    spans = []
    while sched.has_work:
        spans += [(c.start, c.num_tokens) for c in step(sched, rng) if c.seq is target and c.is_prefill]
    return spans


def test_a_sequence_is_chunked_the_same_alone_and_in_a_batch():
    alone = prefill_spans(1, crowd=0)
    assert alone == [(0, 8), (8, 8), (16, 8), (24, 8), (32, 5)]
    assert prefill_spans(1, crowd=3) == alone and prefill_spans(1, crowd=7) == alone


def test_drafts_share_the_token_budget():
    sched = make(max_num_batched_tokens=8, chunk_size=8)
    rng = random.Random(0)
    seqs = [Sequence(i, prompt=[i, i], max_new_tokens=20, num_draft_tokens=4) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    step(sched, rng)
    chunks = step(sched, rng)
    assert [c.num_draft for c in chunks] == [4, 1, 0]  # one token per row first, drafts from what is left


def test_max_num_seqs_bounds_the_running_set():
    sched = make(max_num_seqs=2)
    seqs = [Sequence(i, prompt=[i] * 5, max_new_tokens=4) for i in range(5)]
    for seq in seqs:
        sched.add(seq)
    step(sched, random.Random(0))
    assert (sched.num_running, sched.num_waiting) == (2, 3)


def test_speculation_backs_off_before_preemption():
    sched = make(num_blocks=3, block_size=4, chunk_size=4)
    rng = random.Random(0)
    a = Sequence(1, prompt=[1, 2, 3], max_new_tokens=8, num_draft_tokens=4)
    b = Sequence(2, prompt=[4, 5, 6], max_new_tokens=8, num_draft_tokens=4)
    sched.add(a)
    sched.add(b)
    step(sched, rng)  # both prefills: one block each
    chunks = step(sched, rng, accept_all=True)
    assert [(c.seq, c.num_draft) for c in chunks] == [(a, 4), (b, 0)]  # one free block: b backs off to K = 0
    assert sched.num_preemptions == 0 and sched.blocks.num_free == 0
    tokens_b = list(b.tokens)
    c = Sequence(3, prompt=[7], max_new_tokens=2)
    sched.add(c)
    chunks = step(sched, rng)  # a needs a third block even at K = 0: b, the newest, is preempted
    assert [(c.seq, c.num_draft) for c in chunks] == [(a, 0)]
    assert sched.num_preemptions == b.num_preemptions == 1
    assert b.status is SequenceStatus.WAITING and b.num_computed == 0 and b.tokens == tokens_b
    assert list(sched.waiting) == [b, c]  # the preempted sequence goes back to the front
    while sched.has_work:
        step(sched, rng)
    assert_finished_exactly([a, b, c])
    assert sched.blocks.num_free == 3


@pytest.mark.parametrize("prefix_reuse", [True, False])
@pytest.mark.parametrize("seed", range(3))
def test_preemption_by_recompute_loses_nothing(seed, prefix_reuse):
    rng = random.Random(seed)
    sched = make(num_blocks=12, block_size=4, max_num_seqs=4, max_num_batched_tokens=24, chunk_size=8,
                 prefix_reuse=prefix_reuse)
    system = list(range(900, 916))  # a shared 16-token opening: prefix hits when reuse is on
    seqs = [Sequence(i, prompt=system + [rng.randrange(1000) for _ in range(rng.randrange(1, 13))],
                     max_new_tokens=rng.randrange(4, 21), num_draft_tokens=rng.randrange(6)) for i in range(12)]
    last_end: dict[int, int] = {}
    fresh_starts = []  # where each admission's prefill began
    for t in range(3000):
        if t < len(seqs):
            sched.add(seqs[t])  # one arrival per step while the others run
        if not sched.has_work:
            break
        for c in step(sched, rng):
            if c.is_prefill:
                if last_end.get(c.seq.seq_id) != c.start:
                    fresh_starts.append(c.start)
                last_end[c.seq.seq_id] = c.start + c.num_tokens
    assert not sched.has_work and sched.num_preemptions > 0
    assert_finished_exactly(seqs)
    assert sched.blocks.num_free == sched.blocks.num_blocks and sched.blocks.usage == 0
    assert any(fresh_starts) == prefix_reuse  # with reuse, some prefills skip the shared 16 tokens


def test_prefix_reuse_shares_whole_prefill_chunks_only():
    sched = make(num_blocks=64, block_size=4, max_num_batched_tokens=40, chunk_size=16)
    rng = random.Random(0)
    a = Sequence(1, prompt=list(range(45)), max_new_tokens=8)
    sched.add(a)
    while a.in_prefill or a.status is SequenceStatus.WAITING:
        step(sched, rng)
    assert sched.blocks.share_prefix(99, list(range(45))) == 32  # blocks of the partial chunk [32, 45) are not named
    sched.blocks.free(99)
    b = Sequence(2, prompt=list(range(40)) + [7] * 10, max_new_tokens=4)
    c = Sequence(3, prompt=list(range(45)) + [8] * 20, max_new_tokens=4)
    sched.add(b)
    sched.add(c)
    chunks = step(sched, rng)
    # a computed [0, 16), [16, 32), [32, 45): only the whole chunks are shared, so the rest is computed alike
    assert [(ch.seq, ch.start) for ch in chunks if ch.is_prefill] == [(b, 32), (c, 32)]
    shared = sched.blocks.block_table(1)[:8]
    assert sched.blocks.block_table(2)[:8] == shared == sched.blocks.block_table(3)[:8]
    assert [sched.blocks.ref_count(x) for x in shared] == [3] * 8
    while sched.has_work:
        step(sched, rng)
    assert_finished_exactly([a, b, c])
    assert sched.blocks.num_free == 64


def test_abort_frees_blocks_and_leaves_the_queues():
    sched = make(max_num_seqs=2, max_num_batched_tokens=16, chunk_size=8)
    rng = random.Random(0)
    a = Sequence(1, prompt=[1] * 3, max_new_tokens=20, num_draft_tokens=2)
    b = Sequence(2, prompt=[2] * 30, max_new_tokens=5)
    c = Sequence(3, prompt=[3] * 4, max_new_tokens=5)
    for seq in (a, b, c):
        sched.add(seq)
    step(sched, rng)
    assert a.status is SequenceStatus.RUNNING and b.in_prefill and c.status is SequenceStatus.WAITING
    chunks = sched.schedule()
    sched.abort(2)  # mid-prefill, during a step
    assert not sched.commit(next(ch for ch in chunks if ch.seq is a), [token(1, len(a.tokens))])
    assert sched.commit(next(ch for ch in chunks if ch.seq is b), [])  # a finished sequence's chunk is ignored
    sched.abort(3)  # waiting
    sched.abort(3)
    sched.abort(42)  # unknown: nothing happens
    assert (sched.num_running, sched.num_waiting) == (1, 0)
    assert sched.blocks.num_used == len(sched.blocks.block_table(1))
    sched.abort(1)
    assert not sched.has_work and sched.blocks.num_free == sched.blocks.num_blocks
    assert all(s.status is SequenceStatus.FINISHED for s in (a, b, c))


def test_a_cache_too_small_for_one_sequence_is_refused():
    sched = make(num_blocks=2, block_size=4)
    with pytest.raises(VerispecError, match="needs 3 KV blocks"):
        sched.add(Sequence(1, prompt=list(range(6)), max_new_tokens=4))  # 9 slots at most: 3 blocks
    seq = Sequence(2, prompt=list(range(5)), max_new_tokens=4, num_draft_tokens=3)  # 8 slots: exactly 2 blocks
    run(sched, [seq])
    assert_finished_exactly([seq])


def test_a_fixed_k_sequence_waits_for_room_rather_than_drafting_fewer():
    """Budget 8, four decoding rows with K = 3: the flexible ones take what is left (3, 1, 0 ...), a fixed one gets
    its full K or waits a step, and every sequence still finishes."""
    sched, rng = make(max_num_batched_tokens=8, max_num_seqs=4), random.Random(0)
    seqs = [Sequence(i, [1], 12, num_draft_tokens=3, fixed_draft=i % 2 == 1) for i in range(4)]
    for seq in seqs:
        sched.add(seq)
    while any(s.in_prefill or s.status is SequenceStatus.WAITING for s in seqs):
        step(sched, rng)
    waited = cut = 0
    while sched.has_work:
        chunks = {c.seq.seq_id: c for c in sched.schedule()}
        for seq in seqs:
            if seq.status is not SequenceStatus.RUNNING:
                continue
            want = min(3, seq.max_new_tokens - seq.num_generated - 1)
            if seq.seq_id not in chunks:
                assert seq.fixed_draft  # only a fixed sequence sits out a step
                waited += 1
            elif chunks[seq.seq_id].num_draft < want:
                assert not seq.fixed_draft
                cut += 1
        for c in chunks.values():
            sched.commit(c, [token(c.seq.seq_id, len(c.seq.tokens) + i) for i in range(rng.randint(0, c.num_draft) + 1)])
    assert waited and cut, (waited, cut)  # the budget was tight enough for both to happen
    assert all(s.num_generated == 12 for s in seqs)
