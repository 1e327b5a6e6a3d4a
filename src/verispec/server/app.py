"""The OpenAI-compatible HTTP app: /v1/models, /v1/completions, /v1/chat/completions (JSON or SSE), /health,
/metrics, and the chat page at / (static/chat.html with static/chat.js; the page is public, its requests send the key).

Every error is ``{"error": {"message", "type", "param", "code"}}``: 400 for a body that is not valid JSON, breaks the
schema (protocol.py) or asks what cannot run (a prompt past the context or the cache), 401 for a missing or wrong
API key, 404 for an unknown model or route, 413 for a body over 1 MiB, 429 (with Retry-After) when more requests are
in flight than the server queues, 500 only for a bug (a request that fails fails alone: see runner.py), 503 (and
/health 503) if the engine thread is gone. ``stop`` takes at most 4 strings of at most 256 characters (protocol.py).

A request asks for ``n`` (1..16) samples of each of its prompts (/v1/completions takes up to 16): one choice each,
``index`` = prompt index x n + sample index, all submitted together (they batch in the engine) and each taking a seat
in the queue bound (429 when they do not all fit now, 400 when they could never fit). ``usage`` sums the choices
(each prompt's tokens counted once, as OpenAI does), as ``metrics.speculative_decoding`` does. A choice that fails
fails the request; a request that ends (answered, failed, client gone) closes all its choices.

Streaming sends one ``data:`` chunk per engine step and choice that produced text or finished, the choice's
``index`` in it (its last one carries its ``finish_reason`` and its own ``metrics``), then, with
``stream_options.include_usage``, one chunk with the request's ``usage`` and no choices, then ``data: [DONE]``.
Responses and final chunks carry ``metrics.speculative_decoding`` (runner.py).

Each text chunk also carries a non-standard ``verispec`` object (OpenAI clients keep it as an unknown field) that
splits its text by how it was produced, and the request's running counts after the step::

    "verispec": {"pieces": [{"text": "the accepted drafts' text", "draft": true},
                            {"text": "the target's own token's text", "draft": false}],
                 "completion_tokens": 17, "num_draft_tokens": 12, "num_accepted_tokens": 9}

``draft: true`` is text of draft tokens the target accepted; ``draft: false`` is text of the token the target chose
itself (a verify step's recovered or bonus token, or a plain step's token). Pieces are never empty, come in order
and concatenate to the chunk's text (empty pieces list: a final chunk without new text). A token that completes a
character or clears a possible stop string releases held-back text into its own piece.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import secrets
import time
import uuid
from contextlib import asynccontextmanager
from importlib import resources

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from .. import drafters
from ..tools import Tools
from ..config import SamplingParams, SpecConfig
from ..engine import Engine
from ..errors import ConfigError, VerispecError
from ..llm import AR, LLM
from .metrics import Metrics
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, GenerateRequest, bad_request
from .runner import Choices, QueueFull, Runner, StepEvent

MAX_BODY_BYTES = 1 << 20
BLOCK_SIZE = 16
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's for /v1/completions; chat defaults to the room left


def create_app(llm: LLM, model_name: str, *, method: str = "auto", num_draft_tokens: int = 4,
               spec_options: dict | None = None, max_num_seqs: int = 16, kv_cache_tokens: int = 16384,
               api_key: str | None = None, max_waiting: int | None = None) -> FastAPI:
    """An app serving ``llm`` as ``model_name``: one Engine of ``kv_cache_tokens`` KV slots, at most
    ``max_num_seqs`` requests running and ``max_waiting`` (default 4 x max_num_seqs) more queued."""
    drafters.check_method(method)
    if kv_cache_tokens < BLOCK_SIZE:
        raise ConfigError(f"kv_cache_tokens must be at least one block ({BLOCK_SIZE}), got {kv_cache_tokens}")
    spec = SpecConfig(method, num_draft_tokens, **(spec_options or {}))
    engine = Engine(llm.target.model, kv_cache_tokens // BLOCK_SIZE, BLOCK_SIZE, max_num_seqs=max_num_seqs,
                    max_num_batched_tokens=max(512, max_num_seqs), logit_mask=llm.logit_mask,
                    eos_token_ids=llm.eos_token_ids, grammars=llm.grammars)
    metrics = Metrics(model_name, num_draft_tokens if method != AR else 0)
    waiting = 4 * max_num_seqs if max_waiting is None else max_waiting
    runner = Runner(llm, engine, metrics, spec, max_num_seqs + waiting)
    runner.make_drafter()  # loads a draft model or head now: a missing one fails here, not per request
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        runner.start()
        yield
        runner.shutdown()

    app = FastAPI(title="verispec", lifespan=lifespan)
    app.state.runner = runner

    async def authorize(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "missing or wrong API key (send Authorization: Bearer KEY)", code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorize)])

    @v1.get("/models")
    async def models():
        card = {"id": model_name, "object": "model", "created": started, "owned_by": "verispec",
                "max_model_len": runner.context}
        return {"object": "list", "data": [card]}

    @v1.post("/completions")
    async def completions(request: Request):
        body = await read_body(request, CompletionRequest)
        return await generate(request, body, body.prompts(), body.max_tokens or COMPLETION_DEFAULT_MAX_TOKENS, False)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        body = await read_body(request, ChatCompletionRequest)
        messages = [m.template_input() for m in body.messages]
        return await generate(request, body, [messages], body.max_completion_tokens or body.max_tokens, True,
                              body.tool_spec())

    async def generate(request: Request, body: GenerateRequest, prompts: list, max_tokens: int | None, chat: bool,
                       tools: Tools | None = None):
        if body.model is not None and body.model != model_name:
            raise APIError(404, f"the model {body.model!r} does not exist (this server has {model_name!r})",
                           param="model", code="model_not_found")
        if not runner.alive:
            raise APIError(503, "the engine thread has stopped", "server_error")
        n = body.n
        if len(prompts) * n > runner.max_in_flight:  # a 429 would never clear
            raise APIError(400, f"{len(prompts)} prompt(s) x n={n} choices is more than the {runner.max_in_flight} "
                                "this server queues", param="n" if n > 1 else "prompt")
        try:
            grammar = tools.grammar(llm.grammars.literal) if tools is not None and tools.forced else None
            samples = [SamplingParams(max_new_tokens=max_tokens or 1, grammar=grammar, **body.sampling(i))
                       for i in range(n)]
            choices = await runner.submit([(prompt, params) for prompt in prompts for params in samples], max_tokens,
                                          body.num_speculative_tokens, n,
                                          tools.template_tools() if tools is not None else None)
        except QueueFull as e:
            raise APIError(429, f"server busy: {e}; retry later", "rate_limit_error", code="queue_full",
                           headers={"Retry-After": "1"}) from None
        except VerispecError as e:  # a message that starts with a field names the parameter (logit_bias past the
            field = re.match(r"\w*", str(e)).group()  # vocabulary, a response_format's schema that cannot compile)
            raise APIError(400, str(e), param=field if field in type(body).model_fields else None) from None
        reply = Reply(choices, model_name, chat, body.include_usage,
                      tools if tools is not None and tools.choice != "none" else None)
        if body.stream:
            return SSEResponse(choices, reply.events(), media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache"})
        try:
            if not await finished_unless_disconnected(request, choices):
                return Response(status_code=499)  # nobody is listening
        except RuntimeError as e:  # a choice failed in the engine (a bug): its message, not just its type
            raise APIError(500, str(e), "server_error") from None
        finally:
            choices.close()
        return reply.whole()

    app.include_router(v1)

    @app.get("/health")
    async def health():
        if not runner.alive:
            raise APIError(503, "the engine thread has stopped", "server_error")
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), headers={"Content-Type": metrics.content_type})

    @app.get("/", response_class=HTMLResponse)
    async def chat_page():
        return HTMLResponse(static_file("chat.html"))

    @app.get("/chat.js")
    async def chat_script():
        return Response(static_file("chat.js"), media_type="text/javascript")

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return e.response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        return APIError(e.status_code, str(e.detail), code="not_found" if e.status_code == 404 else None,
                        headers=e.headers).response()

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        return APIError(500, f"internal error: {type(e).__name__}", "server_error").response()

    return app


def static_file(name: str) -> str:
    """A file of the chat page (package data: static/)."""
    return resources.files(__package__).joinpath("static", name).read_text(encoding="utf-8")


async def read_body(request: Request, model: type[GenerateRequest]) -> GenerateRequest:
    """The body, at most MAX_BODY_BYTES, validated as ``model``."""
    length = request.headers.get("content-length", "")
    too_big = APIError(413, f"the body is over {MAX_BODY_BYTES} bytes", code="request_too_large")
    if length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise too_big
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise too_big
    try:
        return model.model_validate_json(bytes(body))
    except ValidationError as e:
        raise bad_request(e) from None


async def finished_unless_disconnected(request: Request, choices: Choices) -> bool:
    """Wait for every choice's last step; False (and the wait cancelled) if the client goes first."""
    async def finished():
        async for _ in choices.events():
            pass

    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    done_task, gone_task = asyncio.ensure_future(finished()), asyncio.ensure_future(disconnected())
    await asyncio.wait({done_task, gone_task}, return_when=asyncio.FIRST_COMPLETED)
    for task in (done_task, gone_task):
        task.cancel()
    if done_task.cancelled() or not done_task.done():
        return False
    done_task.result()  # an engine failure: raised here, answered 500
    return True


