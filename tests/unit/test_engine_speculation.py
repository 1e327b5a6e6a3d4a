"""K per request in a batched step (engine/speculation.py) against scripted costs and acceptance."""

from __future__ import annotations

from verispec.engine.speculation import SpecPolicy


def policy(step_s: float, row_s: float, acceptance: dict[int, float], t_draft: float = 0.0) -> SpecPolicy:
    """Forward cost step_s + row_s per row beyond the first; each request's acceptance at every position."""
    p = SpecPolicy()
    for rows in (1, 2, 4, 8, 16, 32):
        p.observe_forward(rows, step_s + row_s * (rows - 1))
    for rid, a in acceptance.items():
        ctl = p.controller(rid, 8)
        ctl.acceptance, ctl.t_draft = [a] * 8, t_draft
    return p


def test_before_any_measurement_every_request_drafts_its_most():
    assert SpecPolicy().choose({0: 4, 1: 2}, base_rows=2) == {0: 4, 1: 2}


def test_alone_with_cheap_rows_a_good_drafter_drafts_its_most():
    p = policy(step_s=0.045, row_s=0.005, acceptance={0: 0.9}, t_draft=0.004)
    assert p.choose({0: 4}, base_rows=1) == {0: 4}


def test_speculation_backs_off_as_the_batch_grows():
    # a row costs a third of a step (a 2-core CPU): alone, a draft accepted 80% of the time is worth one more row
    # (0.8 tokens for 27 ms against 1 for 45); with eight requests a step already yields 8 tokens in 150 ms, and a
    # draft row's 0.8 tokens in 27 ms would lower that
    p = policy(step_s=0.045, row_s=0.015, acceptance={i: 0.8 for i in range(8)}, t_draft=0.012)
    assert p._allot({0: 4}, base_rows=1) == {0: 1}
    assert p._allot({i: 4 for i in range(8)}, base_rows=8) == dict.fromkeys(range(8), 0)
    cheap = policy(step_s=0.045, row_s=0.002, acceptance={i: 0.8 for i in range(8)}, t_draft=0.002)
    assert sum(cheap._allot({i: 4 for i in range(8)}, base_rows=8).values()) > 8  # cheap rows: drafts pay again


def test_drafts_go_to_the_requests_most_likely_to_be_accepted():
    p = policy(step_s=0.045, row_s=0.015, acceptance={0: 0.95, 1: 0.3}, t_draft=0.012)
    k = p._allot({0: 4, 1: 4}, base_rows=2)
    assert k[0] > 0 and k[1] == 0


def test_a_drafter_that_is_never_right_drafts_only_in_back_off_retries():
    p = policy(step_s=0.045, row_s=0.002, acceptance={0: 0.0}, t_draft=0.001)
    ks = [p.choose({0: 8}, base_rows=1)[0] for _ in range(4 + 8 + 16 + 3)]
    assert [i for i, k in enumerate(ks) if k] == [3, 11, 27] and set(ks) == {0, 8}


def test_observed_rounds_move_a_request_estimate():
    p = policy(step_s=0.045, row_s=0.015, acceptance={}, t_draft=0.0)
    p.controller(7, 4)
    for _ in range(20):
        p.observe(7, 4, 4, 0.01)  # every draft accepted, 2.5 ms a draft
    assert p.controllers[7].rates()[0] > 0.95 and p.choose({7: 4}, base_rows=1)[7] == 4
    p.forget(7)
    assert 7 not in p.controllers


def test_a_drafter_that_must_first_read_its_prompt_waits_and_is_not_retried():
    p = policy(step_s=0.045, row_s=0.005, acceptance={0: 0.9, 1: 0.9}, t_draft=0.004)
    # request 1's draft model skipped its prompt: 0.35 s to read it, 0.03 s of it charged to this step
    k = p.choose({0: 4, 1: 4}, base_rows=2, catch_up={0: (0.0, 0.0), 1: (0.35, 0.03)})
    assert k[0] > 0 and k[1] < k[0]
    never = policy(step_s=0.045, row_s=0.002, acceptance={0: 0.0}, t_draft=0.001)
    ks = [never.choose({0: 8}, base_rows=1, catch_up={0: (0.35, 0.0)})[0] for _ in range(40)]
    assert ks == [0] * 40  # a retry would cost 0.35 s, more than RETRY_MAX_CATCH_UP steps: none
