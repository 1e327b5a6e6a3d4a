"""``auto``'s choice against scripted drafters: per-match-length estimates for n-gram lookup, the draft
model's catch-up cost spread over the rounds left, what auto learns (acceptance) and reads (the costs in the
request's store, which the engine fills: emulated here, the engine's own bookkeeping is tested in
test_engine_speculation.py), and no speculation (a plain target step) against drafting."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from verispec.config import SamplingParams
from verispec.drafters.auto import IDLE_ROUNDS, REALIZED_DECAY, REALIZED_MARGIN, AutoDrafter, Realized
from verispec.spec.costs import Costs, expected_tokens
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


def request(context_len=100, new_left=200, K=4, params=SamplingParams(), costs=None):
    """costs: the engine's store (None: auto reads its own, as before its first request from an engine)."""
    ctx = list(range(context_len))
    return DraftRequest(ctx, K, params, None, context_len + new_left + K + 1, 1000, None, costs=costs)


def train(ctl, acceptance, t_draft, rounds=10):
    """A controller with a record of its own (``rounds`` judged) and its drafter's cost in the store it reads."""
    ctl.acceptance, ctl.t_draft, ctl.rounds = list(acceptance), t_draft, rounds


def delivered(auto, name, acceptance, t_draft, verify_s=0.05, rounds=10):
    """An expensive drafter's record of what its rounds delivered, as if it had drafted ``rounds`` rounds at the K its
    controller chooses, each giving the expected tokens of that acceptance."""
    K = auto.controller(name).choose(len(acceptance))
    auto.memory.realized[name] = done = Realized()
    for _ in range(rounds):
        done.observe(expected_tokens(acceptance[:K]), K * t_draft + verify_s)


def trained_auto(k_max=4):
    lookup, model = Lookup(), Model()
    auto = AutoDrafter({"ngram": lookup, "draft": model}, 1, k_max)
    auto.t_verify.update({T: 0.05 for T in range(1, k_max + 2)})  # one target step: 50 ms, flat verify
    for match, rate in ((1, 0.1), (4, 0.95)):
        train(auto.controller("ngram", match), [rate] * k_max, 0.0)
    train(auto.controller("draft"), [0.7] * k_max, 0.012)
    delivered(auto, "draft", [0.7] * k_max, 0.012)
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
    assert draft.source == "draft" and model.proposed == [auto.controller("draft").choose(4)]
    auto.update(2)
    assert model.updates == [2] and lookup.updates == [4]  # only the chosen drafter learns


def test_ngram_drafts_are_cut_to_the_length_their_match_supports():
    auto, lookup, _ = trained_auto(k_max=8)
    train(auto.controller("ngram", 3), [0.9, 0.05, 0.05, 0.05, 0.05, 0.05, 0.05, 0.05], 0.0)
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
    auto.costs.catch_up["draft", True] = 0.002  # 2 ms per token of a long catch-up (the engine measured it)
    model.behind = 400  # the draft model never ran: it would first prefill 400 tokens (0.8 s)
    # 8 tokens left: 0.8 s is not worth it; 2000 left: the prefill pays back over the rounds to come
    assert auto.propose(request(new_left=new_left)).source == chosen


def test_the_delegate_catch_up_is_handed_to_the_engine_and_auto_writes_no_cost():
    """The engine learns catch-up per token and keeps it out of the draft cost (test_engine_speculation.py): it
    reads it from auto.catch_up, the chosen delegate's of this round. auto itself writes nothing to the store."""
    auto, lookup, model = trained_auto()
    model.behind = 1

    def long_propose(request):
        model.catch_up = (300, 0.6)  # the first forward fed 300 tokens in 0.6 s
        return Draft(torch.full((1, request.num_tokens), 7, dtype=torch.long))

    model.propose = long_propose
    costs = auto.costs
    before = (dict(costs.forward), dict(costs.round), dict(costs.draft), dict(costs.catch_up))
    assert auto.propose(request(costs=costs)).source == "draft"
    assert auto.catch_up == (300, 0.6)
    auto.update(3)
    assert (costs.forward, costs.round, costs.draft, costs.catch_up) == before
    lookup.tokens, lookup.last_match = [1, 2, 3, 4], 4  # a round of the cheap drafter: no catch-up to report
    assert auto.propose(request(costs=costs)).source == "ngram" and auto.catch_up == (0, 0.0)


