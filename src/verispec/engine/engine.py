"""One engine step for many requests: schedule, draft, one batched target forward, verify each, commit. The only
decoding loop: the server runs many requests through it, ``LLM.generate`` / ``stream`` one (a batch of one, K fixed
by the request; its drafter may still stop a round early).

1. schedule: which sequences run and which positions each feeds (scheduler.py: prefill chunks, decode rows, room
   for K drafts), then K per request from the measured costs and acceptance (spec/policy.py)
2. propose: each decoding request's drafter proposes up to K tokens (its own state, its own generator)
3. forward: one target forward over every fed row (Transformer.forward_paged on the paged KV cache)
4. accept: per request, rejection sampling on its own rows (verify.py): accepted drafts, then one recovered or
   bonus token; a row with no draft samples the next token as plain decoding does
5. commit / rollback: the scheduler records the tokens and truncates rejected draft slots; drafters roll back

A request draws every random number from its own generator and its rows' logits do not depend on the other rows
(bitwise with native GGUF weights: csrc decoder_layer_paged), so what a request gets does not depend on who shares
its batch.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..spec.costs import Costs
from ..spec.policy import SpecPolicy
from ..config import SamplingParams
from ..drafters.base import Draft, Drafter, DraftRequest
from ..errors import VerispecError
from ..models.kv_cache import PagedBatch, PagedKVCache
from ..models.llama import Transformer
from ..sampling import ProcessorChain, TokenLogprob, draw, make_generator, token_logprobs
from ..spec.verify import verify
from .block_manager import BlockManager
from .scheduler import ScheduledChunk, Scheduler, Sequence, SequenceStatus
from .stats import Stats

log = logging.getLogger("verispec.engine")
MAX_DRAFT_TOKENS = 16  # the most drafts a request may ask for a step (the server's num_speculative_tokens bound)


@dataclass(frozen=True)
class Capture:
    """What a request keeps of the target's forwards for every position it feeds (prompt rows included): the residual
    streams after ``layers`` (Request.features) and the ``topk`` largest log-probabilities of the next token
    (Request.topk_ids / topk_logp): a draft head's training inputs, from the forwards that generate (distillation)."""

    layers: tuple[int, ...]
    topk: int = 16



