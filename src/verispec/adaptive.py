"""Adaptive draft length: each round, the K that maximizes expected tokens per second.

The model is the one in costmodel.py (Leviathan et al. 2022, arXiv:2211.17192, Sec. 3.4) with costs in
seconds measured live: a round of K drafts yields ``1 + sum_{i<=K} prod_{j<=i} a_j`` tokens and costs
``K * t_draft + t_verify(K + 1)``. The conditional acceptance a_j at each position, the draft time per
token and the verify time per forward size are exponential moving averages over the last rounds, so K
follows the text: long on boilerplate code, short where the draft keeps missing.
"""

from __future__ import annotations

import time
from dataclasses import replace

from .costmodel import expected_tokens_per_round
from .drafters.base import Draft, DraftRequest

VERIFY_SLOPE = 0.03  # prior shape of t_verify(T) between measured sizes: +3% per extra token (CPU, bf16)


class DraftLengthController:
    def __init__(self, k_min: int, k_max: int, prior_acceptance: float = 0.6, decay: float = 0.8):
        if not 1 <= k_min <= k_max:
            raise ValueError(f"need 1 <= min draft tokens <= max draft tokens, got {k_min}, {k_max}")
        self.k_min, self.k_max, self.prior, self.decay = k_min, k_max, prior_acceptance, decay
        self.acceptance: list[float | None] = [None] * k_max  # EMA of P(accept i | 1..i-1 accepted)
        self.t_draft: float | None = None  # EMA seconds per drafted token
        self.t_verify: dict[int, float] = {}  # forward size T -> EMA seconds

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else self.decay * old + (1 - self.decay) * new

    def rates(self) -> list[float]:
        """Per-position estimates; a position never judged takes the last judged one's (then the prior)."""
        out, last = [], self.prior
        for a in self.acceptance:
            last = last if a is None else a
            out.append(last)
        return out

    def verify_seconds(self, T: int) -> float:
        near = min(self.t_verify, key=lambda t: (abs(t - T), t))  # nearest measured size, scaled by the prior
        return self.t_verify[near] * (1 + VERIFY_SLOPE * (T - 1)) / (1 + VERIFY_SLOPE * (near - 1))

    def tokens_per_second(self, K: int) -> float:
        if not self.t_verify:
            return 0.0
        return expected_tokens_per_round(self.rates()[:K]) / (K * (self.t_draft or 0.0) + self.verify_seconds(K + 1))

    def choose(self, k_cap: int) -> int:
        """K in [k_min, min(k_max, k_cap)] with the best expected rate (the largest before any measurement)."""
        hi = max(min(self.k_max, k_cap), 1)
        lo = min(self.k_min, hi)
        if not self.t_verify:
            return hi
        return max(range(lo, hi + 1), key=lambda k: (self.tokens_per_second(k), -k))

    def observe(self, K: int, num_accepted: int, draft_s: float, verify_s: float) -> None:
        for i in range(min(num_accepted + 1, K)):  # position i was judged iff all before it were accepted
            self.acceptance[i] = self._ema(self.acceptance[i], float(i < num_accepted))
        if K:
            self.t_draft = self._ema(self.t_draft, draft_s / K)
        self.t_verify[K + 1] = self._ema(self.t_verify.get(K + 1), verify_s)


class AdaptiveDrafter:
    """Wraps any drafter: chooses K each round, times the drafter and the verify pass, learns from both."""

    adaptive = True

    def __init__(self, inner, controller: DraftLengthController):
        self.inner, self.controller = inner, controller
        self._round: tuple[int, float, float] | None = None

    def propose(self, request: DraftRequest) -> Draft:
        K = self.controller.choose(request.num_tokens)
        t0 = time.perf_counter()
        draft = self.inner.propose(replace(request, num_tokens=K))
        t1 = time.perf_counter()
        self._round = (draft.tokens.shape[1], t1 - t0, t1)
        return draft

    def update(self, num_accepted: int) -> None:
        K, draft_s, t1 = self._round  # verify time: from the draft's hand-over to this call
        self.controller.observe(K, num_accepted, draft_s, time.perf_counter() - t1)
        self.inner.update(num_accepted)