def test_auto_reads_the_store_of_the_request():
    """Until a request brings the engine's store auto reads its own; then the engine's, for every controller."""
    auto, lookup, model = trained_auto()
    assert auto.propose(request()).source == "draft"  # its own store: K=4, 2.77 tokens in 98 ms beat 20/s
    auto.update(2)
    engine = Costs()  # the engine measured a plain step at 1 ms: no drafter beats that
    engine.round.update({1: 0.001} | {T: 0.05 for T in range(2, 6)})
    engine.draft["draft"] = 0.012
    assert auto.propose(request(costs=engine)).tokens.shape[1] == 0
    assert auto.costs is engine and auto.t_verify is engine.round and auto.controller("draft").costs is engine
    assert auto.controller("draft").t_draft == 0.012 and auto.no_spec_value() == pytest.approx(1000.0)


def test_what_auto_learned_carries_over_to_the_next_request_with_the_same_sampling():
    memory, costs = {}, Costs()
    first = AutoDrafter({"draft": Model()}, 1, 4, memory=memory)
    first.propose(request(costs=costs))
    first.update(2)
    assert first.controller("draft").rounds == 1
    again = Costs()  # the next request may bring another engine's store (an LLM copy's): that one is read
    second = AutoDrafter({"draft": Model()}, 1, 4, memory=memory)
    second.propose(request(costs=again))  # its first round continues from the first request's estimates
    assert second.controllers is first.controllers and second.controller("draft").rounds == 1
    assert second.costs is again and second.controller("draft").costs is again
    sampled = AutoDrafter({"draft": Model()}, 1, 4, memory=memory)
    sampled.propose(request(params=SamplingParams(temperature=0.7), costs=costs))  # another sampling setting:
    assert sampled.controllers is not first.controllers  # its own record of acceptance
    assert sampled.controller("draft").rounds == 0 and sampled.t_verify is costs.round  # the costs are shared
    assert len(memory) == 2


def test_one_bad_first_round_lowers_a_drafter_it_does_not_switch_it_off():
    auto, model = slow_auto(acceptance=0.95)
    ctl = auto.controller("draft")
    ctl.acceptance = [None] * 4  # nothing judged yet: the prior, 0.6
    auto.t_verify[1] = 0.05
    assert play(auto, 1) == "D"  # all rejected
    assert ctl.rates() == pytest.approx([0.3] * 4)  # the mean of the prior (worth one verdict) and one rejection


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
    assert auto.controller("ngram", 3).rounds == 1  # a record of its own
    auto.costs.observe_round(4, 0.05)  # the engine timed the round (T = 3 drafts + 1)
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
    delivered(auto, "draft", [draft_acceptance] * 4, 0.012)
    lookup.tokens, lookup.last_match = [1, 2, 3, 4], 3  # no record for 3-token matches yet
    # valued at the prior acceptance (0.6 a position) for no draft time: worth a try beside a draft model
    # accepted 70% of the time, not beside one that is never wrong
    assert auto.propose(request()).source == chosen
    auto.update(0)
    if chosen == "ngram":  # it was wrong: now it has a record, falling from the prior with each miss (the mean of
        # the prior and the misses: 0.3, 0.2, 0.15), and after one or two misses the draft model wins
        assert auto.controller("ngram", 3).rounds == 1
        sources = []
        for _ in range(5):
            auto.t_verify.update({T: 0.05 for T in range(1, 6)})  # the verify cost stays flat at 50 ms
            sources.append(auto.propose(request()).source)
            auto.update(0)
        assert "draft" in sources[:2]


def test_a_short_match_without_a_record_is_not_tried_beside_a_draft_model():
    auto, lookup, model = trained_auto()
    lookup.tokens, lookup.last_match = [1, 2, 3, 4], 2  # shorter than TRY_MIN_MATCH, no record
    assert auto.propose(request()).source == "draft"
    auto.update(2)
    del auto.drafters["draft"]  # alone, the n-gram draft is still taken (better than a plain step)
    assert auto.propose(request()).source == "ngram"

class PricedModel(Model):
    """An expensive drafter whose drafts cost ``t_draft`` seconds a token (what the engine measures)."""

    def __init__(self, t_draft):
        super().__init__()
        self.t_draft = t_draft


def slow_auto(acceptance=0.1, t_draft=0.02, allow_no_spec=True):
    """auto with one draft model, measured: ``acceptance`` at every position, ``t_draft`` s per drafted token,
    verify 50 ms at every size but 1 (not measured yet)."""
    model = PricedModel(t_draft)
    model.behind = 0  # in step with the context: no catch-up to pay
    auto = AutoDrafter({"draft": model}, 1, 4, allow_no_spec=allow_no_spec)
    auto.t_verify.update({T: 0.05 for T in range(2, 6)})
    train(auto.controller("draft"), [acceptance] * 4, t_draft)
    delivered(auto, "draft", [acceptance] * 4, t_draft)
    return auto, model


