"""spec/costs.py: the expected tokens of a round and the speedup predictor (Leviathan et al. 2022, Sec. 3.3-3.4)
against hand-computed numbers, and the one interpolation of a forward's cost by its rows."""

from __future__ import annotations

import math

import pytest

from verispec.spec.costs import ema, expected_tokens, interpolate, joint, predicted_speedup, slope

CURVE_MS = {1: 10.0, 2: 10.5, 4: 12.0}


def test_joint_from_conditional():
    assert joint([0.8, 0.5]) == pytest.approx([0.8, 0.4])
    assert joint([0.9, 0.5, 0.5]) == pytest.approx([0.9, 0.45, 0.225])
    assert joint([]) == []


def test_joint_none_counts_as_zero_from_there_on():
    assert joint([0.9, None, 0.7]) == pytest.approx([0.9, 0.0, 0.0])
    assert joint([None, 1.0]) == [0.0, 0.0]


def test_expected_tokens():
    assert expected_tokens([0.8, 0.5]) == pytest.approx(2.2)
    assert expected_tokens([1.0, 1.0, 1.0]) == pytest.approx(4.0)
    assert expected_tokens([0.7, None]) == pytest.approx(1.7)
    assert expected_tokens([]) == 1.0


@pytest.mark.parametrize("alpha", [0.0, 0.1, 0.5, 0.8, 0.95])
@pytest.mark.parametrize("K", [0, 1, 2, 4, 7, 16])
def test_iid_closed_form(alpha, K):
    """Leviathan's closed form for i.i.d. acceptance: (1 - alpha^(K+1)) / (1 - alpha)."""
    assert expected_tokens([alpha] * K) == pytest.approx((1 - alpha ** (K + 1)) / (1 - alpha), rel=1e-12)


def test_interpolate_measured_points_between_and_beyond():
    assert interpolate(CURVE_MS, 2) == 10.5
    assert interpolate(CURVE_MS, 3) == pytest.approx(11.25)
    assert interpolate(CURVE_MS, 6) == pytest.approx(13.5)  # the slope of the two largest sizes
    assert interpolate({1: 1.0, 2: 1.0}, 9) == pytest.approx(1.0)
    assert interpolate({4: 2.0}, 1) == pytest.approx(2.0 / 1.09)  # one size: the prior slope
    assert interpolate({4: 4.0, 8: 4.0}, 2) == pytest.approx(4.0)  # below: never under T / near of the nearest


def test_slope_is_least_squares_nearby_and_never_negative():
    assert slope({1: 1.0, 2: 2.0, 3: 3.0}, 2) == pytest.approx(1.0)
    assert slope({15: 3.0, 16: 2.9}, 16) == 0.0  # a noisy t(16) < t(15) never makes a row free


def test_ema():
    assert ema(None, 3.0) == 3.0
    assert ema(1.0, 3.0, 0.5) == 2.0


def test_predicted_speedup_scripted():
    # tokens = 1 + 0.8 + 0.4 = 2.2; cost = 2 * 0.25 + v(3) = 0.5 + 1.125
    assert predicted_speedup([0.8, 0.5], 0.25, CURVE_MS) == pytest.approx(2.2 / 1.625)
    assert predicted_speedup([0.8, 0.5], 0.0, CURVE_MS) == pytest.approx(2.2 / 1.125)
    assert predicted_speedup([], 0.3, CURVE_MS) == 1.0


@pytest.mark.parametrize("call", [
    lambda: joint([1.2]),
    lambda: joint([0.5, -0.1]),
    lambda: joint([math.nan]),
    lambda: predicted_speedup([0.5], -0.1, CURVE_MS),
    lambda: predicted_speedup([0.5], math.nan, CURVE_MS),
    lambda: predicted_speedup([0.5], 0.1, {2: 1.0}),
])
def test_bad_input_raises_value_error(call):
    with pytest.raises(ValueError):
        call()
