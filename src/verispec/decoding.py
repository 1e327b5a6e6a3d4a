"""Decoding loops. Each method is a generator of committed-token chunks; the caller stops pulling
when a stop condition is met, so no forward pass is spent past the end.

``autoregressive`` is the baseline every speculative method is measured against, and the
reference they must reproduce exactly.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from .config import SamplingParams
from .models.kv_cache import KVCache
from .models.llama import Transformer
from .sampling import next_token


@dataclass
class DecodeContext:
    """Everything a decoding method needs for one request."""

    target: Transformer
    cache: KVCache
    prompt: torch.Tensor  # [1, P] int64
    params: SamplingParams
    generator: torch.Generator | None
    stats: "Stats"


@dataclass
class Stats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    target_forwards: int = 0
    prefill_s: float = 0.0
    target_s: float = 0.0  # all target forwards, prefill included
    wall_s: float = 0.0
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        decode_tokens = max(self.new_tokens - 1, 0)  # the first token comes out of the prefill
        decode_s = self.wall_s - self.prefill_s
        return {
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "target_forwards": self.target_forwards,
            "mean_accepted_length": self.new_tokens / self.target_forwards if self.target_forwards else 0.0,
            "prefill_s": round(self.prefill_s, 6),
            "target_s": round(self.target_s, 6),
            "wall_s": round(self.wall_s, 6),
            "tokens_per_s": self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0,
            "decode_ms_per_token": 1e3 * decode_s / decode_tokens if decode_tokens else 0.0,
            **self.extra,
        }


def timed_forward(ctx: DecodeContext, tokens: torch.Tensor, **kw):
    """One target forward over tokens [1, T] at the next positions, counted and timed."""
    start = ctx.cache.length
    positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)[None]  # [1, T]
    t0 = time.perf_counter()
    logits, hidden = ctx.target(tokens, positions, ctx.cache, **kw)
    if logits.is_cuda:
        torch.cuda.synchronize()
    ctx.stats.target_s += time.perf_counter() - t0
    ctx.stats.target_forwards += 1
    return logits, hidden


def autoregressive(ctx: DecodeContext) -> Iterator[list[int]]:
    """Plain decoding: one target forward per token."""
    # 1. prefill: the whole prompt in one forward; logits for its last position only
    t0 = time.perf_counter()
    logits, _ = timed_forward(ctx, ctx.prompt, num_logits=1)  # [1, 1, V]
    token = next_token(logits[:, -1], ctx.params, ctx.generator)  # [1]
    first = token.item()
    ctx.stats.prefill_s = time.perf_counter() - t0
    yield [first]
    # 2. decode: feed the last token, sample the next
    while True:
        logits, _ = timed_forward(ctx, token[:, None])  # [1, 1, V]
        token = next_token(logits[:, -1], ctx.params, ctx.generator)  # [1]
        yield [token.item()]


METHODS = {"ar": autoregressive}
