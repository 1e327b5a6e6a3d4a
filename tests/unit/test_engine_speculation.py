"""K per request in a batched step (spec/policy.py) against scripted costs and acceptance."""

from __future__ import annotations

import time

import pytest
import torch

from verispec.drafters.base import Draft, Drafter

from verispec.spec.policy import PRIOR_CATCH_UP, SpecPolicy


def policy(step_s: float, row_s: float, acceptance: dict[int, float], t_draft: float = 0.0) -> SpecPolicy:
    """Forward cost step_s + row_s per row beyond the first; each request's acceptance at every position."""
    p = SpecPolicy()
    for rows in (1, 2, 4, 8, 16, 32):
        p.costs.observe_forward(rows, step_s + row_s * (rows - 1))
    for rid, a in acceptance.items():
        ctl = p.controller(rid, 8)
        ctl.acceptance, ctl.t_draft = [a] * 8, t_draft
    return p


def test_no_request_drafts_before_a_forward_is_measured():
    assert SpecPolicy().choose({0: 4, 1: 2}, base_rows=2) == {0: 0, 1: 0}


def test_prompt_chunks_alone_never_make_the_bar_look_low():
    # only prompt chunks measured, 300 rows in 4.8 s and 292 in 5 s (noise): extended down, that (flat) line costs
    # 2 rows 5 s, so any draft would look cheap; costed at the chunks' 17 ms a row instead, two plain rows yield
    # 60 tokens/s, which a draft at the prior acceptance (0.6) costing 16 ms of drafting and 17 ms a row does not
    p = SpecPolicy()
    p.costs.observe_forward(300, 4.8)
    p.costs.observe_forward(292, 5.0)
    assert p._plain_seconds(2) < 0.035
    for rid in (0, 1):
        p.controller(rid, 4).t_draft = 0.016
    assert p.choose({0: 4, 1: 4}, base_rows=2) == {0: 0, 1: 0}


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
    cheap = policy(step_s=0.045, row_s=0.001, acceptance={i: 0.8 for i in range(8)}, t_draft=0.001)
    assert sum(cheap._allot({i: 4 for i in range(8)}, base_rows=8).values()) > 8  # cheap rows: drafts pay again


def test_drafts_go_to_the_requests_most_likely_to_be_accepted():
    p = policy(step_s=0.045, row_s=0.015, acceptance={0: 0.95, 1: 0.3}, t_draft=0.008)
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
        p.observe(7, 4, 4)  # every draft accepted
        p.costs.observe_draft("", 4, 0.01)  # 2.5 ms a draft, as the engine measures it
    assert p.controllers[7].rates()[0] > 0.95 and p.controllers[7].rounds == 20
    assert p.choose({7: 4}, base_rows=1)[7] == 4
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


def test_a_step_that_reads_prompts_is_valued_as_a_plain_step_of_its_sequences():
    # 8 sequences, 2 of them decoding, 300 prompt rows: the step yields 2 tokens for 4.5 s, so any draft would
    # raise *its* tokens per second; but a draft's 27 ms delays all 8, which decode at 8 / 0.15 s without drafts
    p = policy(step_s=0.045, row_s=0.015, acceptance={0: 0.8, 1: 0.8}, t_draft=0.012)
    assert p.choose({0: 4, 1: 4}, base_rows=302, seqs=8) == {0: 0, 1: 0}
    assert sum(p.choose({0: 4}, base_rows=1, seqs=1).values()) > 0  # the same request alone drafts


def test_no_retry_where_even_perfect_drafts_would_lose():
    # 16 sequences, a row costs 19 ms, a draft 16 ms: one perfect draft gives 1 token in 35 ms, below the plain
    # 16 tokens in 0.33 s; measuring a poor drafter's acceptance again cannot pay, however long it waited
    batch = policy(step_s=0.045, row_s=0.019, acceptance={i: 0.0 for i in range(16)}, t_draft=0.016)
    ks = [batch.choose({i: 4 for i in range(16)}, base_rows=16) for _ in range(40)]
    assert all(sum(k.values()) == 0 for k in ks)
    alone = policy(step_s=0.045, row_s=0.002, acceptance={0: 0.0}, t_draft=0.016)
    ks = [alone.choose({0: 4}, base_rows=1)[0] for _ in range(12)]
    assert [i for i, k in enumerate(ks) if k] == [3, 11]  # alone, it still retries


