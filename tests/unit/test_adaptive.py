"""Adaptive K against a scripted acceptance / cost model: the controller picks what the model says."""

import pytest

from verispec.adaptive import DraftLengthController
from verispec.costmodel import expected_tokens_per_round


def trained(rates, t_draft, t_verify, k_max=8, k_min=1, rounds=200):
    """A controller fed rounds whose outcomes follow the per-position rates exactly (in expectation)."""
    c = DraftLengthController(k_min, k_max, decay=0.0)  # decay 0: the last observation is the estimate
    c.acceptance = list(rates) + [None] * (k_max - len(rates))
    c.t_draft = t_draft
    c.t_verify = dict(t_verify)
    return c


def best_by_brute_force(rates, t_draft, verify, k_lo, k_hi):
    return max(range(k_lo, k_hi + 1),
               key=lambda K: (expected_tokens_per_round(rates[:K]) / (K * t_draft + verify(K + 1)), -K))


@pytest.mark.parametrize("alpha", [0.2, 0.5, 0.8, 0.95])
@pytest.mark.parametrize("t_draft", [0.0, 0.005, 0.02, 0.08])
def test_choice_maximizes_the_model(alpha, t_draft):
    verify = {T: 0.08 * (1 + 0.03 * (T - 1)) for T in range(1, 10)}
    c = trained([alpha] * 8, t_draft, verify)
    assert c.choose(8) == best_by_brute_force([alpha] * 8, t_draft, verify.__getitem__, 1, 8)


def test_direction_of_the_choice():
    verify = {T: 0.08 for T in range(1, 10)}
    assert trained([0.95] * 8, 0.0, verify).choose(8) == 8  # free, accurate drafts: draft the most
    assert trained([0.1] * 8, 0.03, verify).choose(8) == 1  # poor drafts at a price: the least
    high, low = trained([0.9] * 8, 0.02, verify).choose(8), trained([0.6] * 8, 0.02, verify).choose(8)
    assert high > low


def test_bounds_and_cap():
    verify = {T: 0.08 for T in range(1, 10)}
    c = trained([0.99] * 8, 0.0, verify, k_min=2, k_max=6)
    assert c.choose(8) == 6 and c.choose(3) == 3 and c.choose(1) == 1  # the budget cap wins over k_min
    c = trained([0.01] * 8, 0.05, verify, k_min=3, k_max=6)
    assert c.choose(8) == 3


def test_first_round_drafts_the_most_then_learns():
    c = DraftLengthController(1, 6)
    assert c.choose(6) == 6  # nothing measured yet
    for _ in range(30):  # every draft rejected at position 1, drafting is expensive
        c.observe(c.choose(6), 0, draft_s=0.02 * c.choose(6), verify_s=0.08)
    assert c.choose(6) == 1 and c.rates()[0] < 0.05
    for _ in range(60):  # now everything is accepted
        K = c.choose(6)
        c.observe(K, K, draft_s=0.001 * K, verify_s=0.08)
    assert c.choose(6) == 6


def test_unjudged_positions_take_the_last_judged_estimate():
    c = DraftLengthController(1, 4, prior_acceptance=0.5)
    assert c.rates() == [0.5] * 4
    c.observe(2, 1, 0.01, 0.1)  # position 1 accepted, position 2 rejected
    assert c.rates() == [1.0, 0.0, 0.0, 0.0]
    assert c.t_draft == pytest.approx(0.005) and c.t_verify == {3: 0.1}


def test_verify_time_between_measured_sizes():
    c = DraftLengthController(1, 8)
    c.t_verify = {2: 0.1}
    assert c.verify_seconds(2) == 0.1
    assert c.verify_seconds(5) == pytest.approx(0.1 * (1 + 0.03 * 4) / 1.03)


def test_bad_bounds():
    with pytest.raises(ValueError):
        DraftLengthController(3, 2)
