"""Predicted speedup of speculative decoding from measured acceptance and costs.

The model is that of Leviathan, Kalman & Matias, "Fast Inference from Transformers via Speculative
Decoding" (2022, arXiv:2211.17192), Sec. 3.3-3.4, with the verification cost measured instead of
assumed constant. One round drafts K tokens, costing ``K * c`` target steps (``c`` = draft cost
per drafted token / target cost per autoregressive step), then one target forward over K + 1
tokens verifies them, costing ``v(K + 1)`` target steps, where ``v(T)`` = time of a forward over
T tokens / time of a forward over 1 token. The round yields ``1 + sum_{i=1..K} P(first i drafts
accepted)`` tokens, so the speedup over plain decoding is that count divided by
``K * c + v(K + 1)``. Plain Python, no dependencies.
"""

from __future__ import annotations

from typing import Mapping, Sequence


def _check_rate(x: float, what: str) -> float:
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"{what} must be in [0, 1], got {x!r}")
    return float(x)


def joint_acceptance(per_position: Sequence[float | None]) -> list[float]:
    """Conditional rates ``a_i = P(accept i | 1..i-1 accepted)`` -> joint ``P(first i accepted)``.

    A ``None`` (position never reached) counts as 0, so every later joint value is 0 too.
    """
    joint, run = [], 1.0
    for i, a in enumerate(per_position, 1):
        run *= 0.0 if a is None else _check_rate(a, f"acceptance at position {i}")
        joint.append(run)
    return joint


def expected_tokens_per_round(per_position: Sequence[float | None]) -> float:
    """Expected tokens emitted by one round: 1 (the target's own token) + sum of joint rates."""
    return 1.0 + sum(joint_acceptance(per_position))


def iid_expected_tokens(alpha: float, K: int) -> float:
    """Leviathan's closed form for i.i.d. acceptance: ``(1 - alpha^(K+1)) / (1 - alpha)``."""
    alpha = _check_rate(alpha, "alpha")
    if K < 0:
        raise ValueError(f"K must be >= 0, got {K!r}")
    return K + 1.0 if alpha == 1.0 else (1.0 - alpha ** (K + 1)) / (1.0 - alpha)


def verify_ratio(curve: Mapping[int, float], T: int) -> float:
    """``v(T)``: cost of a target forward over T tokens relative to one token.

    ``curve`` maps T -> time (any unit) or ratio; values are always divided by ``curve[1]``.
    Between measured sizes the value is interpolated linearly; beyond the largest it is
    extrapolated linearly from the last two points (which needs at least two points).
    """
    pts = {int(t): float(v) for t, v in curve.items()}
    if 1 not in pts or pts[1] <= 0:
        raise ValueError("curve must contain a positive value for T=1")
    if T < 1:
        raise ValueError(f"T must be >= 1, got {T!r}")
    if T in pts:
        return pts[T] / pts[1]
    xs = sorted(pts)
    if len(xs) < 2:
        raise ValueError(f"curve has only T=1; cannot extrapolate to T={T}")
    lo, hi = (xs[-2], xs[-1]) if T > xs[-1] else next((a, b) for a, b in zip(xs, xs[1:]) if a < T < b)
    value = pts[lo] + (pts[hi] - pts[lo]) * (T - lo) / (hi - lo)
    return value / pts[1]


def _speedup(tokens: float, K: int, c: float, curve: Mapping[int, float]) -> float:
    if not c >= 0:
        raise ValueError(f"draft cost c must be >= 0, got {c!r}")
    return tokens / (K * c + verify_ratio(curve, K + 1))


def predict_speedup(per_position: Sequence[float | None], c: float, curve: Mapping[int, float],
                    K: int | None = None) -> float:
    """Expected tokens per round / (K*c + v(K+1)); K defaults to ``len(per_position)``.

    With an explicit K, positions beyond it are ignored and missing ones count as never accepted.
    """
    K = len(per_position) if K is None else K
    if K < 0:
        raise ValueError(f"K must be >= 0, got {K!r}")
    return _speedup(expected_tokens_per_round(list(per_position)[:K]), K, c, curve)


def predict_speedup_iid(alpha: float, K: int, c: float, curve: Mapping[int, float]) -> float:
    """Like :func:`predict_speedup` with every conditional acceptance rate equal to ``alpha``."""
    return _speedup(iid_expected_tokens(alpha, K), K, c, curve)


def best_k(alpha: float, c: float, curve: Mapping[int, float], k_max: int = 16) -> int:
    """The K in 1..k_max maximizing :func:`predict_speedup_iid` (the smallest one on ties)."""
    if k_max < 1:
        raise ValueError(f"k_max must be >= 1, got {k_max!r}")
    return max(range(1, k_max + 1), key=lambda K: (predict_speedup_iid(alpha, K, c, curve), -K))
