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


def ema(old: float | None, new: float, decay: float = 0.8) -> float:
    """Exponential moving average: the first value as is, then ``decay`` of the old plus the rest of the new."""
    return new if old is None else decay * old + (1 - decay) * new


def verify_seconds(table: dict[int, float], T: int) -> float:
    """Seconds of a target forward over T tokens from those measured (size -> seconds, non-empty): linear
    between measured sizes, extended past them with the slope of the two nearest (never negative), or with
    the prior slope while only one size is known. Below the smallest size, never under T / near of it (a
    forward's cost per token only falls with T): a line through two noisy timings could reach zero there."""
    if T in table:
        return table[T]
    sizes = sorted(table)
    lo = max((t for t in sizes if t < T), default=None)
    hi = min((t for t in sizes if t > T), default=None)
    if lo is not None and hi is not None:
        return table[lo] + (table[hi] - table[lo]) * (T - lo) / (hi - lo)
    if len(sizes) == 1:
        near = sizes[0]
        return table[near] * (1 + VERIFY_SLOPE * (T - 1)) / (1 + VERIFY_SLOPE * (near - 1))
    a, b = sizes[-2:] if hi is None else sizes[:2]
    slope = max((table[b] - table[a]) / (b - a), 0.0)
    near = b if hi is None else a
    return max(table[near] + slope * (T - near), table[near] * min(T / near, 1.0))


class Calibration:
    """P(a draft token is accepted | the draft's confidence q in it), learned from the verifier's verdicts.

    Confidence is cut into equal bins, each a running count started from a small prior centred on q itself
    (a calibrated draft). Drafts are often under-confident: an int8 0.5B draft of the 1.5B target had 86% of
    its tokens drafted at q 0.6-0.7 accepted (one-off count, 8 prompts), so the raw q would end rounds early.
    """

    def __init__(self, bins: int = 10, prior: float = 2.0):
        self.bins = bins
        self.judged = [prior] * bins
        self.accepted = [prior * (b + 0.5) / bins for b in range(bins)]

    def _bin(self, q: float) -> int:
        return min(max(int(q * self.bins), 0), self.bins - 1)

    def __call__(self, q: float) -> float:
        b = self._bin(q)
        return self.accepted[b] / self.judged[b]

    def observe(self, confidences: list[float], num_accepted: int) -> None:
        """A round's drafts had these confidences; the first num_accepted were accepted, the next rejected."""
        for i, q in enumerate(confidences[: num_accepted + 1]):  # judged: the accepted ones and the first rejection
            b = self._bin(q)
            self.judged[b] += 1
            self.accepted[b] += i < num_accepted


def worth_another_draft(chances: list[float], t_draft: float, t_verify: dict[int, float]) -> bool:
    """Stop drafting early (draft model, within a round): after k drafted tokens with chances of acceptance
    a_1..a_k (from the draft's confidence in each, see Calibration), does one more draft, expected to be
    accepted as often as the last one, raise the round's expected rate?

    Rate of k drafts: (1 + sum_i prod_{j<=i} a_j) / (k * t_draft + t_verify(k + 1)). Rounds run long where
    the draft is sure and end where it hesitates, instead of spending a draft step and a verify row on a
    likely rejection. t_verify should hold all of a round's time outside drafting (the verify forward and
    the bookkeeping), so that the fixed cost of a round weighs against ending it early.
    """
    k = len(chances)
    joint, run = [], 1.0
    for a in chances:
        run *= a
        joint.append(run)
    tokens, seconds = 1.0 + sum(joint), k * t_draft + verify_seconds(t_verify, k + 1)
    more_tokens = tokens + joint[-1] * chances[-1]
    more_seconds = seconds + t_draft + verify_seconds(t_verify, k + 2) - verify_seconds(t_verify, k + 1)
    return more_tokens * seconds > tokens * more_seconds


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
        return ema(old, new, self.decay)

    def rates(self) -> list[float]:
        """Per-position estimates; a position never judged takes the last judged one's (then the prior)."""
        out, last = [], self.prior
        for a in self.acceptance:
            last = last if a is None else a
            out.append(last)
        return out

    def verify_seconds(self, T: int) -> float:
        return verify_seconds(self.t_verify, T)

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
        # position i was judged iff all before it were accepted; its estimate starts from the prior, so that
        # one unlucky first round does not read as "never accepted" (and switch the drafter off for good)
        before = self.rates()
        for i in range(min(num_accepted + 1, K)):
            self.acceptance[i] = self._ema(before[i], float(i < num_accepted))
        if K:
            self.t_draft = self._ema(self.t_draft, draft_s / K)
        self.t_verify[K + 1] = self._ema(self.t_verify.get(K + 1), verify_s)