def play(auto, rounds, accept_all=False, verify_s=0.05):
    """``rounds`` rounds whose verify takes ``verify_s`` seconds at any size; every draft accepted, or none. The
    store (auto's, handed over in each request as the engine hands over its own) gets what the engine measures:
    the drafter's seconds per drafted token under auto's name and the delegate's, the round besides drafting by
    its verify size (1: a plain step). -> one letter a round: D (drafted), P (plain step)."""
    out, costs = "", auto.costs
    for _ in range(rounds):
        draft = auto.propose(request(costs=costs))
        K = draft.tokens.shape[1]  # [1, K]
        if K:
            for name in ("auto", draft.source):
                costs.observe_draft(name, K, auto.drafters[draft.source].t_draft * K)
        costs.observe_round(K + 1, verify_s)
        auto.update(K if accept_all else 0)
        out += "D" if K else "P"
    return out


def drafter_value(auto):
    ctl = auto.controller("draft")
    return ctl.tokens_per_second(ctl.choose(4))


def test_slow_poor_drafts_lose_to_a_plain_step_valued_at_one_over_the_measured_verify():
    auto, model = slow_auto()  # K=1: 1.1 tokens in 0.07 s (15.7/s); a plain step: 1 in ~0.05 s (20/s)
    assert drafter_value(auto) == pytest.approx(1.1 / 0.07)
    draft = auto.propose(request(costs=auto.costs))
    assert draft.tokens.shape == (1, 0) and draft.source is None and model.proposed == []
    ctl = auto.controller("draft")
    rounds, rates = ctl.rounds, ctl.rates()
    auto.update(0)
    assert model.updates == [] and (ctl.rounds, ctl.rates()) == (rounds, rates)  # a switched-off drafter learns nothing
    auto.costs.observe_round(1, 0.04)  # the engine timed the plain step: 40 ms, t_verify(1)
    assert auto.no_spec_value() == pytest.approx(25.0)
    # the decision turns on 1 / t_verify(1): what the drafter's rounds delivered must beat a plain step's rate by
    # REALIZED_MARGIN
    assert auto.memory.realized["draft"].tokens_per_second() == pytest.approx(drafter_value(auto))
    value = drafter_value(auto) / REALIZED_MARGIN
    auto.t_verify[1] = 1 / (0.99 * value)
    assert auto.propose(request()).source == "draft"
    auto.t_verify[1] = 1 / (1.01 * value)
    assert auto.propose(request()).tokens.shape[1] == 0


def test_without_the_plain_option_slow_poor_drafts_are_still_made():
    auto, _ = slow_auto(allow_no_spec=False)  # the case above, K = 0 ruled out
    assert play(auto, 10) == "D" * 10
    assert auto.no_spec_value() is None and 1 not in auto.t_verify


def test_good_drafts_beat_a_plain_step():
    auto, model = slow_auto(acceptance=0.95)  # K=4: 4.52 tokens in 0.13 s (35/s) against 20/s
    auto.t_verify[1] = 0.05
    assert play(auto, 10, accept_all=True) == "D" * 10
    assert drafter_value(auto) > auto.no_spec_value() == pytest.approx(20.0)
    assert model.proposed == [4] * 10


def test_plain_rounds_retry_the_drafter_with_back_off_and_drafting_returns_when_it_pays():
    auto, model = slow_auto()
    # drafts keep failing: the drafter is tried again after 4, 8, 16, 32, 64 plain rounds (the back-off), then
    # every 64; a record gone stale (IDLE_ROUNDS rounds without a draft) does not cut the wait while plain steps win
    rounds = play(auto, 250)
    gaps = [len(run) for run in rounds.split("D")[:-1]]
    assert gaps == [4, 8, 16, 32, 64, 64] and IDLE_ROUNDS < 32, gaps
    assert NO_SPEC_RETRY == 4 and NO_SPEC_RETRY_MAX == 64
    assert set(model.updates) == {0} and auto.t_verify[1] == pytest.approx(0.05)
    # the text turns predictable: the next retry is fully accepted (2 tokens in 0.07 s, 28.6/s, against a plain
    # step's 20/s); what the drafter delivered before it has faded over the plain rounds, the retry weighs more
    # than all of it, and drafting stays
    rounds = play(auto, 100, accept_all=True)
    plain = len(rounds) - len(rounds.lstrip("P"))
    assert plain <= NO_SPEC_RETRY_MAX and rounds == "P" * plain + "D" * (100 - plain), rounds
    assert auto.plain_rounds == 0 and auto.retry_after == NO_SPEC_RETRY  # a drafter won: the back-off starts over
    assert drafter_value(auto) > auto.no_spec_value()


