"""The public entry point: ``LLM(target=..., draft=...)``, ``generate`` and ``stream``."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from .config import EngineConfig, SamplingParams
from .decoding import METHODS, DecodeContext, Stats
from .errors import ConfigError, VerispecError
from .models.kv_cache import KVCache
from .models.loader import LoadedModel, load
from .models.registry import DEFAULT_TARGET
from .sampling import make_generator
from .stopping import StopChecker
from .tokenizer import Codec


@dataclass
class GenerationOutput:
    text: str
    token_ids: list[int]  # new tokens only (an EOS that ended generation included)
    stats: dict
    finish_reason: str  # "eos" | "stop" | "length"
    prompt_token_ids: list[int] = field(default_factory=list)


class LLM:
    """A target model (and, for speculative methods, a drafter) ready to generate.

    ``target``/``draft``: a default model name (see ``verispec models list``), an HF directory
    (config.json + *.safetensors), or a .gguf file.
    """

    def __init__(self, target: str = DEFAULT_TARGET, draft: str | None = None, dtype: str = "bfloat16",
                 device: str | None = None, threads: int | None = None, progress: bool = True):
        self.engine_config = EngineConfig(dtype=dtype, device=device, threads=threads)
        if threads:
            torch.set_num_threads(threads)
        self.device = self.engine_config.resolved_device()
        self.dtype = self.engine_config.torch_dtype()
        self.target: LoadedModel = load(target, self.dtype, self.device, progress=progress)
        self.draft: LoadedModel | None = load(draft, self.dtype, self.device, progress=progress) if draft else None
        self.codec = Codec(self.target.tokenizer, self.target.config.vocab_size)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = list(self.target.config.eos_token_ids)
        tok = self.target.tokenizer
        if tok is not None and tok.eos_token_id is not None:
            ids.append(tok.eos_token_id)
        return tuple(dict.fromkeys(ids))

    def generate(self, prompt: str | list[int], params: SamplingParams | None = None, method: str = "ar",
                 chat: bool = False, system: str | None = None) -> GenerationOutput:
        run = self._run(prompt, params or SamplingParams(), method, chat, system)
        for _ in run:
            pass
        return self._last

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None, method: str = "ar",
               chat: bool = False, system: str | None = None) -> Iterator[str]:
        """Yield text pieces as tokens are committed (each accepted run at once, for speculative methods).

        The pieces concatenate to ``generate(...).text``; afterwards ``last_output`` holds the full output.
        """
        if not self.codec.has_tokenizer:
            raise VerispecError("streaming text needs a tokenizer; this model takes token ids only")
        for stopper in self._run(prompt, params or SamplingParams(), method, chat, system):
            piece = stopper.stream_piece()
            if piece:
                yield piece

    @property
    def last_output(self) -> GenerationOutput | None:
        return getattr(self, "_last", None)

    def _run(self, prompt, params: SamplingParams, method: str, chat: bool, system: str | None):
        if not isinstance(params, SamplingParams):
            raise ConfigError("params must be a verispec.SamplingParams")
        if method not in METHODS:
            raise ConfigError(f"unknown method {method!r} (available: {', '.join(METHODS)})")
        prompt_ids = self.codec.encode(prompt, chat=chat, system=system)
        context = self.target.config.max_position_embeddings
        P = len(prompt_ids)
        if P >= context:
            raise VerispecError(f"prompt is {P} tokens; the model's context is {context}")
        if P + params.max_new_tokens > context:
            raise VerispecError(f"prompt ({P} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds the "
                                f"model's context of {context} tokens: lower max_new_tokens")
        stats = Stats(prompt_tokens=P)
        cache = KVCache.for_model(self.target.config, 1, P + params.max_new_tokens, self.dtype, self.device)
        ctx = DecodeContext(self.target.model, cache, torch.tensor([prompt_ids], device=self.device), params,
                            make_generator(params, self.device), stats)
        stopper = StopChecker(params, self.eos_token_ids, self.codec)
        t0 = time.perf_counter()
        steps = METHODS[method](ctx)
        try:
            for chunk in steps:
                stopper.append(chunk)
                stats.wall_s = time.perf_counter() - t0
                yield stopper
                if stopper.finished:
                    break
        finally:
            steps.close()
        stats.wall_s = time.perf_counter() - t0
        stats.new_tokens = len(stopper.token_ids)
        self._last = GenerationOutput(stopper.finalize(), stopper.token_ids, stats.as_dict(),
                                      stopper.finish_reason, prompt_ids)
        yield stopper
