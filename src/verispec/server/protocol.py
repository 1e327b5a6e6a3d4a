"""The OpenAI request bodies (strict pydantic models) and the OpenAI error shape.

Types are strict (``"5"`` is not an integer) and unknown fields are refused, except the fields the official client
may send that change nothing here: ``user``, ``metadata``, ``store``, ``service_tier``, ``safety_identifier`` and
``prompt_cache_key`` take any value of their type; ``NEUTRAL`` fields only their no-op value (or null), since
honouring ``best_of: 2`` silently as 1 would change the output the caller asked for. Defaults are OpenAI's
(temperature 1, top_p 1); ``top_k``, ``min_p``, ``repetition_penalty`` and ``ignore_eos`` are extensions, as in
vLLM. ``stop`` takes at most
4 strings (OpenAI's limit) of at most 256 characters each: every generated token is checked against each of them.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed's range
MAX_STOP = 4  # stop strings a request may give (OpenAI's limit)
MAX_STOP_CHARS = 256  # characters in one stop string
# field -> its no-op values (null is always one)
NEUTRAL: dict[str, tuple] = {
    "best_of": (1,), "echo": (False,), "suffix": (), "tools": ([],), "tool_choice": ("none",),
    "functions": ([],), "function_call": ("none",), "response_format": ({"type": "text"},),
    "parallel_tool_calls": (True, False),
}


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
    param = str(err["loc"][0]) if err["loc"] else msg.split(":")[0] if ":" in msg else None  # a model check: "field: ..."
    return APIError(400, f"{loc}: {msg}" if loc else msg, param=param)


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(Strict):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # accepted, ignored: chunks are never padded


class TextPart(Strict):
    type: Literal["text"]
    text: str


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None  # accepted, ignored

    def as_template_input(self) -> dict:
        """{"role", "content"} as the chat template takes it (a developer message is a system message)."""
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class GenerateRequest(Strict):
    """The fields both endpoints share."""

    model: str | None = None  # None: the served model
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: off
    seed: int | None = Field(None, ge=-(2**63), le=MAX_SEED)
    stop: str | list[str] | None = None
    n: int = 1
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

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported (one choice per request)")
        return n

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

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling(self) -> dict:
        """SamplingParams fields (max_new_tokens apart: it may depend on the prompt's length)."""
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return dict(temperature=1.0 if self.temperature is None else self.temperature,
                    top_p=1.0 if self.top_p is None else self.top_p, top_k=max(self.top_k or 0, 0), seed=self.seed,
                    stop=stop, ignore_eos=self.ignore_eos, logprobs=self.num_logprobs(),
                    logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
                    presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
                    repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                    min_p=self.min_p or 0.0)

    def num_logprobs(self) -> int | None:
        """Alternatives reported per token, or None: no log-probabilities asked for."""
        return None


class CompletionRequest(GenerateRequest):
    prompt: str | list[int]
    logprobs: int | None = Field(None, ge=0, le=5)  # OpenAI's legacy limit
    best_of: Any = None
    echo: Any = None
    suffix: Any = None

    def num_logprobs(self) -> int | None:
        return self.logprobs


class ChatCompletionRequest(GenerateRequest):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    parallel_tool_calls: Any = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs set to true")
        return self

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
