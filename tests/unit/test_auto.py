"""``auto``'s choice against scripted drafters: per-match-length estimates for n-gram lookup, the draft
model's catch-up cost spread over the rounds left, the bookkeeping of what each round cost, and no
speculation (a plain target step) against drafting, timed with a fake clock."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import verispec.drafters.auto
from verispec.config import SamplingParams
from verispec.drafters.auto import AutoDrafter
from verispec.spec.policy import NO_SPEC_RETRY, NO_SPEC_RETRY_MAX, SPEC_MARGIN
from verispec.drafters.base import Draft, Drafter, DraftRequest


class Lookup(Drafter):
    """A cheap drafter that proposes ``tokens`` with a match of length ``match``."""

    cheap = True

    def __init__(self):
        self.tokens, self.last_match, self.updates = [], 0, []

    def propose(self, request):
        return Draft(torch.tensor([self.tokens[: request.num_tokens]], dtype=torch.long).reshape(1, -1))

    def update(self, n):
        self.updates.append(n)


class Model(Drafter):
    """An expensive drafter whose cache lacks ``behind`` tokens of the context."""

    def __init__(self):
        self.behind, self.proposed, self.updates = 1, [], []
        self.catch_up = (0, 0.0)

    def lag(self, context):
        return self.behind

    def propose(self, request):
        self.proposed.append(request.num_tokens)
        self.catch_up = (self.behind, 0.0)
        return Draft(torch.full((1, request.num_tokens), 7, dtype=torch.long))

    def update(self, n):
        self.updates.append(n)


def request(context_len=100, new_left=200, K=4, params=SamplingParams()):
    ctx = list(range(context_len))
    return DraftRequest(ctx, K, params, None, context_len + new_left + K + 1, 1000, None)


def trained_auto(k_max=4):
    lookup, model = Lookup(), Model()
    auto = AutoDrafter({"ngram": lookup, "draft": model}, 1, k_max)
    auto.t_verify.update({T: 0.05 for T in range(1, k_max + 2)})  # one target step: 50 ms, flat verify
    for match, rate in ((1, 0.1), (4, 0.95)):
        ctl = auto.controller("ngram", match)
        ctl.acceptance, ctl.t_draft = [rate] * k_max, 0.0
    ctl = auto.controller("draft")
    ctl.acceptance, ctl.t_draft = [0.7] * k_max, 0.012
    return auto, lookup, model


def test_a_long_match_goes_to_ngram_a_short_one_to_the_draft_model():
    auto, lookup, model = trained_auto()
    lookup.tokens = [1, 2, 3, 4]
    lookup.last_match = 4
    assert auto.propose(request()).source == "ngram" and model.proposed == []
    auto.update(4)
    assert lookup.updates == [4]
    lookup.last_match = 1  # the same continuation, found from a 1-token match: rarely right
    draft = auto.propose(request())
    assert draft.source == "draft" and model.proposed == [4]
    auto.update(2)
    assert model.updates == [2] and lookup.updates == [4]  # only the chosen drafter learns


def test_ngram_drafts_are_cut_to_the_length_their_match_supports():
    auto, lookup, _ = trained_auto(k_max=8)
    ctl = auto.controller("ngram", 3)
    ctl.acceptance, ctl.t_draft = [0.9, 0.05, 0.05, 0.05, 0.05, 0.05, 0.05, 0.05], 0.0
    auto.t_verify.update({T: 0.05 * (1 + 0.1 * (T - 1)) for T in range(1, 10)})  # longer verify costs more
    auto.controller("draft").acceptance = [0.01] * 8
    lookup.tokens, lookup.last_match = list(range(1, 9)), 3
    draft = auto.propose(request(K=8))
    assert draft.source == "ngram" and draft.tokens.shape[1] == 1


@pytest.mark.parametrize("new_left,chosen", [(8, "ngram"), (2000, "draft")])
def test_a_long_catch_up_counts_against_the_draft_model_less_when_many_tokens_remain(new_left, chosen):
    auto, lookup, model = trained_auto()
    lookup.tokens, lookup.last_match = [1, 2, 3, 4], 1  # a mediocre n-gram option is on the table
    auto.controller("ngram", 1).acceptance = [0.2] * 4
    auto.t_catch_up["draft", True] = 0.002  # 2 ms per token of a long catch-up
    model.behind = 400  # the draft model never ran: it would first prefill 400 tokens (0.8 s)
    # 8 tokens left: 0.8 s is not worth it; 2000 left: the prefill pays back over the rounds to come
    assert auto.propose(request(new_left=new_left)).source == chosen


def test_catch_up_time_is_learned_per_token_and_kept_out_of_the_draft_cost():
    auto, lookup, model = trained_auto()
    model.behind = 1

    def long_propose(request):
        model.catch_up = (300, 0.6)  # the first forward fed 300 tokens in 0.6 s
        return Draft(torch.full((1, request.num_tokens), 7, dtype=torch.long))

    model.propose = long_propose
    auto.propose(request())
    auto.update(3)
    assert auto.t_catch_up["draft", True] == 0.002
    assert auto.controller("draft").t_draft < 0.05  # 0.6 s of catch-up not billed as drafting


def test_what_auto_measured_carries_over_to_the_next_request_with_the_same_sampling():
    memory = {}
    first = AutoDrafter({"draft": Model()}, 1, 4, memory=memory)
    first.propose(request())
    first.update(2)
    assert first.t_verify and first.controller("draft").t_draft is not None
    second = AutoDrafter({"draft": Model()}, 1, 4, memory=memory)
    second.propose(request())  # its first round continues from the first request's estimates
    assert second.controllers is first.controllers and second.t_verify is first.t_verify
    sampled = AutoDrafter({"draft": Model()}, 1, 4, memory=memory)
    sampled.propose(request(params=SamplingParams(temperature=0.7)))  # another sampling setting: its own record
    assert sampled.controllers is not first.controllers and not sampled.t_verify
    assert len(memory) == 2


def test_one_bad_first_round_lowers_a_drafter_it_does_not_switch_it_off(clock):
    auto, model = slow_auto(clock, acceptance=0.95)
    ctl = auto.controller("draft")
    ctl.acceptance = [None] * 4  # nothing judged yet: the prior, 0.6
    auto.t_verify[1] = 0.05
    play(auto, clock, 1)  # all rejected
    assert ctl.rates() == pytest.approx([0.48] * 4)


def test_nothing_to_propose_is_a_plain_step():
    lookup = Lookup()
    auto = AutoDrafter({"ngram": lookup}, 1, 4)
    draft = auto.propose(request())
    assert draft.tokens.shape == (1, 0)
    auto.update(0)
    assert lookup.updates == []


def test_first_round_tries_a_long_match_but_not_a_short_one():
    lookup, model = Lookup(), Model()
    auto = AutoDrafter({"ngram": lookup, "draft": model}, 1, 4)
    lookup.tokens, lookup.last_match = [5, 6, 7], 3
    assert auto.propose(request()).source == "ngram"  # no costs measured yet: a long match is free to try
    auto.update(0)
    assert auto.t_verify  # the round measured the target's verify cost for everyone
    for match in (1, 2):  # a short match is not worth a round beside a draft model, in its first round too
        fresh = AutoDrafter({"ngram": lookup, "draft": Model()}, 1, 4)
        lookup.tokens, lookup.last_match = [5], match
        assert fresh.propose(request()).source == "draft"
    lookup.tokens = []
    assert auto.propose(request()).source == "draft"


@pytest.mark.parametrize("draft_acceptance,chosen", [(0.7, "ngram"), (1.0, "draft")])
def test_a_long_match_never_tried_is_weighed_at_the_prior(draft_acceptance, chosen):
    auto, lookup, model = trained_auto()
    auto.controller("draft").acceptance = [draft_acceptance] * 4
    lookup.tokens, lookup.last_match = [1, 2, 3, 4], 3  # no record for 3-token matches yet
    # valued at the prior acceptance (0.6 a position) for no draft time: worth a try beside a draft model
    # accepted 70% of the time, not beside one that is never wrong
    assert auto.propose(request()).source == chosen
    auto.update(0)
    if chosen == "ngram":  # it was wrong: now it has a record, falling from the prior with each miss (EMA 0.8:
        # 0.48, 0.38, 0.31), and after a few misses the draft model wins
        assert auto.controller("ngram", 3).t_draft is not None
        sources = []
        for _ in range(5):
            auto.t_verify.update({T: 0.05 for T in range(1, 6)})  # the verify cost stays flat at 50 ms
            sources.append(auto.propose(request()).source)
            auto.update(0)
        assert sources[0] == "ngram" and "draft" in sources[:4]


def test_a_short_match_without_a_record_is_not_tried_beside_a_draft_model():
    auto, lookup, model = trained_auto()
    lookup.tokens, lookup.last_match = [1, 2, 3, 4], 2  # shorter than TRY_MIN_MATCH, no record
    assert auto.propose(request()).source == "draft"
    auto.update(2)
    del auto.drafters["draft"]  # alone, the n-gram draft is still taken (better than a plain step)
    assert auto.propose(request()).source == "ngram"

class Clock:
    """A fake ``time.perf_counter``: seconds pass only when a test says so."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(verispec.drafters.auto, "time", SimpleNamespace(perf_counter=c))
    return c


