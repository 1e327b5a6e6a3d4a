"""Early stops (the draft model ending a round before K) never change greedy output.

Any rule that looks only at the draft's side keeps speculative decoding exact; what varies is how many
tokens a round proposes, so the draft cache's rollback and the target cache's truncation must hold for
every length. The cost-model rule (``DraftModelDrafter.stop_now``) decides from timings, which a test
cannot script, so most tests here replace it with ``varied_stop(3)`` (exact_helpers.py): a deterministic
draft-side rule that ends rounds at every possible length. The rule itself is tested against the cost model in
tests/unit/test_adaptive.py, and the chi-square test with early stops is in test_speculative_distribution.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from exact_helpers import varied_stop
from tiny import make_hf_dir
from verispec import LLM, SamplingParams
from verispec.spec.costs import Costs
from verispec.spec.policy import Calibration
from verispec.drafters.base import DraftRequest
from verispec.drafters.draft_model import DraftModelDrafter

KS = [2, 4, 8]
PROMPTS = ["Hello, world", "def f(x):\n    return", "1, 2, 3, 4,"]
N = 24


@pytest.fixture(scope="module")
def llms(tiny_dirs, tmp_path_factory):
    """{(arch, draft): LLM} with drafts "same" (the target), "near" (target + noise), "near-int8"."""
    out = {}
    for arch in ("qwen2", "llama"):
        target = str(tiny_dirs[arch])
        path = make_hf_dir(tmp_path_factory.mktemp("early") / f"near_{arch}", arch, 0, noise=0.01)
        out[arch, "same"] = LLM(target=target, draft=target, dtype="float32", draft_quant="none")
        out[arch, "near"] = LLM(target=target, draft=str(path), dtype="float32", draft_quant="none")
        out[arch, "near-int8"] = LLM(target=target, draft=str(path), dtype="float32")
    return out


def spec(llm, prompt, K, **kw):
    return llm.generate(prompt, SamplingParams(**kw), method="draft", num_draft_tokens=K)


@pytest.mark.parametrize("draft", ["same", "near", "near-int8"])
@pytest.mark.parametrize("K", KS)
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_greedy_identity_with_varied_stops(llms, monkeypatch, arch, K, draft):
    stop = varied_stop(3)
    monkeypatch.setattr(DraftModelDrafter, "stop_now", stop)
    llm = llms[arch, draft]
    rounds = drafted = 0
    for prompt in PROMPTS:
        want = llm.generate(prompt, SamplingParams(max_new_tokens=N, ignore_eos=True))
        out = spec(llm, prompt, K, max_new_tokens=N, ignore_eos=True)
        assert out.token_ids == want.token_ids, f"{arch} K={K} {draft} {prompt!r}"
        s = out.stats
        assert s["new_tokens"] == N == s["accepted_tokens"] + s["target_forwards"]
        rounds += s["per_position_reached"][0]
        drafted += s["drafted_tokens"]
        if draft == "same":
            assert s["acceptance_rate"] == 1.0
    if K > 2:  # rounds ended early, and not all after their first draft
        assert rounds < drafted < K * rounds, (rounds, drafted)
    assert True in stop.decisions and False in stop.decisions  # rounds ended early, and others went on


@pytest.mark.parametrize("draft", ["same", "near"])
def test_max_new_tokens_and_eos_inside_a_shortened_round(llms, monkeypatch, draft):
    stop = varied_stop(3)
    monkeypatch.setattr(DraftModelDrafter, "stop_now", stop)
    llm = llms["qwen2", draft]
    full = llm.generate(PROMPTS[1], SamplingParams(max_new_tokens=15, ignore_eos=True)).token_ids
    for n in range(1, 16):
        out = spec(llm, PROMPTS[1], 4, max_new_tokens=n, ignore_eos=True)
        assert out.token_ids == full[:n] and out.finish_reason == "length", f"max_new_tokens={n}"
    for i in range(40):  # a prompt whose continuation ends in EOS
        prompt = f"Prompt number {i}: "
        want = llm.generate(prompt, SamplingParams(max_new_tokens=32))
        if want.finish_reason == "eos" and len(want.token_ids) >= 4:
            out = spec(llm, prompt, 4, max_new_tokens=32)
            assert out.token_ids == want.token_ids and out.finish_reason == "eos"
            return
    pytest.fail("no prompt found whose greedy continuation ends in EOS")


@pytest.mark.parametrize("draft", ["same", "near"])
def test_auto_greedy_identity_with_varied_stops(llms, monkeypatch, draft):
    """auto hands the draft model the largest K as its cap; the draft model's rounds then end anywhere."""
    stop = varied_stop(3)
    monkeypatch.setattr(DraftModelDrafter, "stop_now", stop)
    llm = llms["qwen2", draft]
    drafted = rounds = 0
    for prompt in PROMPTS:
        want = llm.generate(prompt, SamplingParams(max_new_tokens=N, ignore_eos=True))
        out = llm.generate(prompt, SamplingParams(max_new_tokens=N, ignore_eos=True), method="auto", num_draft_tokens=8)
        assert out.token_ids == want.token_ids, f"auto {draft} {prompt!r}"
        tokens = out.stats["drafter_tokens"].get("draft", {"drafted": 0})
        drafted += tokens["drafted"]
        rounds += out.stats["drafter_rounds"].get("draft", 0)
    assert rounds < drafted < 8 * rounds, (rounds, drafted)
    assert True in stop.decisions and False in stop.decisions  # rounds ended early, and others went on


