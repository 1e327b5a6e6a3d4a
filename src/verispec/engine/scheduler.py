"""Continuous batching for speculative decoding: which sequences run this step, and which positions each feeds.

Every scheduled sequence feeds a run of positions [start, start + num_tokens) (a :class:`ScheduledChunk`) in one
batched forward of the target:

- a prefill chunk covers the fixed positions [i * chunk_size, (i + 1) * chunk_size), clipped to the tokens to
  compute, whatever else is in the batch (a chunk that does not fit this step's budget waits whole), so a
  sequence's numerics never depend on its neighbours; the last chunk's logits give the next token;
- a decode/verify row feeds the last committed token and K draft tokens (K = 0: plain decode), their slots
  reserved before the forward.

Positions and slots. ``tokens`` is prompt + committed output; ``num_computed`` counts the leading tokens whose KV
is in the cache. Between steps a decoding sequence has num_computed == len(tokens) - 1: the last committed token is
fed at the start of the next step, as plain decoding feeds the token it just sampled. Prompt x0..x4, chunk_size 4,
K = 3:

  admit    reserve 5 slots (the whole prefill)
  prefill  feed x0..x3 (positions 0-3)                    commit []    num_computed 4
  prefill  feed x4 (position 4); its logits give x5        commit [x5]  num_computed 5, len(tokens) 6
  verify   reserve 5 + 1 + 3 = 9 slots; feed x5 (5) and drafts d6 d7 d8 (6-8). p accepts d6, rejects d7 and
           samples the recovered token x7: commit [d6, x7] (accepted + 1), len(tokens) 8; the KV kept is
           positions 5 and 6, num_computed 7 = len(tokens) - 1; truncate to 7 slots (slots 7-8 held drafts)
  verify   reserve 7 + 1 + K; feed x7 (position 7) and K new drafts ...

Preemption is by recompute (vLLM): the blocks are freed, num_computed = 0, the committed tokens stay, and the
sequence re-prefills prompt + output at the front of the queue; that prefill's last chunk gives the next token.
(Recomputed keys/values come from prefill kernels rather than decode ones: size the cache so that nothing is
preempted where outputs must be bitwise reproducible.) Prefix reuse shares only whole chunks computed by a
prefill: a hit holds the very keys/values that computing those chunks would give.
"""

from __future__ import annotations

import enum
from bisect import insort
from collections import deque
from dataclasses import dataclass, field