def test_a_drafter_is_tried_before_it_is_switched_off():
    model = PricedModel(0.05)
    auto = AutoDrafter({"draft": model}, 1, 4)
    assert auto.propose(request()).source == "draft"  # nothing measured: it drafts, as without the option
    auto = AutoDrafter({"draft": model}, 1, 4)
    auto.t_verify[1] = 0.001  # a plain step looks far better, but the draft model has no record of its own
    auto.costs.draft["draft"] = 0.05  # even where other requests measured its cost: no acceptance judged here
    assert auto.controller("draft").rounds == 0
    assert auto.propose(request(costs=auto.costs)).source == "draft"


def test_no_retry_that_would_first_read_a_long_stretch():
    auto, model = slow_auto()
    model.behind = 300  # the draft model skipped the prompt: a retry would prefill 300 tokens (0.6 s, 12 steps)
    auto.costs.catch_up["draft", True] = 0.002
    assert play(auto, 40) == "P" * 40 and model.proposed == []
    model.behind = 20  # 40 ms of catch-up (under RETRY_MAX_CATCH_UP target steps): the overdue retry comes at once
    assert play(auto, 5) == "D" + "P" * 4


def two_models(head_accepts: float, draft_accepts: float):
    """auto over a cheap head (5 ms a drafted token) and a draft model (15 ms), verify 50 ms at every size, neither
    with a record; -> (auto, play) where play(rounds) runs rounds in which each drafted position is accepted with
    its drafter's fixed chance (the first ``int(chance * K)`` of K drafts) and returns the sources, one a round."""
    head, model = PricedModel(0.005), PricedModel(0.015)
    head.behind = model.behind = 0
    auto = AutoDrafter({"head": head, "draft": model}, 1, 4)
    auto.t_verify.update({T: 0.05 for T in range(1, 6)})
    chance = {"head": head_accepts, "draft": draft_accepts}

    def run(rounds):
        sources = []
        for _ in range(rounds):
            draft = auto.propose(request(costs=auto.costs))
            K = draft.tokens.shape[1]  # [1, K]
            if K:
                auto.costs.observe_draft(draft.source, K, auto.drafters[draft.source].t_draft * K)
            auto.costs.observe_round(K + 1, 0.05)
            auto.update(int(chance[draft.source] * K) if K else 0)
            sources.append(draft.source if K else "plain")
        return sources

    run.chance = chance  # to change between rounds
    return auto, run


def test_every_expensive_drafter_drafts_before_their_estimates_are_compared():
    # valued at the same prior, the cheap head promises more than the draft model: it goes first, yet the draft
    # model gets its EXPLORE_ROUNDS too, and then wins: it is right every time, the head never
    auto, run = two_models(head_accepts=0.0, draft_accepts=1.0)
    sources = run(12)
    assert sources[:4] == ["head", "head", "draft", "draft"] and set(sources[4:]) == {"draft"}


def test_what_a_drafters_rounds_delivered_is_what_auto_compares():
    auto, run = two_models(head_accepts=0.5, draft_accepts=1.0)
    assert run(4) == ["head", "head", "draft", "draft"]
    # the head drafted 4 then 2 (its record after half of 4 accepted), and gave 3 then 2 tokens; the draft model
    # drafted 4 then 3, all accepted: the sums of tokens and seconds (draft + round), the older round discounted
    head, draft, d = auto.memory.realized["head"], auto.memory.realized["draft"], REALIZED_DECAY
    assert draft.rounds == pytest.approx(1 + d) and head.rounds == pytest.approx((1 + d) * d**2)
    assert head.tokens_per_second() == pytest.approx((d * 3 + 2) / (d * (4 * 0.005 + 0.05) + 2 * 0.005 + 0.05))
    assert draft.tokens_per_second() == pytest.approx((d * 5 + 4) / (d * (4 * 0.015 + 0.05) + 3 * 0.015 + 0.05))
    assert set(run(6)) == {"draft"}


