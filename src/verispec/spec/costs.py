"""The arithmetic of speculation's costs, in one place: moving averages of measured seconds, the one interpolation
of a forward's cost by its rows, and the expected tokens of a round (Leviathan, Kalman & Matias 2022,
arXiv:2211.17192, Sec. 3.3-3.4).

One round drafts K tokens (``K * c`` target steps, c = draft seconds per drafted token / seconds of a one-row target
forward), then one target forward over K + 1 rows verifies them (``v(K + 1)`` target steps, v(T) = a T-row forward /
a one-row forward). With conditional acceptance a_i = P(draft i accepted | drafts 1..i-1 accepted), the round yields
``1 + sum_{i<=K} prod_{j<=i} a_j`` tokens, so the speedup over plain decoding is that over ``K * c + v(K + 1)``.

What was measured lives in one store, :class:`Costs`: the engine owns it, writes it from what it times each step,
and hands it to every drafter (``DraftRequest.costs``). Everything that decides K (spec/policy.py: the engine's batch
policy, auto's choice per round, the draft model's early stop) reads that store through these functions, and
everything that reports K (the bench, head training) reads the functions; none keeps timings or formulas of its own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

LONG_CATCH_UP = 16  # catch-ups longer than this take the prefill path: learned per token apart (Costs.catch_up)
VERIFY_SLOPE = 0.03  # prior shape of a forward's cost between measured sizes: +3% per extra row (CPU, bf16;
# the bf16 target's v(T): docs/BENCHMARKS.md, "bf16 (dequantized) target")


def ema(old: float | None, new: float, decay: float = 0.8) -> float:
    """Exponential moving average: the first value as is, then ``decay`` of the old plus the rest of the new."""
    return new if old is None else decay * old + (1 - decay) * new


def interpolate(table: Mapping[int, float], T: int) -> float:
    """The cost of a forward over T rows from those measured (rows -> seconds or any unit, non-empty): linear
    between measured sizes, extended past them with the slope of the two nearest (never negative), or with
    VERIFY_SLOPE while only one size is known. Below the smallest size, never under T / near of it (a
    forward's cost per row only falls with T): a line through two noisy timings could reach zero there."""
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


def slope(table: Mapping[int, float], rows: int) -> float:
    """Seconds one more row adds to a forward of ``rows`` rows: the least-squares slope of the costs measured
    between half and twice that size (two neighbouring timings are too noisy: on a busy CPU a step's cost moves by
    more than a row's, docs/BENCHMARKS.md, "Verify cost curve v(T)"), never negative; the interpolation's difference
    where fewer than two are near."""
    near = [(n, t) for n, t in table.items() if rows / 2 <= n <= 2 * rows + 2]
    if len(near) < 2:
        return max(interpolate(table, rows + 1) - interpolate(table, rows), 0.0)
    mean_n = sum(n for n, _ in near) / len(near)
    mean_t = sum(t for _, t in near) / len(near)
    var = sum((n - mean_n) ** 2 for n, _ in near)
    return max(sum((n - mean_n) * (t - mean_t) for n, t in near) / var, 0.0)


def joint(rates: Sequence[float | None]) -> list[float]:
    """Conditional rates a_i -> joint P(the first i drafts accepted), i = 1..len; a None (a position never
    reached) counts as 0, and so does every later joint value."""
    out, run = [], 1.0
    for i, a in enumerate(rates, 1):
        if a is not None and not 0.0 <= a <= 1.0:
            raise ValueError(f"acceptance at position {i} must be in [0, 1], got {a!r}")
        run *= 0.0 if a is None else float(a)
        out.append(run)
    return out


def expected_tokens(rates: Sequence[float | None]) -> float:
    """Expected tokens of one round that drafts len(rates) tokens: the target's own token + the joint rates."""
    return 1.0 + sum(joint(rates))


def predicted_speedup(rates: Sequence[float | None], c: float, curve: Mapping[int, float]) -> float:
    """Expected tokens of a round of K = len(rates) drafts / (K c + v(K + 1)); ``curve``: forward rows -> cost (any
    unit, with a value for 1 row), v(T) = interpolate(curve, T) / curve[1]."""
    if not c >= 0:
        raise ValueError(f"draft cost c must be >= 0, got {c!r}")
    if curve.get(1, 0) <= 0:
        raise ValueError("curve must contain a positive value for 1 row")
    K = len(rates)
    return expected_tokens(rates) / (K * c + interpolate(curve, K + 1) / curve[1])


class Costs:
    """The one store of measured costs, owned by the engine (kept across its requests) and handed to every drafter in
    its DraftRequest. The engine alone writes it, from what it times each step; the policy, auto and the draft
    model's early stop read it, in seconds:

    - ``forward``: rows of a target forward -> EMA seconds of that forward;
    - ``round``: verify size T = K + 1 -> EMA seconds of a request's round besides drafting (its verify forward and
      the bookkeeping around it: a round's fixed cost, which weighs against ending a round early); in a batch, the
      step every request in it waited for, other requests' drafting included;
    - ``draft``: drafter name -> EMA seconds per drafted token, catch-ups excluded;
    - ``catch_up``: (drafter name, long) -> EMA seconds per token a drafter feeds to catch up on committed tokens it
      had not read (long: more than LONG_CATCH_UP tokens, a prompt: learned apart, far cheaper per token).
    """

    def __init__(self, decay: float = 0.8):
        self.decay = decay
        self.forward: dict[int, float] = {}
        self.round: dict[int, float] = {}
        self.draft: dict[str, float] = {}
        self.catch_up: dict[tuple[str, bool], float] = {}

    def observe_forward(self, rows: int, seconds: float) -> None:
        self.forward[rows] = ema(self.forward.get(rows), seconds, self.decay)

    def observe_round(self, T: int, seconds: float) -> None:
        self.round[T] = ema(self.round.get(T), seconds, self.decay)

    def observe_draft(self, name: str, tokens: int, seconds: float) -> None:
        if tokens > 0:
            self.draft[name] = ema(self.draft.get(name), seconds / tokens, self.decay)

    def observe_catch_up(self, name: str, tokens: int, seconds: float) -> None:
        if tokens > 0:
            key = (name, tokens > LONG_CATCH_UP)
            self.catch_up[key] = ema(self.catch_up.get(key), seconds / tokens, self.decay)

    def step_s(self) -> float | None:
        """Seconds of about one plain target step: the cheapest round measured (else a forward of 1 row); None
        before any."""
        if self.round:
            return min(self.round.values())
        return interpolate(self.forward, 1) if self.forward else None

    def catch_up_s(self, name: str, lag: int, prior_per_token: float) -> float:
        """Seconds drafter ``name`` would spend feeding ``lag`` tokens it has not read (``prior_per_token`` before
        it was measured)."""
        if lag <= 0:
            return 0.0
        return lag * self.catch_up.get((name, lag > LONG_CATCH_UP), prior_per_token)
