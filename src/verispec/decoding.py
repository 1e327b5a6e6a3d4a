"""Decoding loops. Each is a generator of committed-token chunks; the caller stops pulling when a
stop condition is met, so no forward pass is spent past the end.

``autoregressive`` is the baseline every speculative method is measured against and the reference
it must reproduce exactly. ``speculative`` runs any drafter (drafters/) through the same loop.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from .config import SamplingParams
from .drafters.base import Drafter, DraftRequest
from .models.kv_cache import KVCache
from .models.llama import Transformer
from .adaptive import ema
from .sampling import mask_logits, next_token
from .verify import verify


@dataclass
class DecodeContext:
    """Everything a decoding method needs for one request."""

    target: Transformer
    cache: KVCache
    prompt: torch.Tensor  # [1, P] int64
    params: SamplingParams
    generator: torch.Generator | None
    stats: "Stats"
    logit_mask: torch.Tensor | None = None  # [V] bool: padding rows that may never be sampled
    drafter: Drafter | None = None
    num_draft_tokens: int = 0  # K
    verify_s: dict[int, float] = field(default_factory=dict)  # verify size T -> recent s of a round besides drafting
    feature_layers: tuple[int, ...] = ()  # target hidden states the drafter reads (drafter.feature_layers)
    features: torch.Tensor | None = None  # [capacity, F]: those states of every position the target has read


@dataclass
class Stats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    target_forwards: int = 0
    prefill_s: float = 0.0
    target_s: float = 0.0  # all target forwards, prefill included
    draft_s: float = 0.0  # time inside drafter.propose
    wall_s: float = 0.0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    reached: list[int] = field(default_factory=list)  # [K] (sized by the loop): rounds that judged position i
    accepted_at: list[int] = field(default_factory=list)  # [K]: rounds in which position i was accepted
    drafters: dict[str, list[int]] = field(default_factory=dict)  # [rounds, drafted, accepted] per delegate

    def record_round(self, num_drafted: int, num_accepted: int) -> None:
        self.drafted_tokens += num_drafted
        self.accepted_tokens += num_accepted
        for i in range(min(num_accepted + 1, num_drafted)):  # position i is judged iff all before it passed
            self.reached[i] += 1
            self.accepted_at[i] += i < num_accepted

    def as_dict(self) -> dict:
        decode_tokens = max(self.new_tokens - 1, 0)  # the first token comes out of the prefill
        out = {
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "target_forwards": self.target_forwards,
            "mean_accepted_length": self.new_tokens / self.target_forwards if self.target_forwards else 0.0,
            "prefill_s": round(self.prefill_s, 6),
            "target_s": round(self.target_s, 6),
            "wall_s": round(self.wall_s, 6),
            "tokens_per_s": self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0,
            "decode_ms_per_token": 1e3 * (self.wall_s - self.prefill_s) / decode_tokens if decode_tokens else 0.0,
        }
        if self.reached:
            out.update(
                draft_s=round(self.draft_s, 6),
                drafted_tokens=self.drafted_tokens,
                accepted_tokens=self.accepted_tokens,
                acceptance_rate=self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0,
                # P(position i accepted | positions before it accepted); None where never reached
                per_position_acceptance=[a / r if r else None for a, r in zip(self.accepted_at, self.reached)],
                per_position_reached=list(self.reached),
            )
        if self.drafters:
            out["drafter_rounds"] = {k: r for k, (r, _, _) in self.drafters.items()}
            out["drafter_tokens"] = {k: {"drafted": d, "accepted": a} for k, (_, d, a) in self.drafters.items()}
        return out


def timed_forward(ctx: DecodeContext, tokens: torch.Tensor, **kw) -> torch.Tensor:
    """One target forward over tokens [1, T] at the next positions, counted and timed -> masked logits."""
    start = ctx.cache.length
    positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)[None]  # [1, T]
    t0 = time.perf_counter()
    logits, hidden = ctx.target(tokens, positions, ctx.cache, hidden_layers=ctx.feature_layers, **kw)
    if hidden:  # rows of a rejected draft are overwritten later, as in the KV cache
        torch.cat([hidden[i][0] for i in ctx.feature_layers], dim=-1, out=ctx.features[start:start + tokens.shape[1]])
    if logits.is_cuda:
        torch.cuda.synchronize()
    ctx.stats.target_s += time.perf_counter() - t0
    ctx.stats.target_forwards += 1
    return mask_logits(logits, ctx.logit_mask)


def prefill(ctx: DecodeContext) -> torch.Tensor:
    """The whole prompt in one forward (logits for its last position only) -> the first token [1]."""
    t0 = time.perf_counter()
    logits = timed_forward(ctx, ctx.prompt, num_logits=1)  # [1, 1, V]
    token = next_token(logits[:, -1], ctx.params, ctx.generator)  # [1]
    token.item()  # sync: prefill time includes the first token
    ctx.stats.prefill_s = time.perf_counter() - t0
    return token


def autoregressive(ctx: DecodeContext) -> Iterator[list[int]]:
    """Plain decoding: one target forward per token."""
    token = prefill(ctx)  # [1]
    while True:
        yield [token.item()]
        logits = timed_forward(ctx, token[:, None])  # [1, 1, V]
        token = next_token(logits[:, -1], ctx.params, ctx.generator)  # [1]


def speculative(ctx: DecodeContext) -> Iterator[list[int]]:
    """Draft up to K tokens, verify them in one target forward, commit the accepted run plus one token."""
    # Report K positions (None where never reached) even if the budget or a stop ends the run first.
    ctx.stats.reached = [0] * ctx.num_draft_tokens
    ctx.stats.accepted_at = [0] * ctx.num_draft_tokens
    ctx.feature_layers = tuple(getattr(ctx.drafter, "feature_layers", ()))
    if ctx.feature_layers:
        D = ctx.target.config.hidden_size
        ctx.features = torch.empty(ctx.cache.capacity, len(ctx.feature_layers) * D, dtype=ctx.target.dtype,
                                   device=ctx.prompt.device)
    last = prefill(ctx)  # [1]: committed, its keys/values not yet in the target cache
    context = ctx.prompt[0].tolist() + [last.item()]
    yield context[-1:]
    capacity = ctx.cache.capacity
    last_round = None  # (verify size, end of its drafting)
    while True:
        K = min(ctx.num_draft_tokens, ctx.params.max_new_tokens - (len(context) - ctx.prompt.shape[1]) - 1)
        if K < 1:  # one token left to produce: a plain target step
            logits = timed_forward(ctx, last[:, None])  # [1, 1, V]
            last = next_token(logits[:, -1], ctx.params, ctx.generator)
            context.append(last.item())
            yield context[-1:]
            continue
        # 1. propose: up to K draft tokens and their distributions q (fewer, or none, is allowed)
        t0 = time.perf_counter()
        if last_round:  # what the last round cost outside drafting (verify, bookkeeping), by verify size
            ctx.verify_s[last_round[0]] = ema(ctx.verify_s.get(last_round[0]), t0 - last_round[1])
        draft = ctx.drafter.propose(DraftRequest(context, K, ctx.params, ctx.generator, capacity,
                                                 ctx.target.config.vocab_size, ctx.logit_mask, last.device,
                                                 ctx.verify_s, ctx.features))
        t_drafted = time.perf_counter()
        ctx.stats.draft_s += t_drafted - t0
        K = draft.tokens.shape[1]
        last_round = (K + 1, t_drafted)
        # 2. verify: one target forward over the last committed token and the K drafts -> p_1..p_{K+1}
        start = ctx.cache.length
        logits = timed_forward(ctx, torch.cat([last[:, None], draft.tokens], dim=1))  # [1, K+1, V]
        # 3. accept: rejection sampling keeps a prefix of n drafts, then one recovered or bonus token
        verdict = verify(logits, draft.tokens, draft.draft_probs, ctx.params, ctx.generator)
        n = int(verdict.num_accepted[0])
        new = verdict.tokens[0, : n + 1].tolist()
        # 4. commit / rollback: the target cache keeps the last committed token and the n accepted drafts
        ctx.cache.truncate(start + 1 + n)
        # 5. update: the drafter rolls back its own state
        ctx.drafter.update(n)
        ctx.stats.record_round(K, n)
        if draft.source:
            record = ctx.stats.drafters.setdefault(draft.source, [0, 0, 0])  # rounds, drafted, accepted
            record[0] += 1
            record[1] += K
            record[2] += n
        last = verdict.tokens[:, n]  # [1]
        context += new
        yield new
