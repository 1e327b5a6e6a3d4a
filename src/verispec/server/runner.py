"""The engine behind the HTTP routes: one background thread owns the Engine and the tokenizer.

Routes submit a request through a thread-safe inbox; the engine thread encodes the prompt, adds it to the Engine
and loops ``step()`` while there is work. Per request it detokenizes with a StopChecker (EOS, stop strings,
max_tokens) and hands each step's text to the request's asyncio queue with ``loop.call_soon_threadsafe``, split by
origin: the text of the step's accepted draft tokens, then that of the token the target chose itself (the recovered
or bonus token of a verify step, or the token of a plain step). A stop string, or a client gone
(``Generation.close``), aborts the request in the engine thread, which frees its blocks.

An HTTP request's choices (``n`` samples of each of its prompts) are submitted together as one ``Choices``: admitted
in one go, all or none, so they batch in the engine; each takes a seat in the queue bound; their events share one
queue, tagged with the choice's index.

A request that fails fails alone: the Engine isolates a request's failure inside a step (its drafter's, or its own
rows' accept and commit: ``Request.error``), and the runner one in a request's detokenising; only a step that raises
as a whole (the batched forward) fails what runs (``_fail_all``, the last resort).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from ..config import SamplingParams, SpecConfig
from ..engine import Engine, Request
from ..errors import VerispecError
from ..frontend import Piece, feed, fit_context
from ..llm import LLM
from ..sampling import TokenLogprob
from ..stopping import StopChecker
from .metrics import Metrics

log = logging.getLogger("verispec.server")
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}  # StopChecker's -> OpenAI's


class QueueFull(Exception):
    """More requests in flight than the server queues."""


class StepEvent(NamedTuple):
    """What one engine step streams for a request: its new text in pieces (in order, none empty) and the running
    counts after it; ``finish_reason`` (OpenAI's) on the request's last event only."""

    pieces: tuple[Piece, ...]
    finish_reason: str | None
    completion_tokens: int
    num_draft_tokens: int
    num_accepted_tokens: int
    logprobs: tuple[TokenLogprob, ...] = ()  # those of the tokens whose text the pieces hold, with logprobs asked

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.pieces)


def spec_stats(num_drafts: int, num_draft_tokens: int, num_accepted_tokens: int) -> dict:
    """vLLM's speculative-decoding names; mean_acceptance_length = 1 + accepted / drafts (tokens per verify)."""
    mean = 1 + num_accepted_tokens / num_drafts if num_drafts else 1.0
    return {"num_drafts": num_drafts, "num_draft_tokens": num_draft_tokens,
            "num_accepted_tokens": num_accepted_tokens, "mean_acceptance_length": round(mean, 4)}


@dataclass(eq=False)
class Generation:
    """One choice of a request, shared by its route (event loop) and the engine thread. Only the engine thread writes
    the fields from ``req`` on; the route reads them after the event that ends the choice."""

    prompt: str | list[int] | list[dict]
    params: SamplingParams  # max_new_tokens: a placeholder when max_tokens is None
    max_tokens: int | None  # None: whatever room the context and the cache leave
    runner: Runner
    loop: asyncio.AbstractEventLoop
    admitted: asyncio.Future  # shared by the request's choices: they are admitted together
    num_speculative_tokens: int | None = None  # the request's own K (fixed), or None: the cost model's
    index: int = 0  # the choice's index in the request
    tools: list[dict] | None = None  # function definitions the chat template renders
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # the request's: (index, StepEvent), or an Exception
    arrival: float = field(default_factory=time.perf_counter)
    req: Request | None = None
    stopper: StopChecker | None = None
    prompt_tokens: int = 0
    finish_reason: str | None = None  # OpenAI's: "stop" | "length"
    text: str = ""  # the whole text, once finished (StopChecker.finalize)
    last_token: float | None = None
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)  # every text token's so far, with logprobs asked
    closed: bool = False

    @property
    def completion_tokens(self) -> int:
        """Tokens generated, an EOS that ended the request and the token that completed a stop string included."""
        return len(self.stopper.token_ids) if self.stopper else 0

    def spec_stats(self) -> dict:
        return spec_stats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens)

    def close(self) -> None:
        """The route is done (finished, failed or the client gone): abort what still runs, free the seat."""
        if not self.closed:
            self.closed = True
            self.runner.release(self)