class TimedModel(Model):
    """An expensive drafter that spends ``t_draft`` fake seconds per drafted token."""

    def __init__(self, clock, t_draft):
        super().__init__()
        self.clock, self.t_draft = clock, t_draft

    def propose(self, request):
        self.clock.now += self.t_draft * request.num_tokens
        return super().propose(request)


def slow_auto(clock, acceptance=0.1, t_draft=0.02, allow_no_spec=True):
    """auto with one draft model, measured: ``acceptance`` at every position, ``t_draft`` s per drafted token,
    verify 50 ms at every size but 1 (not measured yet)."""
    model = TimedModel(clock, t_draft)
    model.behind = 0  # in step with the context: no catch-up to pay
    auto = AutoDrafter({"draft": model}, 1, 4, allow_no_spec=allow_no_spec)
    auto.t_verify.update({T: 0.05 for T in range(2, 6)})
    ctl = auto.controller("draft")
    ctl.acceptance, ctl.t_draft = [acceptance] * 4, t_draft
    return auto, model


def play(auto, clock, rounds, accept_all=False, verify_s=0.05):
    """``rounds`` rounds whose verify takes ``verify_s`` fake seconds at any size; every draft accepted, or none.
    -> one letter a round: D (drafted), P (plain step)."""
    out = ""
    for _ in range(rounds):
        K = auto.propose(request()).tokens.shape[1]  # [1, K]
        clock.now += verify_s
        auto.update(K if accept_all else 0)
        out += "D" if K else "P"
    return out


