"""The OpenAI request bodies (strict pydantic models) and the OpenAI error shape.

Types are strict (``"5"`` is not an integer) and unknown fields are refused, except the fields the official client
may send that change nothing here: ``user``, ``metadata``, ``store``, ``service_tier``, ``safety_identifier`` and
``prompt_cache_key`` take any value of their type; ``NEUTRAL`` fields only their no-op value (or null), since
honouring ``best_of: 2`` silently as 1 would change the output the caller asked for. Defaults are OpenAI's
(temperature 1, top_p 1); ``top_k``, ``min_p``, ``repetition_penalty`` and ``ignore_eos`` are extensions, as in
vLLM. ``stop`` takes at most
4 strings (OpenAI's limit) of at most 256 characters each: every generated token is checked against each of them.

``n`` (1..16) asks for that many independent samples of each prompt; /v1/completions' ``prompt`` is one prompt (a
string or a token-id list) or up to 16 (a list of strings or of token-id lists): the choices are prompt-major
(choice index = prompt index x n + sample index), as OpenAI orders them. With a ``seed``, sample i draws from
``sample_seed(seed, i)``. ``stream_options`` needs ``stream`` true (OpenAI's rule).
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import (BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, ValidationInfo, field_validator,
                      model_validator)

from ..tools import Tools, template_message

MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed's range
MAX_STOP = 4  # stop strings a request may give (OpenAI's limit)
MAX_STOP_CHARS = 256  # characters in one stop string
MAX_N = 16  # samples a request may ask for of each prompt (OpenAI allows 128)
MAX_PROMPTS = 16  # prompts in one /v1/completions request
# field -> its no-op values (null is always one)
NEUTRAL: dict[str, tuple] = {
    "best_of": (1,), "echo": (False,), "suffix": (), "functions": ([],), "function_call": ("none",),
}


def sample_seed(seed: int | None, sample: int) -> int | None:
    """The seed of a request's ``sample``-th sample of a prompt: seed + sample mod 2**64, the seed as given for the
    first (a negative seed is torch's to map, as for a request of one choice), so that the samples differ and the
    request replays."""
    if seed is None or sample == 0:
        return seed
    return (seed + sample) % (MAX_SEED + 1)


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code, self.headers = (status, message, type, param,
                                                                                     code, headers)

    def response(self) -> JSONResponse:
        body = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return JSONResponse({"error": body}, status_code=self.status, headers=self.headers)


def bad_request(e: ValidationError) -> APIError:
    """The first validation problem as a 400, ``param`` naming the top-level field."""
    err = e.errors(include_url=False)[0]
    if err["type"] == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {err['ctx'].get('error', err['msg'])}")
    loc = ".".join(str(p) for p in err["loc"])
    msg = err["msg"].removeprefix("Value error, ")
    # a model check's message starts "field: ..." or "field.0.part: ..."
    param = str(err["loc"][0]) if err["loc"] else msg.split(":")[0].split(".")[0] if ":" in msg else None
    return APIError(400, f"{loc}: {msg}" if loc else msg, param=param)


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(Strict):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # accepted, ignored: chunks are never padded


class TextPart(Strict):
    type: Literal["text"]
    text: str


class FunctionCall(Strict):
    name: str
    arguments: str  # JSON text of an object


class ToolCall(Strict):
    id: str
    type: Literal["function"]
    function: FunctionCall


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # None: an assistant message of tool calls only
    name: str | None = None  # accepted, ignored
    tool_calls: list[ToolCall] | None = None  # an assistant's
    tool_call_id: str | None = None  # a tool result's: the call it answers
    refusal: str | None = None  # an assistant's, as the client echoes it back: accepted, ignored

    @model_validator(mode="after")
    def _roles(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content: only an assistant message with tool_calls may omit it")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls: only in an assistant message")
        if (self.tool_call_id is None) == (self.role == "tool"):
            raise ValueError("tool_call_id: a tool message needs one, and only a tool message has one")
        self.template_input()  # tool_calls' arguments must be JSON objects
        return self

    def template_input(self) -> dict:
        """The message as the chat template takes it: {"role", "content"} (a developer message is a system one), an
        assistant's ``tool_calls`` with their arguments as objects, a tool result's ``tool_call_id``."""
        text = (self.content if isinstance(self.content, str) else
                "".join(p.text for p in self.content or ()))
        message = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.tool_calls:
            message["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return template_message(message)


class FunctionDef(Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments (None: any object)
    strict: bool | None = None  # accepted: the arguments of a forced call always match the schema


class ToolDef(Strict):
    type: Literal["function"]
    function: FunctionDef

    def definition(self) -> dict:
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class GenerateRequest(Strict):
    """The fields both endpoints share."""

    model: str | None = None  # None: the served model
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: off
    seed: int | None = Field(None, ge=-(2**63), le=MAX_SEED)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    # verispec's own: draft exactly this many tokens a step (0: no speculation) instead of the cost model's choice
    num_speculative_tokens: int | None = Field(None, ge=0, le=16)
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None  # token id (a string, as JSON keys are) -> -100..100
    repetition_penalty: float | None = Field(None, gt=0, le=100)  # vLLM's extra: 1 = off
    min_p: float | None = Field(None, ge=0, le=1)  # vLLM's extra: 0 = off

    @field_validator("stop")
    @classmethod
    def _bounded_stop(cls, stop: str | list[str] | None):
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings, got {len(stops)}")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"a stop string has at most {MAX_STOP_CHARS} characters, got "
                             f"{max(len(s) for s in stops)}")
        return stop

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, bias: dict[str, float] | None):
        for key, value in (bias or {}).items():
            if not key.isdigit():
                raise ValueError(f"keys are token ids, got {key!r:.30}")
            if not -100 <= value <= 100:
                raise ValueError(f"values are in -100..100, got {value!r} for token {key}")
        return bias

    @field_validator(*NEUTRAL, check_fields=False)
    @classmethod
    def _neutral(cls, value, info: ValidationInfo):
        if value is not None and value not in NEUTRAL[info.field_name]:
            raise ValueError(f"{info.field_name}={value!r:.60} is not supported")
        return None

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling(self, sample: int = 0) -> dict:
        """SamplingParams fields of the ``sample``-th sample of a prompt (max_new_tokens apart: it may depend on the
        prompt's length)."""
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return dict(temperature=1.0 if self.temperature is None else self.temperature,
                    top_p=1.0 if self.top_p is None else self.top_p, top_k=max(self.top_k or 0, 0),
                    seed=sample_seed(self.seed, sample),
                    stop=stop, ignore_eos=self.ignore_eos, logprobs=self.num_logprobs(),
                    logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
                    presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
                    repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                    min_p=self.min_p or 0.0)

    def num_logprobs(self) -> int | None:
        """Alternatives reported per token, or None: no log-probabilities asked for."""
        return None


class CompletionRequest(GenerateRequest):
    prompt: str | list[int] | list[str] | list[list[int]]  # OpenAI's four shapes: one prompt, or a list of them
    logprobs: int | None = Field(None, ge=0, le=5)  # OpenAI's legacy limit
    best_of: Any = None
    echo: Any = None
    suffix: Any = None

    @field_validator("prompt")
    @classmethod
    def _bounded_prompts(cls, prompt):
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) and len(prompt) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts, got {len(prompt)}")
        return prompt

    def prompts(self) -> list[str | list[int]]:
        """The prompts in order: a string or a token-id list is one (an empty list too, refused as an empty prompt
        is), a list of strings or of token-id lists is one each."""
        prompt = self.prompt
        if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
            return [prompt]
        return list(prompt)

    def num_logprobs(self) -> int | None:
        return self.logprobs


class ChatCompletionRequest(GenerateRequest):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: Any = None
    function_call: Any = None
    # {"type": "text" | "json_object"} or {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}:
    # checked (and the schema compiled) by SamplingParams, whose one-line error answers 400 with param
    # "response_format"
    response_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs set to true")
        return self

    _tool_spec: Tools | None = PrivateAttr(default=None)  # built once, by the check below

    @model_validator(mode="after")
    def _check_tools(self):
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ValueError("tool_choice: only allowed when tools are given")
        if self.tools:  # Tools checks names, schemas and the named function
            choice = self.tool_choice
            choice = choice.model_dump() if isinstance(choice, NamedToolChoice) else choice
            self._tool_spec = Tools([t.definition() for t in self.tools], choice or "auto",
                                    True if self.parallel_tool_calls is None else self.parallel_tool_calls)
        tools = self._tool_spec
        if tools is not None and tools.forced and (self.response_format or {}).get("type", "text") != "text":
            raise ValueError("tool_choice: a forced tool call cannot be combined with response_format")
        return self

    def tool_spec(self) -> Tools | None:
        """The request's tools (tools.py), or None without any."""
        return self._tool_spec

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def sampling(self, sample: int = 0) -> dict:
        return {**super().sampling(sample), "response_format": self.response_format}
