"""Adaptive draft length: each round, the K that maximizes expected tokens per second (drafters/auto.py
asks a DraftLengthController per drafter, and per match length for n-gram lookup).

The model is the one in costmodel.py (Leviathan et al. 2022, arXiv:2211.17192, Sec. 3.4) with costs in
seconds measured live: a round of K drafts yields ``1 + sum_{i<=K} prod_{j<=i} a_j`` tokens and costs
``K * t_draft + t_verify(K + 1)``. The conditional acceptance a_j at each position, the draft time per
token and the verify time per forward size are exponential moving averages over the last rounds, so K
follows the text: long on boilerplate code, short where the draft keeps missing.
"""

from __future__ import annotations

from .costmodel import expected_tokens_per_round

VERIFY_SLOPE = 0.03  # prior shape of t_verify(T) between measured sizes: +3% per extra token (CPU, bf16)


class DraftLengthController:
    def __init__(self, k_min: int, k_max: int, prior_acceptance: float = 0.6, decay: float = 0.8,
                 t_verify: dict[int, float] | None = None):
        if not 1 <= k_min <= k_max:
            raise ValueError(f"need 1 <= min draft tokens <= max draft tokens, got {k_min}, {k_max}")
        self.k_min, self.k_max, self.prior, self.decay = k_min, k_max, prior_acceptance, decay
        self.acceptance: list[float | None] = [None] * k_max  # EMA of P(accept i | 1..i-1 accepted)
        self.t_draft: float | None = None  # EMA seconds per drafted token
        # forward size T -> EMA seconds; a dict passed in is shared (the target's cost, whoever drafted)
        self.t_verify: dict[int, float] = {} if t_verify is None else t_verify

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

    def tokens_per_second(self, K: int, t_draft: float | None = None, extra_s: float = 0.0) -> float:
        """Expected tokens per second of a round of K drafts (t_draft: seconds per drafted token if not yet
        measured; extra_s: a further cost of this round, e.g. a draft model's catch-up)."""
        if not self.t_verify:
            return 0.0
        per_token = self.t_draft if self.t_draft is not None else (t_draft or 0.0)
        return expected_tokens_per_round(self.rates()[:K]) / (K * per_token + self.verify_seconds(K + 1) + extra_s)

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