def drafter_value(auto):
    ctl = auto.controller("draft")
    return ctl.tokens_per_second(ctl.choose(4))


def test_slow_poor_drafts_lose_to_a_plain_step_valued_at_one_over_the_measured_verify(clock):
    auto, model = slow_auto(clock)  # K=1: 1.1 tokens in 0.07 s (15.7/s); a plain step: 1 in ~0.05 s (20/s)
    assert drafter_value(auto) == pytest.approx(1.1 / 0.07)
    draft = auto.propose(request())
    assert draft.tokens.shape == (1, 0) and draft.source is None and model.proposed == []
    clock.now += 0.04  # the plain step took 40 ms
    auto.update(0)
    assert model.updates == []  # a switched-off drafter learns nothing
    assert auto.t_verify[1] == pytest.approx(0.04)  # the plain round measured t_verify(1)
    assert auto.no_spec_value() == pytest.approx(25.0)
    # the decision turns on 1 / t_verify(1): a drafter must promise SPEC_MARGIN times a plain step's rate
    value = drafter_value(auto) / SPEC_MARGIN
    auto.t_verify[1] = 1 / (0.99 * value)
    assert auto.propose(request()).source == "draft"
    auto.t_verify[1] = 1 / (1.01 * value)
    assert auto.propose(request()).tokens.shape[1] == 0