def test_a_noisy_forward_timing_does_not_make_a_row_free():
    # t(16) measured below t(15) (a 10-20% swing between steps is common on a busy CPU): the next-size difference
    # is negative, which would rate a draft infinitely good; the slope over nearby sizes is ~19 ms a row
    p = SpecPolicy()
    for rows, t in {1: 0.045, 8: 0.15, 12: 0.23, 15: 0.31, 16: 0.29, 17: 0.32, 24: 0.45, 32: 0.6}.items():
        p.costs.observe_forward(rows, t)
    ctl = p.controller(0, 4)
    ctl.acceptance = [0.6] * 4
    assert 0.015 < p._row_seconds(15) < 0.025
    assert p.choose({0: 4} | {i: 0 for i in range(1, 15)}, base_rows=15) == {0: 0} | {i: 0 for i in range(1, 15)}


def test_a_new_request_starts_from_the_draft_cost_others_measured():
    # alone, a row costs 8 ms and a step 45: a fresh request's first draft, 15 ms of its prompt catch-up charged to
    # it, pays at the prior acceptance only if drafting were free (0.6 / 23 ms > 1.1 / 45 ms); its draft model costs
    # 16 ms a token, as every earlier request measured (0.6 / 39 ms < 1.1 / 45 ms)
    p = policy(step_s=0.045, row_s=0.008, acceptance={})
    assert p.choose({9: 4}, base_rows=1, catch_up={9: (0.5, 0.015)})[9] > 0
    p = policy(step_s=0.045, row_s=0.008, acceptance={})
    p.admit(0, 4, "draft")
    p.controller(0, 4)
    for _ in range(5):
        p.observe(0, 2, 1)
        p.costs.observe_draft("draft", 2, 0.032)  # 16 ms a drafted token, in the engine's store
    p.forget(0)
    p.admit(1, 4, "draft")
    assert p.choose({1: 4}, base_rows=1, catch_up={1: (0.5, 0.015)})[1] == 0
    p.admit(2, 4, "ngram")  # another drafter's request is not billed the draft model's cost
    assert p.choose({2: 4}, base_rows=1, catch_up={2: (0.5, 0.015)})[2] > 0


def test_a_controller_is_sized_by_the_request_bound_not_the_first_budget_cut_k():
    """A request admitted with K = 8 whose first step was cut to 2 by the budget later drafts 8: its estimates must
    hold 8 positions (an IndexError in a server whose batch shrank, before)."""
    p = SpecPolicy()
    p.admit(7, 8)
    ctl = p.controller(7, 2)
    assert ctl.k_max == 8
    ctl.observe(8, 8)
    p.forget(7)
    assert 7 not in p.bounds and 7 not in p.controllers


def test_a_long_catch_up_is_learned_per_token_and_spread_over_the_steps_left():
    p = SpecPolicy()
    assert p.catch_up("draft", 100, 64) == (0.0, 0.0)  # nothing measured yet
    p.costs.observe_forward(1, 0.05)
    p.costs.observe_catch_up("draft", 8, 1.0)  # short: learned per token apart from long ones
    assert p.costs.catch_up == {("draft", False): pytest.approx(0.125)}
    p.costs.observe_catch_up("draft", 200, 0.4)
    assert p.costs.catch_up["draft", True] == pytest.approx(0.002)
    seconds, share = p.catch_up("draft", 100, 64)
    assert seconds == pytest.approx(0.2) and share == pytest.approx(0.2 / 32)
    assert p.catch_up("draft", 3, 64) == pytest.approx((0.375, 0.375))  # a short one is this step's cost in full
    # another drafter has no record: the prior, PRIOR_CATCH_UP target steps a token
    assert p.catch_up("eagle", 3, 64) == pytest.approx((3 * PRIOR_CATCH_UP * 0.05,) * 2)