class SSEResponse(StreamingResponse):
    """A stream that closes its request's generations however it ends (finished, client gone, never started)."""

    def __init__(self, choices: Choices, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.choices = choices

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.choices.close()


class Reply:
    """The OpenAI response objects of one request's choices: whole, or as chunks."""

    def __init__(self, choices: Choices, model_name: str, chat: bool, include_usage: bool, tools: Tools | None = None):
        self.choices, self.chat, self.include_usage, self.tools = choices, chat, include_usage, tools
        # per choice, with tools: the parser of its streamed text, and the calls it has sent
        self.parsers = [tools.parser() for _ in choices.gens] if tools is not None else None
        self.num_calls = [0] * len(choices.gens)
        self.codec = choices.gens[0].runner.llm.codec
        self.with_logprobs = choices.gens[0].params.logprobs is not None
        self.offsets = [0] * len(choices.gens)  # per choice: characters before a completion chunk's tokens
        self.head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
                     "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                     "model": model_name}

    def summary(self) -> dict:
        return {"usage": self.choices.usage(), "metrics": {"speculative_decoding": self.choices.spec_stats()}}

    def whole(self) -> dict:
        def choice(gen) -> dict:
            finish, text = gen.finish_reason, gen.text
            if not self.chat:
                body = {"text": text}
            elif self.tools is None:
                body = {"message": {"role": "assistant", "content": text}}
            else:
                content, calls = self.tools.parse(text)
                body = {"message": {"role": "assistant", "content": content, **({"tool_calls": calls} if calls
                                                                                 else {})}}
                finish = self.finish_reason(finish, bool(calls))
            return {"index": gen.index, **body, "logprobs": self.logprobs(gen.index, gen.logprobs),
                    "finish_reason": finish}

        return {**self.head, "choices": [choice(gen) for gen in self.choices.gens], **self.summary()}

    def logprobs(self, index: int, lps) -> dict | None:
        """OpenAI's ``logprobs`` of a choice for these tokens (sampling/logprobs.py: the target's own, before
        temperature), or None when the request asked for none: chat's ``content`` entries (token, logprob, bytes,
        top_logprobs), or the completions API's parallel lists (tokens, token_logprobs, top_logprobs, text_offset: in
        the text of choice ``index``)."""
        if not self.with_logprobs:
            return None
        text = self.codec.decode
        if self.chat:
            def entry(token: int, logprob: float) -> dict:
                piece = text([token])
                return {"token": piece, "logprob": logprob, "bytes": list(piece.encode("utf-8"))}

            return {"content": [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                                for lp in lps], "refusal": None}
        tokens = [text([lp.token]) for lp in lps]
        offsets = list(itertools.accumulate((len(t) for t in tokens), initial=self.offsets[index]))
        self.offsets[index] = offsets.pop()
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": [{text([t]): v for t, v in lp.top} for lp in lps], "text_offset": offsets}

    @staticmethod
    def finish_reason(finish: str | None, called: bool) -> str | None:
        """OpenAI's reason with tools: "tool_calls" when the answer ended by itself after making calls."""
        return "tool_calls" if finish == "stop" and called else finish

    def tool_delta(self, index: int, event: StepEvent) -> dict:
        """A chat chunk's delta with tools: the step's content (whitespace between calls held back) and each call
        it completed, whole, with its index in the choice's calls (OpenAI's ``tool_calls`` delta)."""
        parser = self.parsers[index]
        content, calls = parser.feed(event.text)
        if event.finish_reason is not None:
            rest, more = parser.close()
            content, calls = content + rest, calls + more
        if parser.num_calls and not content.strip():
            content = ""
        delta = {"content": content} if content else {}
        if calls:
            first = self.num_calls[index]
            self.num_calls[index] += len(calls)
            delta["tool_calls"] = [{"index": first + i, **call} for i, call in enumerate(calls)]
        return delta

    async def events(self):
        """``data: {chunk}`` per engine step and choice that produced text or finished, the usage chunk if asked,
        [DONE]."""
        head = {**self.head, "object": "chat.completion.chunk" if self.chat else "text_completion"}
        started = set()  # choices that sent a chunk (chat: the first one carries the role)
        try:
            async for index, event in self.choices.events():
                text, finish = event.text, event.finish_reason
                if self.chat:
                    delta = ({"content": text} if text else {}) if self.tools is None else self.tool_delta(index,
                                                                                                          event)
                    if index not in started:
                        delta = {"role": "assistant", "content": delta.get("content", ""), **delta}
                    if self.tools is not None:
                        finish = self.finish_reason(finish, self.num_calls[index] > 0)
                    choice = {"index": index, "delta": delta}
                else:
                    choice = {"index": index, "text": text}
                chunk = {**head, "choices": [{**choice, "logprobs": self.logprobs(index, event.logprobs),
                                              "finish_reason": finish}]}
                chunk["verispec"] = origin(event)
                if self.include_usage:
                    chunk["usage"] = None
                if finish is not None:
                    chunk["metrics"] = {"speculative_decoding": self.choices.gens[index].spec_stats()}
                started.add(index)
                yield f"data: {json.dumps(chunk)}\n\n"
        except RuntimeError as e:  # the engine failed mid-stream
            error = {"message": str(e), "type": "server_error", "param": None, "code": None}
            yield f"data: {json.dumps({'error': error})}\n\n"
        else:
            if self.include_usage:
                yield f"data: {json.dumps({**head, 'choices': [], **self.summary()})}\n\n"
        yield "data: [DONE]\n\n"


def origin(event: StepEvent) -> dict:
    """The ``verispec`` object of a chunk: its text by origin, and the running counts (module docstring)."""
    return {"pieces": [{"text": p.text, "draft": p.draft} for p in event.pieces],
            "completion_tokens": event.completion_tokens, "num_draft_tokens": event.num_draft_tokens,
            "num_accepted_tokens": event.num_accepted_tokens}
