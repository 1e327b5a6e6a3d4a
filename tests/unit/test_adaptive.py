"""Adaptive K against a scripted acceptance / cost model: the controller picks what the model says."""

import pytest

from verispec.spec.costs import Costs, expected_tokens as expected_tokens_per_round, interpolate as verify_seconds
from verispec.spec.policy import Calibration, DraftLengthController, worth_another_draft


def trained(rates, t_draft, t_verify, k_max=8, k_min=1, rounds=200):
    """A controller fed rounds whose outcomes follow the per-position rates exactly (in expectation)."""
    c = DraftLengthController(k_min, k_max, decay=0.0)  # decay 0: the last observation is the estimate
    c.acceptance = list(rates) + [None] * (k_max - len(rates))
    c.t_draft = t_draft
    c.costs.round.update(t_verify)
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
    costs = Costs()  # the engine's store: the controller learns acceptance, the engine times the rounds
    c = DraftLengthController(1, 6, costs=costs, name="draft")
    assert c.choose(6) == 6  # nothing measured yet

    def play(accepted, draft_s_per_token):
        K = c.choose(6)
        c.observe(K, accepted(K))
        costs.observe_draft("draft", K, draft_s_per_token * K)  # what the engine writes for the round
        costs.observe_round(K + 1, 0.08)

    for _ in range(30):  # every draft rejected at position 1, drafting is expensive
        play(lambda K: 0, 0.02)
    assert c.choose(6) == 1 and c.rates()[0] < 0.05
    for _ in range(60):  # now everything is accepted
        play(lambda K: K, 0.001)
    assert c.choose(6) == 6


def test_unjudged_positions_take_the_last_judged_estimate():
    costs = Costs()
    c = DraftLengthController(1, 4, prior_acceptance=0.5, costs=costs, name="draft")
    assert c.rates() == [0.5] * 4 and c.rounds == 0
    c.observe(2, 1)  # position 1 accepted, position 2 rejected: each the mean of the prior (one verdict) and its own
    assert c.rates() == pytest.approx([0.75, 0.25, 0.25, 0.25])
    assert c.rounds == 1  # a record of its own now
    c.observe(0, 0)  # a round that drafted nothing judges nothing
    assert c.rounds == 1 and c.rates() == pytest.approx([0.75, 0.25, 0.25, 0.25])
    # the controller writes no cost: it reads its drafter's in the store the engine fills
    assert c.t_draft is None and c.t_verify == {} and costs.draft == {} and costs.round == {}
    costs.observe_draft("draft", 2, 0.01)
    costs.observe_draft("ngram", 2, 1.0)  # another drafter's cost is not this one's
    costs.observe_round(3, 0.1)
    assert c.t_draft == pytest.approx(0.005) and c.t_verify == {3: 0.1} and c.t_verify is costs.round


def test_verify_time_between_measured_sizes():
    c = DraftLengthController(1, 8)
    c.costs.round[2] = 0.1
    assert c.verify_seconds(2) == 0.1
    assert c.verify_seconds(5) == pytest.approx(0.1 * (1 + 0.03 * 4) / 1.03)


def test_bad_bounds():
    with pytest.raises(ValueError):
        DraftLengthController(3, 2)


def test_verify_seconds_interpolates_and_extends_measured_sizes():
    table = {2: 0.10, 4: 0.12, 8: 0.20}
    assert verify_seconds(table, 4) == 0.12
    assert verify_seconds(table, 3) == pytest.approx(0.11)  # between measured sizes: linear
    assert verify_seconds(table, 6) == pytest.approx(0.16)
    assert verify_seconds(table, 10) == pytest.approx(0.24)  # past them: the slope of the last two
    assert verify_seconds(table, 1) == pytest.approx(0.09)  # below them: the slope of the first two
    assert verify_seconds({2: 0.10, 3: 0.09}, 6) == pytest.approx(0.09)  # a noisy negative slope: flat
    # below them a steep noisy slope would reach zero (and a cheap drafter's rate infinity): T / near of it
    assert verify_seconds({3: 0.01, 5: 0.50}, 2) == pytest.approx(0.01 * 2 / 3)
    assert verify_seconds({2: 0.1}, 5) == pytest.approx(0.1 * (1 + 0.03 * 4) / 1.03)  # one size: the prior slope


def _rate(confidences, t_draft, verify):
    joint, run = [], 1.0
    for q in confidences:
        run *= q
        joint.append(run)
    return (1 + sum(joint)) / (len(confidences) * t_draft + verify(len(confidences) + 1))


@pytest.mark.parametrize("q", [0.05, 0.3, 0.6, 0.8, 0.95, 0.999])
@pytest.mark.parametrize("t_draft", [0.002, 0.01, 0.02, 0.05])
@pytest.mark.parametrize("slope", [0.0, 0.05, 0.3])
def test_worth_another_draft_is_the_cost_model(q, t_draft, slope):
    """One more draft (assumed accepted as often as the last) iff it raises the expected rate."""
    table = {T: 0.05 * (1 + slope * (T - 1)) for T in range(1, 12)}
    for confidences in ([q], [0.9, q], [0.99, 0.9, 0.8, q]):
        more = _rate(confidences + [confidences[-1]], t_draft, table.__getitem__)
        less = _rate(confidences, t_draft, table.__getitem__)
        assert worth_another_draft(confidences, t_draft, table) == (more > less)


def test_worth_another_draft_directions():
    flat = {T: 0.05 for T in range(1, 12)}
    assert worth_another_draft([0.95], 0.01, flat)  # a sure, cheap draft goes on
    assert not worth_another_draft([0.2], 0.01, flat)  # a hesitant one stops
    assert not worth_another_draft([0.95], 0.2, flat)  # a draft step dearer than a target step: stop
    steep = {T: 0.05 * (1 + 0.5 * (T - 1)) for T in range(1, 12)}
    assert worth_another_draft([0.8], 0.01, flat) and not worth_another_draft([0.8], 0.01, steep)  # dear rows
    assert not worth_another_draft([0.95, 0.3], 0.01, flat)  # the joint chance decides, not the first alone


def test_calibration_starts_at_the_confidence_and_follows_verdicts():
    cal = Calibration(bins=10, prior=2.0)
    assert cal(0.62) == pytest.approx(0.65) and cal(0.0) == pytest.approx(0.05) and cal(1.0) == pytest.approx(0.95)
    for _ in range(200):  # an under-confident draft: tokens drafted at 0.6-0.7 are always accepted
        cal.observe([0.99, 0.65], num_accepted=2)
    assert cal(0.65) > 0.98 and cal(0.99) > 0.98
    for _ in range(200):  # the second draft now always rejected; a third, never judged, counts for nothing
        cal.observe([0.99, 0.35, 0.95], num_accepted=1)
    assert cal(0.35) < 0.02
    assert cal.judged[9] == 2.0 + 400  # the 0.95 after a rejection was never judged
