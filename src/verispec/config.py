"""Small frozen dataclasses, validated on construction.

Every CLI flag maps onto one field here; an out-of-range value raises :class:`ConfigError`
with a one-line message naming the field.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field, replace

from .errors import ConfigError

DTYPES = ("auto", "bfloat16", "float16", "float32")
_SAMPLING_EPS = 1e-5  # a temperature below this is greedy: logits / T would overflow to inf and NaN (vLLM's rule)
DEVICES = ("cpu", "cuda")


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def env_flag(name: str, default: bool = True) -> bool:
    """An on/off environment switch (VERISPEC_PACK, VERISPEC_NATIVE_CACHE, VERISPEC_HUGE_PAGES): 1 or 0;
    anything else is refused rather than read as either."""
    import os

    value = os.environ.get(name, "").strip()
    if not value:
        return default
    _check(value in ("0", "1"), f"{name} must be 0 or 1, got {value!r}")
    return value == "1"


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to turn logits into tokens, and when to stop.

    temperature 0 (or any below _SAMPLING_EPS, kept as given) is greedy decoding (argmax); top_k == 0 and
    top_p == 1.0 disable those filters.
    ``stop`` strings end generation; the returned text excludes the stop string.
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default=())
    ignore_eos: bool = False
    logprobs: int | None = None  # report each new token's log-probability and this many alternatives (0-20)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, -100..100) added to its logit (OpenAI's)
    presence_penalty: float = 0.0  # -2..2, once for each token the output holds (OpenAI's)
    frequency_penalty: float = 0.0  # -2..2, per occurrence in the output (OpenAI's)
    repetition_penalty: float = 1.0  # > 0: divides positive logits of tokens seen in prompt or output (vLLM's)
    min_p: float = 0.0  # 0..1: drop tokens under min_p x the likeliest one's probability
    # OpenAI's: {"type": "json_object"} or {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}
    # (a dict or its JSON text), kept as compact JSON text (hashable); {"type": "text"} or None: no constraint
    response_format: str | dict | None = None
    # a grammar the output must match, in llguidance's Lark dialect (``%json {schema}`` rules allowed; tools.py
    # writes one for a forced tool call); not with a response_format
    grammar: str | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        _check(_is_int(self.max_new_tokens) and self.max_new_tokens >= 1,
               f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        _check(_is_real(self.temperature) and math.isfinite(self.temperature)
               and self.temperature >= 0, f"temperature must be >= 0, got {self.temperature!r}")
        _check(_is_int(self.top_k) and self.top_k >= 0, f"top_k must be an integer >= 0, got {self.top_k!r}")
        _check(_is_real(self.top_p) and 0 < self.top_p <= 1,
               f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(self.seed is None or _is_int(self.seed), f"seed must be an integer, got {self.seed!r}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings")
        _check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= 20),
               f"logprobs must be an integer in 0..20, got {self.logprobs!r}")
        bias_rule = "logit_bias takes token ids >= 0 with values in -100..100"
        try:
            pairs = tuple((t, b) for t, b in (self.logit_bias.items() if isinstance(self.logit_bias, dict)
                                              else self.logit_bias))
        except (TypeError, ValueError):
            pairs = None
        _check(pairs is not None and all(_is_int(t) and t >= 0 and _is_real(b) and -100 <= b <= 100
                                         for t, b in pairs), bias_rule)
        object.__setattr__(self, "logit_bias", tuple(sorted((t, float(b)) for t, b in dict(pairs).items())))
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            _check(_is_real(v) and -2 <= v <= 2, f"{name} must be in -2..2, got {v!r}")
        _check(_is_real(self.repetition_penalty) and math.isfinite(self.repetition_penalty)
               and self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        _check(_is_real(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be in 0..1, got {self.min_p!r}")
        object.__setattr__(self, "response_format", _response_format(self.response_format))
        if self.grammar is not None:
            _check(isinstance(self.grammar, str) and self.grammar.strip(), "grammar must be a non-empty string")
            _check(self.response_format is None, "grammar: not with a response_format (one constraint per request)")
            error = grammar_error(self.grammar)
            _check(not error, f"grammar: {error}")

    @property
    def greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    @property
    def response_schema(self) -> dict | None:
        """The JSON schema the output must match (json_object: any object), None without a response format."""
        return None if self.response_format is None else json_schema_of(json.loads(self.response_format))

    @property
    def constraint(self) -> dict | str | None:
        """What the output must match: the response format's JSON schema, the grammar's text, or None."""
        return self.response_schema if self.response_format is not None else self.grammar


_FORMAT_RULE = ('response_format must be {"type": "json_object"} or {"type": "json_schema", "json_schema": '
                '{"name": ..., "schema": {...}}} (or {"type": "text"})')


def json_schema_of(response_format: dict) -> dict:
    """A checked response format (not text) -> the JSON schema it constrains the output to."""
    if response_format["type"] == "json_object":
        return {"type": "object"}
    return response_format["json_schema"]["schema"]


def _response_format(value) -> str | None:
    """OpenAI's response_format (a dict or its JSON text) -> compact JSON text, None for plain text; the schema is
    compiled by llguidance (the grammar engine, sampling/grammar.py) so that a bad one fails here, in one line."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ConfigError(f"response_format is not JSON ({e})") from None
    _check(isinstance(value, dict) and value.get("type") in ("text", "json_object", "json_schema"), _FORMAT_RULE)
    if value["type"] == "text":
        return None
    if value["type"] == "json_schema":
        spec = value.get("json_schema")
        _check(isinstance(spec, dict) and isinstance(spec.get("schema"), dict), _FORMAT_RULE)
        _check(isinstance(spec.get("name", ""), str), f"response_format: json_schema.name must be a string, "
                                                       f"got {spec.get('name')!r}")
        _check(isinstance(spec.get("strict", True), bool), f"response_format: json_schema.strict must be true or "
                                                            f"false, got {spec.get('strict')!r}")
    try:
        text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"response_format is not JSON ({e})") from None
    error = schema_error(json.dumps(json_schema_of(value), separators=(",", ":")))
    _check(not error, f"response_format: invalid JSON schema: {error}")
    return text