@dataclass(eq=False)
class Request:
    """One generation in the engine. ``new_tokens``: what the last step committed for it."""

    request_id: int
    seq: Sequence
    params: SamplingParams
    generator: torch.Generator | None
    drafter: object | None = None
    fixed_k: bool = False  # draft the full K every step (no cost model)
    chain: ProcessorChain | None = None  # the padding mask, then the params' transforms: applied to each row chosen
    new_tokens: list[int] = field(default_factory=list)
    new_logprobs: list[TokenLogprob] = field(default_factory=list)  # theirs, with params.logprobs set
    logprobs: list[TokenLogprob] = field(default_factory=list)  # every output token's, with params.logprobs set
    finish_reason: str | None = None  # "eos" | "length" | "abort" | "error"
    error: Exception | None = None  # why it failed (finish_reason "error"): its own failure, no one else's
    features: torch.Tensor | None = None  # [capacity, F]: the drafter's (or capture's) target hidden states
    capture: Capture | None = None
    topk_ids: torch.Tensor | None = None  # [capacity, k] int32 (capture): the target's k likeliest next tokens
    topk_logp: torch.Tensor | None = None  # [capacity, k] float16: their log-probabilities
    num_output: int = 0  # tokens generated so far (the sequence may hold more past an EOS that ended it)
    stats: Stats = field(default_factory=Stats)
    last_round: tuple[int, float] | None = None  # (verify size, when its drafting ended) of the last drafting step

    @property
    def drafted(self) -> int:
        return self.stats.drafted_tokens

    @property
    def accepted(self) -> int:
        return self.stats.accepted_tokens

    @property
    def output_ids(self) -> list[int]:
        """Every token generated so far (an EOS that ended the request included)."""
        P = len(self.seq.prompt)
        return self.seq.tokens[P:P + self.num_output]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Engine:
    """Continuous batching with speculative decoding on one target model."""

    def __init__(self, target: Transformer, num_blocks: int, block_size: int = 16, max_num_seqs: int = 16,
                 max_num_batched_tokens: int = 512, chunk_size: int = 256, logit_mask: torch.Tensor | None = None,
                 eos_token_ids: tuple[int, ...] = (), prefix_reuse: bool = True,
                 max_draft_tokens: int = MAX_DRAFT_TOKENS, costs: Costs | None = None, grammars=None):
        self.max_draft_tokens = max_draft_tokens  # no request drafts more a step, whatever it asks
        self.grammars = grammars  # the model's sampling.Grammars: a request's response format (None: refused)
        self.target, self.logit_mask, self.eos_token_ids = target, logit_mask, tuple(eos_token_ids)
        self.device = target.embed_tokens.weight.device
        self.cache = PagedKVCache.for_model(target.config, num_blocks, block_size, target.dtype, self.device)
        self.blocks = BlockManager(num_blocks, block_size)
        self.scheduler = Scheduler(self.blocks, max_num_seqs, max_num_batched_tokens, chunk_size, prefix_reuse)
        self.requests: dict[int, Request] = {}
        self.costs = Costs() if costs is None else costs  # every measured cost: the one store (spec/costs.py)
        self.policy = SpecPolicy(self.costs)
        self._ids = itertools.count()

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def add(self, prompt_ids: list[int], params: SamplingParams,
            drafter: Drafter | Callable[[int], Drafter | None] | None = None, num_draft_tokens: int = 0,
            fixed_k: bool = False, capture: Capture | None = None) -> Request:
        """Queue a request; its drafter proposes up to K tokens a step, as many as the cost model gives it in each
        step's batch (``fixed_k``: always K). ``drafter``: a Drafter, or a factory that makes one for the request's
        K (a drafter that sizes state by K, such as auto, must be made this way).

        K is set here, once: ``num_draft_tokens``, at most ``max_draft_tokens``, and with ``fixed_k`` at most what a
        step's budget holds beside one row per seat (a fixed K then always fits in turn). Every per-request
        structure (the drafter, its controller in the policy, its stats) is sized by it. A seeded sampling request
        always drafts its full K: how many random numbers its drafts and verdicts use must not depend on the batch,
        so that the same seed gives the same text whoever shares the server (greedy output never depends on K).
        ``capture``: keep the target's features and top-k log-probabilities of every position (not with a drafter
        that reads features of its own)."""
        if not prompt_ids:
            raise VerispecError("empty prompt")
        V = self.target.config.vocab_size
        if params.logit_bias and params.logit_bias[-1][0] >= V:
            raise VerispecError(f"logit_bias: token id {params.logit_bias[-1][0]} is outside the vocabulary (0..{V - 1})")
        chain = ProcessorChain.from_params(params, self.logit_mask, prompt_len=len(prompt_ids),
                                           grammars=self.grammars)  # before anything is queued: it may refuse
        rid = next(self._ids)
        fixed_k = fixed_k or (not params.greedy and params.seed is not None)
        K = max(0, min(num_draft_tokens, self.max_draft_tokens)) if drafter else 0
        if fixed_k:
            s = self.scheduler
            K = max(0, min(K, s.max_num_batched_tokens - s.max_num_seqs))
        if callable(drafter) and not isinstance(drafter, Drafter):
            drafter = drafter(K) if K else None
        K = K if drafter else 0
        seq = Sequence(rid, list(prompt_ids), params.max_new_tokens, K, fixed_draft=fixed_k)
        self.scheduler.add(seq)
        req = Request(rid, seq, params, make_generator(params, self.device), drafter, fixed_k, chain=chain)
        req.stats.prompt_tokens = len(prompt_ids)
        req.stats.reached, req.stats.accepted_at = [0] * seq.num_draft_tokens, [0] * seq.num_draft_tokens
        if drafter is not None:  # auto reports each delegate, those it never drafted with too (0 rounds)
            req.stats.drafters = {name: [0, 0, 0] for name in drafter.delegates()}
        layers = drafter.feature_layers if drafter is not None else ()
        if capture is not None:
            if layers:
                raise VerispecError("capture needs a request whose drafter reads no features of its own")
            layers, req.capture = capture.layers, capture
            req.topk_ids = torch.zeros(self._capacity(req), capture.topk, dtype=torch.int32, device=self.device)
            req.topk_logp = torch.zeros(self._capacity(req), capture.topk, dtype=torch.float16, device=self.device)
        if layers:  # written by every forward that computes a position: such a sequence never takes a shared
            # prefix's blocks, whose positions no forward of its own computes
            seq.share_prefix = False
            width = len(layers) * self.target.config.hidden_size
            req.features = torch.zeros(self._capacity(req), width, dtype=self.target.dtype, device=self.device)
        if K:
            self.policy.admit(rid, K, drafter.name)  # its controller is sized by this bound, not a step's budget-cut K
        self.requests[rid] = req
        return req

    def abort(self, request_id: int) -> None:
        """Stop a request and free its blocks (a client gone); a finished or unknown one is left alone."""
        req = self.requests.pop(request_id, None)
        self.policy.forget(request_id)
        if req is not None:
            self.scheduler.finish(req.seq)
            req.finish_reason = req.finish_reason or "abort"

    def step(self) -> list[Request]:
        """One batched step -> the requests that committed tokens (``new_tokens``), finished ones included."""
        # 1. schedule
        t_step = time.perf_counter()
        chunks = self.scheduler.schedule()
        if not chunks:
            return []
        base_rows = sum(c.num_tokens if c.is_prefill else 1 for c in chunks)
        flexible = {c.seq.seq_id: c.num_draft for c in chunks
                    if c.num_draft and not self.requests[c.seq.seq_id].fixed_k}
        catch_up = {rid: self.policy.catch_up(r.drafter.name, r.drafter.lag(r.seq.tokens),
                                              r.params.max_new_tokens - r.num_output)
                    for rid in flexible if (r := self.requests[rid])}
        K = {c.seq.seq_id: c.num_draft for c in chunks} | self.policy.choose(
            flexible, base_rows, catch_up, seqs=len(chunks))
        # 2. propose: K drafts per decoding request that gets any (a drafter may propose fewer, even none)
        drafts, rows, ids, draft_s = [], [], [], []
        for chunk in chunks:
            req, seq = self.requests[chunk.seq.seq_id], chunk.seq
            draft, t0 = None, time.perf_counter()
            if not chunk.is_prefill and K[seq.seq_id]:
                if req.last_round:  # what its last drafting step cost besides drafting, by verify size
                    T, drafted_at = req.last_round
                    self.costs.observe_round(T, t0 - drafted_at)
                draft = self._propose(req, DraftRequest(  # the live context (a draft cache given back keeps it)
                    seq.tokens, K[seq.seq_id], req.params, req.generator, self._capacity(req),
                    self.target.config.vocab_size, self.logit_mask, self.device, self.costs, req.chain, req.features))
                req.stats.draft_s += time.perf_counter() - t0
                req.last_round = None if draft is None else (draft.tokens.shape[1] + 1, time.perf_counter())
            elif not chunk.is_prefill:
                req.last_round = None
            # drafting time, less any catch-up on tokens the drafter skipped (its prompt, the first time)
            fed_back, caught_up_s = req.drafter.catch_up if draft and req.drafter else (0, 0.0)
            for name in self._cost_keys(req, draft):
                self.costs.observe_catch_up(name, fed_back, caught_up_s)
            draft_s.append(time.perf_counter() - t0 - caught_up_s)
            fed = (seq.tokens[chunk.start:chunk.start + chunk.num_tokens] if chunk.is_prefill
                   else [seq.tokens[-1], *([] if draft is None else draft.tokens[0].tolist())])
            drafts.append(draft)
            rows.append((len(fed), chunk.start, self.blocks.block_table(seq.seq_id)))
            ids += fed
        # 3. forward: every fed row in one target forward; logits only where a token is chosen
        batch = PagedBatch(rows, self.device)
        layers = sorted({i for c in chunks for i in self._feature_layers(self.requests[c.seq.seq_id])})
        firsts = [r for r in itertools.accumulate([0] + [n for n, _, _ in rows])][:-1]
        wanted = [list(range(f, f + n)) if not c.is_prefill else
                  ([f + n - 1] if c.start + n == c.seq.prefill_end else []) for c, (n, _, _), f in zip(chunks, rows, firsts)]
        every_row = any(self.requests[c.seq.seq_id].capture for c in chunks)  # a capture needs each row's logits
        logit_rows = None if every_row else torch.tensor([r for w in wanted for r in w], dtype=torch.long,
                                                         device=self.device)
        t0 = time.perf_counter()
        logits, hidden = self.target.forward_paged(torch.tensor(ids, device=self.device), batch, self.cache,
                                                   logit_rows, tuple(layers))
        if logits.is_cuda:
            torch.cuda.synchronize()
        t_forward = time.perf_counter() - t0
        self.costs.observe_forward(len(ids), t_forward)
        # 4-5. accept and commit, request by request (one that fails there fails alone)
        out, at = [], 0
        for chunk, draft, seconds, (n, start, _), first, want in zip(chunks, drafts, draft_s, rows, firsts, wanted):
            req = self.requests[chunk.seq.seq_id]
            mine = logits[want] if every_row else logits[at:at + len(want)]  # [len(want), V]
            at += len(want)
            try:
                if req.features is not None:
                    req.features[start:start + n] = torch.cat([hidden[i][first:first + n]
                                                               for i in self._feature_layers(req)], -1)
                if req.capture is not None:  # [n, k] for the positions this chunk fed
                    top = torch.log_softmax(logits[first:first + n], dim=-1).topk(req.capture.topk, dim=-1)
                    req.topk_ids[start:start + n], req.topk_logp[start:start + n] = top.indices, top.values
                new = self._accept(req, chunk, draft, mine)
                if req.params.logprobs is not None:  # row i of ``mine`` chose new[i] (verify rows, or the one row)
                    req.new_logprobs = token_logprobs(mine[:len(new)], new, req.params.logprobs, self.logit_mask)
                req.stats.target_forwards += 1
                req.stats.target_s += t_forward
                if chunk.is_prefill:
                    req.stats.prefill_s += time.perf_counter() - t_step  # up to its first token
                if draft is not None and draft.tokens.shape[1]:
                    self.policy.observe(req.request_id, draft.tokens.shape[1], len(new) - 1)
                    for name in self._cost_keys(req, draft):
                        self.costs.observe_draft(name, draft.tokens.shape[1], seconds)
                done = self.scheduler.commit(ScheduledChunk(chunk.seq, chunk.start, n, chunk.is_prefill,
                                                            chunk.num_draft), new)
            except Exception as e:  # noqa: BLE001 - e.g. a processor of its own that raised: the others go on
                out.append(self._fail(req, e))
                continue
            if new:
                out.append(self._finish_if_done(req, new, done))
        return out

    def _fail(self, req: Request, error: Exception) -> Request:
        """End one request whose step failed (finish_reason "error", ``error`` kept): its blocks freed, nothing else
        touched."""
        log.error("request %d failed (%s: %s)", req.request_id, type(error).__name__, error, exc_info=error)
        req.new_tokens, req.finish_reason, req.error = [], "error", error
        self.abort(req.request_id)
        return req

    def _accept(self, req: Request, chunk: ScheduledChunk, draft, logits: torch.Tensor) -> list[int]:
        """The tokens this chunk commits: none for a middle prefill chunk, the next token after the last one, the
        accepted drafts and a recovered or bonus token after a verify row."""
        if not len(logits):
            return []
        chain = req.chain
        if draft is None:  # the prefix of every row: the committed tokens (and, in a verify pass, the drafts before it)
            return [draw(logits[-1:], req.seq.tokens, chain, req.generator)[0].item()]
        K = draft.tokens.shape[1]
        if K:
            verdict = verify(logits[None], draft.tokens, draft.draft_probs, chain, req.generator, [req.seq.tokens])
            n = int(verdict.num_accepted[0])
            new = verdict.tokens[0, :n + 1].tolist()
        else:  # the drafter proposed nothing: a plain step
            n, new = 0, [draw(logits[-1:], req.seq.tokens, chain, req.generator)[0].item()]
        try:
            req.drafter.update(n)
        except Exception as e:  # noqa: BLE001 - a drafter's failure costs its request the speculation, nothing more
            self._drop_drafter(req, e)
        req.stats.record_round(K, n)
        if draft.source:
            record = req.stats.drafters.setdefault(draft.source, [0, 0, 0])  # rounds, drafted, accepted
            record[0] += 1
            record[1] += K
            record[2] += n
        return new

    def _propose(self, req: Request, request: DraftRequest) -> Draft | None:
        """The request's draft, or None (a plain step) if its drafter fails or breaks the protocol: the drafter is
        dropped and the request decodes on without speculation, exactly as before (the target alone decides)."""
        try:
            draft = req.drafter.propose(request)
            if draft.tokens.shape[1] > request.num_tokens:
                raise VerispecError(f"drafted {draft.tokens.shape[1]} tokens, asked for at most {request.num_tokens}")
            return draft
        except Exception as e:  # noqa: BLE001 - one request's drafter never fails the batch
            self._drop_drafter(req, e)
            return None

    @staticmethod
    def _feature_layers(req: Request) -> tuple[int, ...]:
        """The target layers whose hidden states a request keeps: its capture's, or its drafter's."""
        if req.capture is not None:
            return req.capture.layers
        return req.drafter.feature_layers if req.drafter is not None else ()

    @staticmethod
    def _cost_keys(req: Request, draft: Draft | None) -> set[str]:
        """The drafters a round's costs belong to: the request's, and the one it delegated the round to (auto)."""
        if draft is None or req.drafter is None:
            return set()
        return {req.drafter.name} | ({draft.source} if draft.source else set())

    def _drop_drafter(self, req: Request, error: Exception) -> None:
        log.warning("request %d: drafter %s failed (%s: %s); it decodes on without speculation", req.request_id,
                    type(req.drafter).__name__, type(error).__name__, error, exc_info=error)
        req.drafter, req.seq.num_draft_tokens = None, 0
        if req.capture is None:
            req.features = None
        self.policy.forget(req.request_id)

    def _finish_if_done(self, req: Request, new: list[int], done: bool) -> Request:
        """Record the step's tokens; end the request at an EOS (unless ignored) or at max_new_tokens."""
        req.new_tokens = new
        eos = next((i for i, t in enumerate(new) if t in self.eos_token_ids), None)
        if eos is not None and not req.params.ignore_eos:
            req.new_tokens = new[:eos + 1]
            req.finish_reason = "eos"
            if req.seq.status is not SequenceStatus.FINISHED:
                self.scheduler.finish(req.seq)
        elif done:
            req.finish_reason = "length"
        req.num_output += len(req.new_tokens)
        if req.params.logprobs is not None:
            req.new_logprobs = req.new_logprobs[:len(req.new_tokens)]
            req.logprobs += req.new_logprobs
        if req.finished:
            self.requests.pop(req.request_id, None)
            self.policy.forget(req.request_id)
        return req

    def _capacity(self, req: Request) -> int:
        """The most positions the request's context can hold: prompt, new tokens and one round of drafts."""
        return len(req.seq.prompt) + req.params.max_new_tokens + req.seq.num_draft_tokens + 1