def test_a_drafter_that_delivers_a_little_more_than_a_plain_step_keeps_drafting():
    # one draft a round, accepted every other round: 1.5 tokens in 20 ms of drafting and 50 ms of round, 21.4
    # tokens/s against a plain step's 20: over REALIZED_MARGIN (1.03), under SPEC_MARGIN (1.1), which the model of
    # its acceptance must promise before the drafter has delivered (once its record is long enough that one miss
    # does not sink it: at first it alternates with plain steps)
    model = PricedModel(0.02)
    model.behind = 0
    auto = AutoDrafter({"draft": model}, 1, 1)
    auto.t_verify.update({T: 0.05 for T in range(1, 3)})
    out = []
    for _ in range(60):
        draft = auto.propose(request(costs=auto.costs))
        K = draft.tokens.shape[1]  # [1, K]
        if K:
            auto.costs.observe_draft("draft", K, 0.02 * K)
        auto.costs.observe_round(K + 1, 0.05)
        auto.update(out.count("D") % 2 if K else 0)
        out.append("D" if K else "P")
    assert REALIZED_MARGIN < 1.07 < SPEC_MARGIN
    assert "P" not in out[-30:], "".join(out)


def test_a_drafter_written_off_earlier_is_tried_again_when_its_record_grows_old():
    # first the head is always right and the draft model never: the head drafts; then the text changes and only
    # the draft model is right. The draft model, sitting out, drafts again IDLE_ROUNDS rounds after it last did,
    # is right, and drafts from then on once the head's record has sunk
    auto, run = two_models(head_accepts=1.0, draft_accepts=0.0)
    first = run(30)
    # (the draft model drafts once more IDLE_ROUNDS rounds after it last did: it is still wrong)
    assert first[:4] == ["head", "head", "draft", "draft"] and first[4:].count("draft") <= 1, first
    run.chance.update(head=0.0, draft=1.0)
    then = run(60)  # the head's long good record takes its failures some rounds to sink (REALIZED_DECAY)
    # from then on the draft model drafts, the head once every IDLE_ROUNDS rounds
    assert "draft" in then[:IDLE_ROUNDS] and then[30:].count("head") <= 60 // IDLE_ROUNDS, then



class Reader(Lookup):
    """A cheap drafter that reads the target's features at ``feature_layers`` and keeps the last it was handed."""

    def __init__(self, layers):
        super().__init__()
        self.feature_layers, self.tokens, self.last_match = tuple(layers), [5], 4

    def propose(self, request):
        self.seen = request.features
        return super().propose(request)


@pytest.mark.parametrize("second", [(28,), (25, 2), (14, 25)])
def test_each_delegate_is_handed_the_features_of_its_own_layers(second):
    """The engine keeps every layer any delegate reads, once (order first asked for); each delegate gets exactly
    its own layers' columns, in its order (a Medusa head on the last stream beside an EAGLE-3 head on three)."""
    first, H = Reader((2, 14, 25)), 3
    auto = AutoDrafter({"a": first, "b": Reader(second)}, 1, 4)
    assert auto.feature_layers == (2, 14, 25) + tuple(i for i in second if i not in (2, 14, 25))
    stream = {layer: torch.randn(10, H) for layer in auto.feature_layers}  # [n, H] a layer
    auto.propose(replace(request(), features=torch.cat([stream[i] for i in auto.feature_layers], -1)))
    for d in auto.drafters.values():
        assert torch.equal(d.seen, torch.cat([stream[i] for i in d.feature_layers], -1)), d.feature_layers


def test_stale_records_wait_for_the_back_off_while_plain_steps_win():
    # neither drafter is ever right: plain steps win. Each drafter's record goes stale IDLE_ROUNDS rounds after it
    # last drafted, and its revisit is the plain rounds' retry, not one more every IDLE_ROUNDS per drafter (where
    # verify costs are steep, as on AVX2, those revisits cost more than the back-off saved)
    auto, run = two_models(head_accepts=0.0, draft_accepts=0.0)
    sources = run(330)
    assert sources[:4] == ["head", "head", "draft", "draft"], sources[:8]
    drafted = [i for i, s in enumerate(sources) if s != "plain"]
    gaps = [b - a - 1 for a, b in zip(drafted, drafted[1:])][3:]  # after the exploration
    assert gaps[:5] == [4, 8, 16, 32, 64] and len(drafted) <= 12, (gaps, drafted)
    assert {s for s in sources[4:] if s != "plain"} == {"head", "draft"}  # both are revisited, in turn