def test_without_the_plain_option_slow_poor_drafts_are_still_made(clock):
    auto, _ = slow_auto(clock, allow_no_spec=False)  # the case above, K = 0 ruled out
    assert play(auto, clock, 10) == "D" * 10
    assert auto.no_spec_value() is None and 1 not in auto.t_verify


def test_good_drafts_beat_a_plain_step(clock):
    auto, model = slow_auto(clock, acceptance=0.95)  # K=4: 4.52 tokens in 0.13 s (35/s) against 20/s
    auto.t_verify[1] = 0.05
    assert play(auto, clock, 10, accept_all=True) == "D" * 10
    assert drafter_value(auto) > auto.no_spec_value() == pytest.approx(20.0)
    assert model.proposed == [4] * 10


def test_plain_rounds_retry_the_drafter_with_back_off_and_drafting_returns_when_it_pays(clock):
    auto, model = slow_auto(clock)
    # drafts keep failing: the drafter is tried again after 4, 8, 16 ... plain rounds, at most NO_SPEC_RETRY_MAX
    rounds = play(auto, clock, 4 + 1 + 8 + 1 + 16 + 1 + 32 + 1 + 64 + 1 + 64 + 1)
    gaps = [len(run) for run in rounds.split("D")[:-1]]
    assert gaps == [4, 8, 16, 32, 64, 64] and rounds.endswith("D")
    assert NO_SPEC_RETRY == 4 and NO_SPEC_RETRY_MAX == 64
    assert model.updates == [0] * 6 and auto.t_verify[1] == pytest.approx(0.05)
    # the text turns predictable: each retry is fully accepted; acceptance at position 1 climbs (EMA 0.8) from
    # 0.03 to 0.22, 0.38, 0.50, 0.60: the fourth retry makes K=1 worth 1.6 / 0.07 = 22.9/s, over SPEC_MARGIN x
    # 20/s, and drafting stays
    rounds = play(auto, clock, 4 * (64 + 1) + 20, accept_all=True)
    assert rounds == ("P" * 64 + "D") * 3 + "P" * 64 + "D" * 21
    assert auto.plain_rounds == 0 and auto.retry_after == NO_SPEC_RETRY  # a drafter won: the back-off starts over
    assert drafter_value(auto) > auto.no_spec_value()


def test_a_drafter_is_tried_before_it_is_switched_off(clock):
    model = TimedModel(clock, 0.05)
    auto = AutoDrafter({"draft": model}, 1, 4)
    assert auto.propose(request()).source == "draft"  # nothing measured: it drafts, as without the option
    auto = AutoDrafter({"draft": model}, 1, 4)
    auto.t_verify[1] = 0.001  # a plain step looks far better, but the draft model has no record of its own
    assert auto.propose(request()).source == "draft"


def test_no_retry_that_would_first_read_a_long_stretch(clock):
    auto, model = slow_auto(clock)
    model.behind = 300  # the draft model skipped the prompt: a retry would prefill 300 tokens (0.6 s, 12 steps)
    auto.t_catch_up["draft", True] = 0.002
    assert play(auto, clock, 40) == "P" * 40 and model.proposed == []
    model.behind = 20  # 40 ms of catch-up (under RETRY_MAX_CATCH_UP target steps): the overdue retry comes at once
    assert play(auto, clock, 5) == "D" + "P" * 4
