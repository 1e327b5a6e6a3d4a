"""Autoregressive sampling draws from exactly the distribution it claims (house rule: every sampling
path has a chi-square test against exact probabilities, and a negative control that must fail).

A tiny model with a 16-token vocabulary makes the joint distribution of the first two generated
tokens enumerable (16 x 16 cells): P(a, b) = p(a | prompt) * p(b | prompt + a), with the logits
computed by transformers' own model (not our runtime) and turned into probabilities by
``logits_to_probs`` (checked against independent implementations in tests/unit/test_sampling.py).
Samples come from the public API, ``LLM.generate(..., SamplingParams(max_new_tokens=2, seed=i))``,
so the whole path (prefill, KV cache, decode step, generator handling, stopping) is exercised.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import verispec.sampling
from exact_helpers import chi2_pvalue, naive_probs
from tiny import make_hf_dir
from verispec import LLM, SamplingParams

V = 16
N = 10_000  # draws per positive case: twice the negative controls' (which fail with 5,000)
N_NEG = 5_000  # draws per negative control: fewer draws make rejection harder, so this is conservative
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
ALPHA = 1e-3
TINY = dict(vocab_size=V, eos_token_id=None, num_hidden_layers=1, hidden_size=32, intermediate_size=64,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)

CASES = {  # name: SamplingParams fields
    "T1": dict(temperature=1.0),
    "T0.7-top_k5": dict(temperature=0.7, top_k=5),
    "top_p0.8": dict(temperature=1.0, top_p=0.8),
}

_true_logits_to_probs = verispec.sampling.logits_to_probs


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_hf_dir(tmp_path_factory.mktemp("v16") / "m", "qwen2", seed=1, tokenizer=False, **TINY)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(target=str(model_dir), dtype="float32")


@pytest.fixture(scope="module")
def ref_logits(model_dir):
    """transformers' logits: first step [V], and second step for every first token [V, V]."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        first = hf(torch.tensor([PROMPT])).logits[0, -1].double()
        ids = torch.tensor([PROMPT + [a] for a in range(V)])
        second = hf(ids).logits[:, -1].double()
    return first, second


def exact_joint(ref_logits, params: SamplingParams) -> np.ndarray:
    first, second = ref_logits
    p1 = _true_logits_to_probs(first, params).double()  # [V]
    p2 = _true_logits_to_probs(second, params).double()  # [V, V]
    joint = (p1[:, None] * p2).numpy()
    return joint / joint.sum()


def draw(llm, params: SamplingParams, n: int = N) -> np.ndarray:
    counts = np.zeros((V, V), dtype=np.int64)
    for i in range(n):
        out = llm.generate(PROMPT, dataclasses.replace(params, max_new_tokens=2, seed=i))
        a, b = out.token_ids
        counts[a, b] += 1
    return counts


def test_reference_logits_match_our_runtime(llm, ref_logits):
    """Sanity: the distribution we test against is the model's (our forward agrees with transformers)."""
    from verispec.models.kv_cache import KVCache

    cfg = llm.target.config
    cache = KVCache.for_model(cfg, 1, len(PROMPT) + 1, torch.float32)
    logits, _ = llm.target.model(torch.tensor([PROMPT]), torch.arange(len(PROMPT))[None], cache, num_logits=1)
    torch.testing.assert_close(logits[0, -1].double(), ref_logits[0], rtol=1e-4, atol=1e-4)


def test_cases_are_nontrivial(ref_logits):
    """The filters must actually cut something, with no kept-set boundary within float noise."""
    full = (exact_joint(ref_logits, SamplingParams(temperature=1.0)) > 0).sum()
    assert full == V * V
    for name in ("T0.7-top_k5", "top_p0.8"):
        params = SamplingParams(**CASES[name])
        support = (exact_joint(ref_logits, params) > 0).sum()
        assert support < full / 2, name
    # top-p: no row has a cumulative mass within 1e-4 of 0.8, so float32 rounding cannot flip the kept set
    first, second = ref_logits
    rows = torch.cat([first[None], second]).softmax(-1).sort(-1, descending=True).values.cumsum(-1)
    assert (rows - 0.8).abs().min() > 1e-4


@pytest.mark.parametrize("name", list(CASES))
def test_exact_distribution_is_independently_right(ref_logits, name):
    """The expected cells come from logits_to_probs: check them against a naive float64 computation, so a
    bug in that shared transform cannot make sampler and expectation wrong together."""
    kw = CASES[name]
    first, second = (t.numpy() for t in ref_logits)
    p1 = naive_probs(first, kw["temperature"], kw.get("top_k", 0), kw.get("top_p", 1.0))
    p2 = np.stack([naive_probs(r, kw["temperature"], kw.get("top_k", 0), kw.get("top_p", 1.0)) for r in second])
    want = p1[:, None] * p2
    got = exact_joint(ref_logits, SamplingParams(**kw))
    assert np.array_equal(got > 0, want > 0)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-9)


@pytest.mark.parametrize("name", list(CASES))
def test_ar_sampling_matches_exact_distribution(llm, ref_logits, name):
    params = SamplingParams(**CASES[name])
    joint = exact_joint(ref_logits, params)
    counts = draw(llm, params)
    assert counts.sum() == N
    p = chi2_pvalue(counts, joint)
    assert p > ALPHA, f"{name}: chi-square p = {p:.3g}"


def _temperature_twice(logits, params):
    if params.temperature == 0:
        return _true_logits_to_probs(logits, params)
    return _true_logits_to_probs(logits / params.temperature, params)


def _top_p_drops_boundary_token(logits, params):
    probs = _true_logits_to_probs(logits, dataclasses.replace(params, top_p=1.0))
    if params.top_p >= 1.0:
        return probs
    sorted_p, idx = probs.sort(dim=-1, descending=True, stable=True)
    drop = sorted_p.cumsum(-1) > params.top_p  # off by one: the token that crosses top_p goes too
    drop[..., 0] = False
    probs = probs.masked_fill(torch.zeros_like(drop).scatter(-1, idx, drop), 0.0)
    return probs / probs.sum(-1, keepdim=True)


@pytest.mark.parametrize("name,wrong", [
    ("T0.7-top_k5", _temperature_twice),
    ("top_p0.8", _top_p_drops_boundary_token),
])
def test_negative_control_wrong_sampler_fails(llm, ref_logits, monkeypatch, name, wrong):
    """The same test, run on a deliberately wrong sampler inside the real decoding path, must reject it."""
    params = SamplingParams(**CASES[name])
    joint = exact_joint(ref_logits, params)
    monkeypatch.setattr(verispec.sampling.processors, "logits_to_probs", wrong)  # what every chain calls
    counts = draw(llm, params, N_NEG)
    p = chi2_pvalue(counts, joint)
    assert p < ALPHA, f"negative control {name}/{wrong.__name__} not detected: p = {p:.3g}"


def test_chi2_helper_accepts_exact_multinomial_draws(ref_logits):
    """The statistic itself: draws made directly from the exact joint with numpy pass."""
    joint = exact_joint(ref_logits, SamplingParams(**CASES["T0.7-top_k5"]))
    rng = np.random.default_rng(0)
    counts = rng.multinomial(N, joint.ravel()).reshape(V, V)
    assert chi2_pvalue(counts, joint) > ALPHA