# The engine measures every cost into its one store (spec/costs.py), which the policy and every drafter read.

PROMPT = list(b"def add(a, b): return a + b\ndef add(a, b): return a + b\ndef ")  # 60 tokens: a long catch-up


@pytest.fixture(scope="module")
def tiny(tiny_dirs):
    from verispec import LLM

    return LLM(target=str(tiny_dirs["qwen2"]), draft=str(tiny_dirs["qwen2"]), dtype="float32", draft_quant=None,
               progress=False)


def tiny_engine(llm):
    from verispec.engine import Engine

    return Engine(llm.target.model, num_blocks=64, block_size=4, chunk_size=16, logit_mask=llm.logit_mask)


def run_alone(eng, drafter, K=4, new=16):
    from verispec import SamplingParams

    req = eng.add(PROMPT, SamplingParams(max_new_tokens=new, ignore_eos=True), drafter, K, fixed_k=True)
    while eng.has_work:
        eng.step()
    return req


def test_the_engine_writes_every_cost_into_its_one_store_under_the_drafter_and_its_delegate(tiny):
    """auto delegating to the draft model (Draft.source = "draft"): a round's draft seconds (and the prompt's
    catch-up) are the costs of both auto and the draft model; the forward and round costs are everyone's."""
    from verispec.drafters.auto import AutoDrafter
    from verispec.drafters.draft_model import DraftModelDrafter

    eng = tiny_engine(tiny)
    assert eng.policy.costs is eng.costs
    auto = AutoDrafter({"draft": DraftModelDrafter(tiny.draft.model, early_stop=False)}, 1, 4, allow_no_spec=False)
    req = run_alone(eng, auto)
    assert req.output_ids and req.stats.drafters["draft"][0] >= 2  # two rounds or more, all delegated
    c = eng.costs
    assert auto.costs is c and auto.controller("draft").costs is c  # auto read the engine's store, not its own
    assert c.forward and all(s > 0 for s in c.forward.values())
    assert 16 in c.forward  # the prompt's chunks (chunk_size 16) are measured too
    # a round besides drafting, by verify size: auto drafts K <= 4 (its own choice), verified in K + 1 rows
    assert c.round and all(2 <= T <= 5 and s > 0 for T, s in c.round.items())
    assert set(c.draft) == {"auto", "draft"} and all(s > 0 for s in c.draft.values())
    assert ("auto", True) in c.catch_up and ("draft", True) in c.catch_up  # its first round read the prompt
    assert auto.controller("draft").rounds >= 2  # auto itself learned only acceptance
    assert auto.controller("draft").t_draft == c.draft["draft"]  # and prices its delegate with the store's cost


class Scripted(Drafter):
    """Its first round reports a long catch-up it spent ``catch_up_s`` (slept) on, then drafts 2 tokens; every
    later round proposes nothing (a plain step, as auto's K = 0)."""

    name = "scripted"

    def __init__(self, catch_up_s):
        self.catch_up_s, self.rounds = catch_up_s, 0

    def propose(self, request):
        self.rounds += 1
        if self.rounds == 1:
            time.sleep(self.catch_up_s)
            self.catch_up = (300, self.catch_up_s)
            return Draft(torch.tensor([[7, 7]], dtype=torch.long))
        self.catch_up = (0, 0.0)
        return Draft(torch.empty(1, 0, dtype=torch.long))


def test_the_engine_keeps_a_catch_up_out_of_the_draft_cost_and_times_a_plain_round(tiny):
    eng = tiny_engine(tiny)
    drafter = Scripted(catch_up_s=0.2)
    run_alone(eng, drafter, K=2, new=6)
    c = eng.costs
    assert drafter.rounds >= 3
    assert c.catch_up == {("scripted", True): pytest.approx(0.2 / 300)}  # learned per token, long
    assert c.draft["scripted"] < 0.05  # the 0.2 s of catch-up are not billed as drafting (0.1 s a token)
    assert set(c.round) == {3, 1}  # the round of 2 drafts, then the plain rounds: t_verify(1)