@dataclass(eq=False)
class Choices:
    """A request's generations, choice index order: ``samples`` of each prompt in turn (prompt-major). They share
    one event queue; ``close`` closes them all."""

    gens: list[Generation]
    samples: int = 1  # choices per prompt

    def usage(self) -> dict:
        """Summed over the choices, each prompt's tokens counted once (as OpenAI counts them)."""
        prompt = sum(g.prompt_tokens for g in self.gens[::self.samples])
        completion = sum(g.completion_tokens for g in self.gens)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def spec_stats(self) -> dict:
        """The choices' speculative counts summed."""
        return spec_stats(*(sum(getattr(g, k) for g in self.gens)
                            for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")))

    async def events(self):
        """Yield (choice index, StepEvent) per engine step that produced text or finished a choice, until every
        choice has had its last event (the one with the finish reason); a choice's failure raises here."""
        queue, left = self.gens[0].queue, len(self.gens)
        while left:
            item = await queue.get()
            if isinstance(item, Exception):
                raise item
            yield item
            left -= item[1].finish_reason is not None

    def close(self) -> None:
        for gen in self.gens:
            gen.close()


class Runner:
    """Owns the Engine in one thread; ``submit`` from the event loop."""

    def __init__(self, llm: LLM, engine: Engine, metrics: Metrics, spec: SpecConfig, max_in_flight: int):
        self.llm, self.engine, self.metrics, self.spec = llm, engine, metrics, spec
        self.max_in_flight = max_in_flight
        self.context = llm.target.config.max_position_embeddings
        self.cache_tokens = engine.blocks.num_blocks * engine.blocks.block_size
        self.in_flight = 0  # event-loop side only
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # ("add", [Generation]), ("abort", Generation) or None
        self._live: dict[int, Generation] = {}  # engine request id -> generation (engine thread only)
        self._thread = threading.Thread(target=self._loop, name="verispec-engine", daemon=True)
        self._preemptions = 0

    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        self._inbox.put(None)
        self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def make_drafter(self, num_draft_tokens: int | None = None):
        """A drafter for one request of K = ``num_draft_tokens`` (default: the server's; None for plain decoding),
        as LLM.generate makes it; the engine calls it with the request's K (Engine.add)."""
        return self.llm.make_drafter(self.spec.with_k(num_draft_tokens or self.spec.num_draft_tokens))

    async def submit(self, choices: list[tuple[str | list[int] | list[dict], SamplingParams]], max_tokens: int | None,
                     num_speculative_tokens: int | None = None, samples: int = 1,
                     tools: list[dict] | None = None) -> Choices:
        """Queue a request's choices, (prompt, params) each in index order, ``samples`` per prompt (``tools``: the
        function definitions a conversation's template renders); all are admitted or none. Raises QueueFull (every choice takes a seat), or VerispecError when one can never run (a bad prompt,
        too long)."""
        if not self.alive:
            raise RuntimeError("the engine thread has stopped")
        if self.in_flight + len(choices) > self.max_in_flight:
            raise QueueFull(f"{self.in_flight} choices in flight and {len(choices)} asked for, past the "
                            f"{self.max_in_flight} this server queues")
        loop = asyncio.get_running_loop()
        admitted, events = loop.create_future(), asyncio.Queue()
        gens = [Generation(prompt, params, max_tokens, self, loop, admitted, num_speculative_tokens, i, tools, events)
                for i, (prompt, params) in enumerate(choices)]
        request = Choices(gens, samples)
        self.in_flight += len(gens)
        self._inbox.put(("add", gens))
        try:
            await admitted
        except BaseException:
            request.close()
            raise
        return request

    def release(self, gen: Generation) -> None:
        """Free the request's seat in the queue bound; abort it in the engine thread if it still runs."""
        self.in_flight -= 1
        if gen.finish_reason is None:
            self._inbox.put(("abort", gen))

    # -- the engine thread --

    def _loop(self) -> None:
        while True:
            commands = [] if self.engine.has_work else [self._inbox.get()]  # idle: sleep until a command
            while not self._inbox.empty():
                commands.append(self._inbox.get())
            for command in commands:
                if command is None:
                    return
                self._handle(*command)
            events = []
            if self.engine.has_work:
                try:
                    events = self._step()
                except Exception as e:  # a bug: fail what runs, keep serving
                    log.exception("engine step failed")
                    events = self._fail_all(e)
            self._observe()
            for gen, event in events:
                self._post(gen, event)

    def _handle(self, kind: str, what) -> None:
        if kind == "abort":
            gen = what
            if gen.req is not None and self._live.pop(gen.req.request_id, None) is not None:
                self.engine.abort(gen.req.request_id)
            return
        gens, added = what, []  # a request's choices: all admitted, or none
        try:
            for gen in gens:
                self._admit(gen)
                added.append(gen)
        except Exception as e:
            if not isinstance(e, VerispecError):
                log.exception("admission failed")
            for gen in added:
                self.engine.abort(gen.req.request_id)
            gens[0].loop.call_soon_threadsafe(_settle, gens[0].admitted, e)
            return
        for gen in gens:
            self._live[gen.req.request_id] = gen
            self.metrics.prompt_tokens.inc(gen.prompt_tokens)
        gens[0].loop.call_soon_threadsafe(_settle, gens[0].admitted, None)

    def _admit(self, gen: Generation) -> None:
        ids = self.llm.codec.encode(gen.prompt, tools=gen.tools)
        P = len(ids)
        # the last token's KV is never written: a cache of N slots holds N + 1 tokens
        max_new = fit_context(P, gen.max_tokens, self.context, self.cache_tokens + 1, name="max_tokens")
        params = dataclasses.replace(gen.params, max_new_tokens=max_new)
        gen.stopper = StopChecker(params, self.llm.eos_token_ids, self.llm.codec)
        K = gen.num_speculative_tokens
        drafter = self.make_drafter if K != 0 else None  # made by the engine for the request's K
        gen.req = self.engine.add(ids, params, drafter, self.spec.num_draft_tokens if K is None else K,
                                  fixed_k=K is not None)
        gen.prompt_tokens = P

    def _step(self) -> list[tuple[Generation, StepEvent]]:
        """One engine step -> (generation, event) for each that produced text or finished."""
        now, events = None, []
        for req in self.engine.step():
            gen = self._live.get(req.request_id)
            if gen is None:
                continue
            now = now or time.perf_counter()
            if req.error is not None:  # its step failed in the engine: it fails alone
                self._live.pop(req.request_id, None)
                events.append((gen, RuntimeError(f"the request failed: {type(req.error).__name__}: {req.error}")))
                continue
            try:
                event = self._event(gen, req, now)
            except Exception as e:  # a bug in this request's detokenising or counting: it fails alone
                log.exception("request %d failed", req.request_id)
                self._live.pop(req.request_id, None)
                self.engine.abort(req.request_id)
                event = RuntimeError(f"the request failed: {type(e).__name__}: {e}")
            if event is not None:
                events.append((gen, event))
        return events

    def _event(self, gen: Generation, req: Request, now: float) -> StepEvent | None:
        """Detokenise the request's new tokens; its StepEvent, or None if it has nothing to stream yet."""
        accepted = req.accepted - gen.num_accepted_tokens  # this step's accepted drafts: new_tokens' head
        self._count(gen, req, now)
        stopper = gen.stopper
        before = len(stopper.token_ids)
        pieces = feed(stopper, req.new_tokens, accepted)
        logprobs = ()
        if gen.params.logprobs is not None:  # the tokens fed (a stop string may end the step early), EOS not text
            eos = () if gen.params.ignore_eos else self.llm.eos_token_ids
            logprobs = tuple(lp for lp in req.new_logprobs[:len(stopper.token_ids) - before] if lp.token not in eos)
            gen.logprobs += logprobs
        finish = None
        if stopper.finished or req.finished:
            if not req.finished:  # a stop string
                self.engine.abort(req.request_id)
            del self._live[req.request_id]
            finish = gen.finish_reason = FINISH_REASONS[stopper.finish_reason or req.finish_reason]
            gen.text = stopper.finalize()
            self.metrics.e2e_latency.observe(now - gen.arrival)
        if pieces or finish or logprobs:
            return StepEvent(pieces, finish, gen.completion_tokens, gen.num_draft_tokens, gen.num_accepted_tokens,
                             logprobs)
        return None

    def _count(self, gen: Generation, req: Request, now: float) -> None:
        """Latencies and speculative counts of one step; a step verifies at most one draft per request, and what
        it accepts is a prefix of it, so per-position acceptance is exact."""
        m = self.metrics
        if gen.last_token is None:
            m.time_to_first_token.observe(now - gen.arrival)
        else:
            m.inter_token_latency.observe(now - gen.last_token)
        gen.last_token = now
        drafted, accepted = req.drafted - gen.num_draft_tokens, req.accepted - gen.num_accepted_tokens
        if drafted:
            gen.num_drafts += 1
            gen.num_draft_tokens, gen.num_accepted_tokens = req.drafted, req.accepted
            m.spec_decode(drafted, accepted)
        m.generation_tokens.inc(len(req.new_tokens))

    def _fail_all(self, error: Exception) -> list:
        """The last resort, when a step raises as a whole: every running request fails (a 500, or a stream's error
        event) and the server goes on."""
        events = []
        for rid, gen in list(self._live.items()):
            self.engine.abort(rid)
            events.append((gen, RuntimeError(f"the engine failed: {type(error).__name__}: {error}")))
        self._live.clear()
        return events

    def _observe(self) -> None:
        s = self.engine.scheduler
        self.metrics.engine_state(s.num_running, s.num_waiting, self.engine.blocks.usage,
                                  s.num_preemptions - self._preemptions)
        self._preemptions = s.num_preemptions

    @staticmethod
    def _post(gen: Generation, event) -> None:
        """A StepEvent, tagged with its choice's index, or an Exception onto the request's queue."""
        item = event if isinstance(event, Exception) else (gen.index, event)
        try:
            gen.loop.call_soon_threadsafe(gen.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: the server is stopping
            pass


def _settle(future: asyncio.Future, error: Exception | None) -> None:
    if not future.done():
        future.set_result(None) if error is None else future.set_exception(error)