@functools.lru_cache(maxsize=64)
def schema_error(schema: str) -> str:
    """Why llguidance cannot compile the JSON schema (text), in one line; '' if it can."""
    from llguidance import LLMatcher

    return _compile_error(LLMatcher.grammar_from_json_schema, schema)


@functools.lru_cache(maxsize=64)
def grammar_error(lark: str) -> str:
    """Why llguidance cannot compile the Lark grammar, in one line; '' if it can."""
    from llguidance import LLMatcher

    return _compile_error(LLMatcher.grammar_from_lark, lark)


def _compile_error(make, text: str) -> str:
    from llguidance import LLMatcher

    try:
        is_error, messages = LLMatcher.validate_grammar_with_warnings(make(text))
    except ValueError as e:
        is_error, messages = True, [str(e)]
    return (messages[0].strip().splitlines() or ["unknown error"])[0] if is_error else ""


@dataclass(frozen=True)
class SpecConfig:
    """Which decoding method, and how many tokens a drafter proposes per round (K)."""

    method: str = "ar"
    num_draft_tokens: int = 4  # K; with adaptive, the largest K a round may use
    adaptive: bool | None = None  # choose K per round from live acceptance and costs; None: the drafter's default
    min_draft_tokens: int = 1  # the smallest K an adaptive round may use
    ngram_min: int = 1  # n-gram lookup: shortest suffix that may match
    ngram_max: int = 4  # n-gram lookup: longest suffix tried first
    early_stop: bool = True  # the draft model ends a round before K when its confidence says another token won't pay

    def __post_init__(self):
        _check(isinstance(self.method, str) and bool(self.method), f"method must be a name, got {self.method!r}")
        _check(_is_int(self.num_draft_tokens) and self.num_draft_tokens >= 1,
               f"num_draft_tokens must be an integer >= 1, got {self.num_draft_tokens!r}")
        _check(_is_int(self.min_draft_tokens) and 1 <= self.min_draft_tokens <= self.num_draft_tokens,
               f"min_draft_tokens must be an integer in [1, num_draft_tokens={self.num_draft_tokens}], "
               f"got {self.min_draft_tokens!r}")
        _check(_is_int(self.ngram_min) and _is_int(self.ngram_max) and 1 <= self.ngram_min <= self.ngram_max,
               f"need integers 1 <= ngram_min <= ngram_max, got {self.ngram_min!r}, {self.ngram_max!r}")
        _check(self.adaptive is None or isinstance(self.adaptive, bool),
               f"adaptive must be True, False or None (the method's default), got {self.adaptive!r}")
        _check(isinstance(self.early_stop, bool), f"early_stop must be True or False, got {self.early_stop!r}")

    def with_k(self, num_draft_tokens: int) -> SpecConfig:
        """This configuration for one request's K (min_draft_tokens lowered to fit)."""
        return replace(self, num_draft_tokens=num_draft_tokens,
                       min_draft_tokens=min(self.min_draft_tokens, num_draft_tokens))