from ..errors import ConfigError, VerispecError
from .block_manager import BlockManager


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"  # holds blocks: in prefill (num_computed < prefill_end) or decoding
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request. ``tokens`` defaults to the prompt; ``arrival`` is set by :meth:`Scheduler.add`."""

    seq_id: int
    prompt: list[int]
    max_new_tokens: int
    num_draft_tokens: int = 0  # K wanted per step (0: plain decode)
    fixed_draft: bool = False  # always K draft slots (fewer only at the end): the step waits for room, never cuts K
    tokens: list[int] = field(default_factory=list)  # prompt + committed output
    num_computed: int = 0  # leading tokens whose KV is in the cache
    status: SequenceStatus = SequenceStatus.WAITING
    arrival: int = -1
    num_preemptions: int = 0
    prefill_end: int = 0  # the running prefill computes positions [num_computed, prefill_end)
    share_prefix: bool = True  # may start from blocks another sequence's prefill computed (prefix reuse)

    def __post_init__(self):
        self.tokens = self.tokens or list(self.prompt)

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - len(self.prompt)

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < self.prefill_end


@dataclass(frozen=True)
class ScheduledChunk:
    """Feed ``seq.tokens`` (and, for a verify row, K drafts) at positions [start, start + num_tokens)."""

    seq: Sequence
    start: int
    num_tokens: int  # a prefill chunk, or 1 + num_draft
    is_prefill: bool
    num_draft: int  # K draft slots reserved (0 for prefill)


class Scheduler:
    """Continuous batching (nano-vllm, vLLM v1) under one token budget per step, decode rows included.

    Decode/verify rows go first, by arrival: each has one token of the budget, drafts take what is left in turn
    (K falls as the batch grows). When blocks run short a row's K backs off to 0 first; if even one slot does not
    fit, the most recently arrived running sequence is preempted. Then running prefills continue and waiting
    sequences are admitted (FIFO, preempted ones first) while seats, budget and blocks last.
    """

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 chunk_size: int, prefix_reuse: bool = True):
        if max_num_seqs < 1 or chunk_size < 1 or chunk_size % block_manager.block_size:
            raise ConfigError(f"need max_num_seqs >= 1 and chunk_size a multiple of block_size "
                              f"{block_manager.block_size}, got {max_num_seqs}, {chunk_size}")
        if max_num_batched_tokens < max(chunk_size, max_num_seqs):
            raise ConfigError(f"max_num_batched_tokens {max_num_batched_tokens} must hold a chunk ({chunk_size}) "
                              f"and one token per sequence ({max_num_seqs})")
        self.blocks = block_manager
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.chunk_size, self.prefix_reuse = chunk_size, prefix_reuse
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # by arrival
        self.num_preemptions = 0
        self._arrivals = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def add(self, seq: Sequence) -> None:
        """Queue a request; refuse one that could not run even alone (the cache is too small for it)."""
        if not seq.prompt or seq.max_new_tokens < 1:
            raise VerispecError(f"sequence {seq.seq_id} needs a prompt and max_new_tokens >= 1")
        need = self.blocks.blocks_for(len(seq.prompt) + seq.max_new_tokens - 1)  # the most a sequence ever holds
        if need > self.blocks.num_blocks:
            raise VerispecError(f"sequence {seq.seq_id} ({len(seq.prompt)} prompt tokens, max_new_tokens "
                                f"{seq.max_new_tokens}) needs {need} KV blocks; the cache has {self.blocks.num_blocks}")
        seq.arrival, self._arrivals = self._arrivals, self._arrivals + 1
        self.waiting.append(seq)

    def abort(self, seq_id: int) -> None:
        for seq in [*self.running, *self.waiting]:
            if seq.seq_id == seq_id:
                self.finish(seq)

    def finish(self, seq: Sequence) -> None:
        """Free the sequence's blocks and drop it from its queue; idempotent."""
        if seq.status is SequenceStatus.FINISHED:
            return
        (self.running if seq.status is SequenceStatus.RUNNING else self.waiting).remove(seq)
        self.blocks.free(seq.seq_id)
        seq.status = SequenceStatus.FINISHED

    def schedule(self) -> list[ScheduledChunk]:
        """This step's chunks: decode/verify rows by arrival, then prefill chunks by arrival."""
        chunks = []
        decodes = [s for s in self.running if not s.in_prefill]
        spare = self.max_num_batched_tokens - len(decodes)  # budget for drafts once every row has its one token
        for seq in decodes:
            if seq.status is not SequenceStatus.RUNNING:  # preempted by an older row this step
                continue
            start = seq.num_computed
            k = max(0, min(seq.num_draft_tokens, seq.max_new_tokens - seq.num_generated - 1))
            if seq.fixed_draft and k > spare:
                continue  # its K does not fit this step's budget: it waits a step rather than draft fewer
            k = min(k, spare)
            if not seq.fixed_draft and not self.blocks.can_reserve(seq.seq_id, start + 1 + k):
                k = 0  # speculation backs off before anything is preempted
            while seq.status is SequenceStatus.RUNNING and not self.blocks.can_reserve(seq.seq_id, start + 1 + k):
                self._preempt(self.running[-1])  # the most recently arrived, possibly seq itself
            if seq.status is SequenceStatus.RUNNING:
                self.blocks.reserve(seq.seq_id, start + 1 + k)
                chunks.append(ScheduledChunk(seq, start, 1 + k, False, k))
                spare -= k
        budget = self.max_num_batched_tokens - sum(c.num_tokens for c in chunks)
        for seq in [*(s for s in self.running if s.in_prefill), *self.waiting]:  # running prefills first, then FIFO
            if seq.status is SequenceStatus.WAITING and not self._admit(seq, budget):
                break
            n = self._chunk_len(seq)
            if n > budget:
                break
            chunks.append(ScheduledChunk(seq, seq.num_computed, n, True, 0))
            budget -= n
        return sorted(chunks, key=lambda c: (c.is_prefill, c.seq.arrival))

    def commit(self, chunk: ScheduledChunk, new_tokens: list[int]) -> bool:
        """Record one chunk's outcome; return True when its sequence is finished (aborted, or max_new_tokens).

        A prefill chunk commits no token, its last chunk exactly one (the next token). A verify row commits the
        accepted drafts and one recovered or bonus token (1 to 1 + K tokens): the fed token and the accepted drafts
        are then computed, the rejected drafts' slots are truncated. EOS and stop strings are the caller's: it
        calls :meth:`finish`.
        """
        seq = chunk.seq
        if seq.status is SequenceStatus.FINISHED:
            return True
        if chunk.start != seq.num_computed:
            raise VerispecError(f"stale chunk for sequence {seq.seq_id}: starts at {chunk.start}, "
                                f"{seq.num_computed} computed")
        if chunk.is_prefill:
            lo = hi = int(chunk.start + chunk.num_tokens == seq.prefill_end)  # the last chunk gives the next token
        else:
            lo, hi = 1, 1 + chunk.num_draft  # the accepted drafts + a recovered or bonus token
        if not lo <= len(new_tokens) <= hi:
            raise VerispecError(f"sequence {seq.seq_id}: {len(new_tokens)} tokens committed, expected {lo}..{hi}")
        seq.num_computed += chunk.num_tokens if chunk.is_prefill else len(new_tokens)  # verify: fed + accepted
        seq.tokens += new_tokens
        if chunk.is_prefill and self.prefix_reuse:
            self.blocks.commit_prefix(seq.seq_id, seq.tokens, seq.num_computed // self.chunk_size * self.chunk_size)
        elif not chunk.is_prefill:
            self.blocks.truncate(seq.seq_id, seq.num_computed)
        if seq.num_generated >= seq.max_new_tokens:
            self.finish(seq)
        return seq.status is SequenceStatus.FINISHED

    def _chunk_len(self, seq: Sequence) -> int:
        """Tokens in the sequence's next prefill chunk: up to the next multiple of chunk_size."""
        return min((seq.num_computed // self.chunk_size + 1) * self.chunk_size, seq.prefill_end) - seq.num_computed

    def _admit(self, seq: Sequence, budget: int) -> bool:
        """Start the prefill of the queue's head if a seat, its first chunk and its whole prefill's blocks are free
        (reserving the whole prefill up front: a running prefill never waits for blocks)."""
        if len(self.running) >= self.max_num_seqs:
            return False
        if self.prefix_reuse and seq.share_prefix:
            seq.num_computed = self.blocks.share_prefix(seq.seq_id, seq.tokens, align=self.chunk_size)
        seq.prefill_end = len(seq.tokens)
        if self._chunk_len(seq) > budget or not self.blocks.can_reserve(seq.seq_id, seq.prefill_end):
            self.blocks.free(seq.seq_id)
            seq.num_computed = seq.prefill_end = 0
            return False
        self.blocks.reserve(seq.seq_id, seq.prefill_end)
        self.waiting.popleft()
        seq.status = SequenceStatus.RUNNING
        insort(self.running, seq, key=lambda s: s.arrival)
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Preempt by recompute: free the blocks, keep the committed tokens, go to the front of the queue."""
        self.running.remove(seq)
        self.blocks.free(seq.seq_id)
        seq.num_computed = seq.prefill_end = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
