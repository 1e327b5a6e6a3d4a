"""The speedup predictor (Leviathan et al. 2022, Sec. 3.3-3.4) against hand-computed numbers."""

from __future__ import annotations

import math

import pytest

from verispec.costmodel import (best_k, expected_tokens_per_round, iid_expected_tokens, joint_acceptance,
                                    predict_speedup, predict_speedup_iid, verify_ratio)

CURVE_MS = {1: 10.0, 2: 10.5, 4: 12.0}


def test_joint_from_conditional():
    assert joint_acceptance([0.8, 0.5]) == pytest.approx([0.8, 0.4])
    assert joint_acceptance([0.9, 0.5, 0.5]) == pytest.approx([0.9, 0.45, 0.225])
    assert joint_acceptance([]) == []


def test_joint_none_counts_as_zero_from_there_on():
    assert joint_acceptance([0.9, None, 0.7]) == pytest.approx([0.9, 0.0, 0.0])
    assert joint_acceptance([None, 1.0]) == [0.0, 0.0]


def test_expected_tokens_per_round():
    assert expected_tokens_per_round([0.8, 0.5]) == pytest.approx(2.2)
    assert expected_tokens_per_round([1.0, 1.0, 1.0]) == pytest.approx(4.0)
    assert expected_tokens_per_round([0.7, None]) == pytest.approx(1.7)
    assert expected_tokens_per_round([]) == 1.0


@pytest.mark.parametrize("alpha", [0.0, 0.1, 0.5, 0.8, 0.95, 0.999])
@pytest.mark.parametrize("K", [0, 1, 2, 4, 7, 16])
def test_iid_closed_form_matches_general_formula(alpha, K):
    assert iid_expected_tokens(alpha, K) == pytest.approx(expected_tokens_per_round([alpha] * K), rel=1e-12)


def test_iid_edge_values():
    assert iid_expected_tokens(1.0, 5) == 6.0
    assert iid_expected_tokens(0.0, 5) == 1.0
    assert iid_expected_tokens(0.5, 3) == pytest.approx(1.875)  # 1 + .5 + .25 + .125


def test_verify_ratio_measured_points_and_interpolation():
    assert verify_ratio(CURVE_MS, 1) == 1.0
    assert verify_ratio(CURVE_MS, 2) == pytest.approx(1.05)
    assert verify_ratio(CURVE_MS, 3) == pytest.approx(1.125)  # 11.25 ms / 10 ms
    assert verify_ratio(CURVE_MS, 4) == pytest.approx(1.2)
    assert verify_ratio({1: 1.0, 2: 1.1, 8: 1.7}, 5) == pytest.approx(1.4)


def test_verify_ratio_extrapolates_from_last_two_points():
    assert verify_ratio(CURVE_MS, 6) == pytest.approx(1.35)  # 12 + 2 * 0.75 = 13.5 ms
    assert verify_ratio({1: 1.0, 2: 1.0}, 9) == pytest.approx(1.0)


def test_verify_ratio_normalizes_by_curve_at_1():
    assert verify_ratio({1: 2.0, 2: 3.0}, 2) == pytest.approx(1.5)
    assert verify_ratio({1: 2.0, 2: 3.0}, 3) == pytest.approx(2.0)
    assert verify_ratio({"1": 10.0, "2": 10.5}, 2) == pytest.approx(1.05)  # keys as read back from JSON


def test_verify_ratio_errors():
    with pytest.raises(ValueError):
        verify_ratio({2: 1.0, 4: 2.0}, 3)
    with pytest.raises(ValueError):
        verify_ratio({1: 0.0, 2: 1.0}, 2)
    with pytest.raises(ValueError):
        verify_ratio({1: 1.0}, 2)  # nothing to extrapolate from
    with pytest.raises(ValueError):
        verify_ratio(CURVE_MS, 0)


def test_predict_speedup_scripted():
    # tokens = 1 + 0.8 + 0.4 = 2.2; cost = 2 * 0.25 + v(3) = 0.5 + 1.125
    assert predict_speedup([0.8, 0.5], 0.25, CURVE_MS) == pytest.approx(2.2 / 1.625)
    # explicit K=1 keeps only the first position: 1.8 / (0.25 + 1.05)
    assert predict_speedup([0.8, 0.5], 0.25, CURVE_MS, K=1) == pytest.approx(1.8 / 1.3)
    # free drafting: speedup is tokens / v(K+1)
    assert predict_speedup([0.8, 0.5], 0.0, CURVE_MS) == pytest.approx(2.2 / 1.125)
    # K=0 is plain decoding
    assert predict_speedup([], 0.3, CURVE_MS) == 1.0


@pytest.mark.parametrize("alpha", [0.3, 0.7, 1.0])
@pytest.mark.parametrize("K", [1, 3, 5])
def test_predict_speedup_iid_matches_general(alpha, K):
    assert predict_speedup_iid(alpha, K, 0.1, CURVE_MS) == pytest.approx(predict_speedup([alpha] * K, 0.1, CURVE_MS))


def test_best_k():
    curve = {1: 1.0, 2: 1.02, 4: 1.06, 8: 1.14, 16: 1.3}
    ks = [best_k(a, 0.05, curve) for a in (0.1, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95)]
    assert ks == sorted(ks) and ks[-1] > ks[0]
    assert best_k(0.99, 100.0, curve) == 1
    assert best_k(0.0, 0.05, curve) == 1
    assert best_k(0.8, 0.0, {1: 1.0, 2: 1.0}, k_max=9) == 9  # free draft, flat verify: longer is better
    K = best_k(0.8, 0.05, curve, k_max=12)
    assert all(predict_speedup_iid(0.8, K, 0.05, curve) >= predict_speedup_iid(0.8, k, 0.05, curve)
               for k in range(1, 13))


@pytest.mark.parametrize("call", [
    lambda: joint_acceptance([1.2]),
    lambda: joint_acceptance([0.5, -0.1]),
    lambda: joint_acceptance([math.nan]),
    lambda: iid_expected_tokens(1.5, 3),
    lambda: iid_expected_tokens(0.5, -1),
    lambda: predict_speedup([0.5], -0.1, CURVE_MS),
    lambda: predict_speedup([0.5], math.nan, CURVE_MS),
    lambda: predict_speedup([0.5], 0.1, CURVE_MS, K=-1),
    lambda: predict_speedup_iid(-0.2, 2, 0.1, CURVE_MS),
    lambda: best_k(0.5, 0.1, CURVE_MS, k_max=0),
])
def test_bad_input_raises_value_error(call):
    with pytest.raises(ValueError):
        call()