DRAFT_QUANT_BITS = {"int8": 8, "int4": 4}
WEIGHTS = ("auto", "native", "dequantized")  # how GGUF matrices are held (models/loader.py)


@dataclass(frozen=True)
class EngineConfig:
    """Where and how the models run."""

    dtype: str = "auto"  # bf16 on GPUs, bf16-capable CPUs and native GGUF targets; float32 otherwise (models/loader.auto_dtype)
    device: str | None = None  # None: cuda when available, else cpu
    threads: int | None = None  # None: torch's default
    draft_quant: str | None = "int4"  # int4 / int8: the draft model's matrices quantized (CPU); None: as loaded
    draft_vocab: int | None = None  # the draft's LM head kept to its N most frequent tokens (draft_vocab.py); 0: all;
    # None: the named draft's default (registry draft_vocab_rows), else all
    draft_vocab_table: str | None = None  # a frequency table file (python -m verispec.draft_vocab); None: packaged
    weights: str = "auto"  # GGUF target: "native" keeps Q4_K/Q6_K/Q8_0/... matrices quantized (CPU kernels); auto:
    # native for a GGUF-sourced model (the default pair too) on CPU in bfloat16, else dequantized
    draft_weights: str = "dequantized"  # the same for the draft model (dequantized: then draft_quant applies)

    def __post_init__(self):
        _check(self.draft_quant in (None, "none", *DRAFT_QUANT_BITS),
               f"draft_quant must be int8, int4 or none, got {self.draft_quant!r}")
        if self.draft_quant == "none":
            object.__setattr__(self, "draft_quant", None)
        _check(self.draft_vocab is None or (_is_int(self.draft_vocab) and self.draft_vocab >= 0),
               f"draft_vocab must be an integer >= 0 (0 = the full vocabulary), got {self.draft_vocab!r}")
        _check(self.weights in WEIGHTS, f"weights must be one of {', '.join(WEIGHTS)}, got {self.weights!r}")
        _check(self.draft_weights in WEIGHTS,
               f"draft_weights must be one of {', '.join(WEIGHTS)}, got {self.draft_weights!r}")
        _check(self.dtype in DTYPES, f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        _check(self.device is None or self.device.split(":")[0] in DEVICES,
               f"device must be cpu or cuda, got {self.device!r}")
        _check(self.threads is None or (_is_int(self.threads) and self.threads >= 1),
               f"threads must be an integer >= 1, got {self.threads!r}")

    def resolved_device(self) -> str:
        import torch

        if self.device is None:
            return "cuda" if torch.cuda.is_available() else "cpu"
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError("device cuda requested but no CUDA GPU is available")
        return self.device