@pytest.mark.parametrize("K", [4, 8])
def test_greedy_identity_with_the_cost_model_rule(llms, K):
    """The real rule, whatever it decides from this machine's timings."""
    for draft in ("same", "near"):
        llm = llms["qwen2", draft]
        for prompt in PROMPTS:
            want = llm.generate(prompt, SamplingParams(max_new_tokens=N, ignore_eos=True))
            out = spec(llm, prompt, K, max_new_tokens=N, ignore_eos=True)
            assert out.token_ids == want.token_ids, f"K={K} {draft} {prompt!r}"
            assert out.stats["drafted_tokens"] <= K * out.stats["per_position_reached"][0]


def test_the_cost_model_rule_waits_for_measurements(llms):
    """No verify time or draft step measured yet: the round drafts K. Then the rule weighs the calibrated chances."""
    d = DraftModelDrafter(llms["qwen2", "same"].draft.model)
    d.calibration = Calibration()  # uncorrected yet: chance = confidence (bin centres)
    request = SimpleNamespace(costs=Costs(), params=SamplingParams())
    assert not d.stop_now([0.01], None, request)
    assert not d.stop_now([0.01], 1.0, request)  # a draft step measured, no round yet
    assert not d.stop_now([0.01], 1.0, SimpleNamespace(costs=None, params=SamplingParams()))  # no store at all
    request.costs.observe_round(2, 0.01)
    assert d.stop_now([0.01], 1.0, request)  # a hesitant draft whose steps cost 100 verify passes: stop
    assert not d.stop_now([0.999], 1e-6, request)
    # a seeded sample is never stopped by timings (its seed must give one text); unseeded or greedy may be
    for params, stops in ((SamplingParams(temperature=0.8, seed=3), False), (SamplingParams(temperature=0.8), True),
                          (SamplingParams(seed=3), True)):
        assert d.stop_now([0.01], 1.0, SimpleNamespace(costs=request.costs, params=params)) is stops, params


def test_the_draft_model_weighs_its_own_cost_in_the_store(llms, monkeypatch):
    """stop_now is handed the store's seconds per draft step of the draft model ("draft"), not another drafter's;
    with no store, None."""
    stop = varied_stop(3)
    monkeypatch.setattr(DraftModelDrafter, "stop_now", stop)
    llm = llms["qwen2", "same"]
    costs = Costs()
    costs.draft.update({"draft": 0.125, "auto": 9.0, "ngram": 7.0})
    ctx = list(b"Hello, world")
    for store, want in ((costs, 0.125), (None, None)):
        d = DraftModelDrafter(llm.draft.model)
        stop.t_drafts.clear()
        d.propose(DraftRequest(ctx, 4, SamplingParams(), None, len(ctx) + 8, llm.target.config.vocab_size,
                               llm.logit_mask, costs=store))
        assert stop.t_drafts and set(stop.t_drafts) == {want}


def test_calibration_learns_from_verdicts_and_persists_across_requests(llms):
    """The LLM keeps one calibration per sampling setting; the drafter feeds it each round's verdicts."""
    llm = llms["qwen2", "same"]
    llm.draft_calibrations.clear()
    spec(llm, PROMPTS[0], 4, max_new_tokens=N, ignore_eos=True)
    (key, cal), = llm.draft_calibrations.items()
    assert key == (0.0, 0, 1.0)
    prior = Calibration()
    assert sum(cal.judged) > sum(prior.judged)  # verdicts were recorded
    # the draft is the target: everything it drafted was accepted, so its confidence bins only rose
    assert all(cal(b / 10 + 0.05) >= prior(b / 10 + 0.05) for b in range(10))
    judged = sum(cal.judged)
    spec(llm, PROMPTS[1], 4, max_new_tokens=N, ignore_eos=True)
    assert sum(llm.draft_calibrations[key].judged) > judged  # the next request kept learning in the same one


def test_confidence_is_the_top_probability_with_and_without_restricted_rows():
    """The early-stop confidence of a greedy draft is softmax(logits).max(): the CPU path (NumPy) agrees with
    torch's softmax, also when most rows are -inf (a restricted head), and a sampling draft reports q's max."""
    import torch

    from verispec.drafters.draft_model import confidence

    g = torch.Generator().manual_seed(0)
    for masked in (0, 100_000):
        logits = torch.randn(1, 151_936, generator=g) * 4
        logits[0, torch.randperm(151_936, generator=g)[:masked]] = float("-inf")
        want = torch.softmax(logits.double(), -1).max().item()
        assert confidence(logits, None) == pytest.approx(want, rel=1e-5)
    probs = torch.softmax(logits, -1)
    assert confidence(logits, probs) == probs.max().item()
