"""SamplingParams validation and logits_to_probs against independent implementations.

The references here are deliberately naive (numpy float64, python loops over sorted tokens) and a
second, external one (transformers' own logits warpers), so a bug in our vectorized transform
cannot hide behind itself.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from exact_helpers import ALPHA, chi2_pvalue
from verispec import ConfigError, SamplingParams
from verispec.sampling import argmax, logits_to_probs, mask_logits, next_token, sample, transforms

# ---------------------------------------------------------------------------------------------
# SamplingParams validation
# ---------------------------------------------------------------------------------------------

BAD_PARAMS = [
    dict(temperature=-1.0),
    dict(temperature=-1e-9),
    dict(temperature=float("nan")),
    dict(temperature=float("inf")),
    dict(temperature="1.0"),
    dict(temperature=None),
    dict(temperature=True),
    dict(top_p=0.0),
    dict(top_p=-0.1),
    dict(top_p=1.5),
    dict(top_p=1.0000001),
    dict(top_p=float("nan")),
    dict(top_p="0.9"),
    dict(top_p=True),
    dict(top_k=-1),
    dict(top_k=1.5),
    dict(top_k=2.0),
    dict(top_k="3"),
    dict(top_k=True),
    dict(max_new_tokens=0),
    dict(max_new_tokens=-5),
    dict(max_new_tokens=2.0),
    dict(max_new_tokens="8"),
    dict(max_new_tokens=True),
    dict(max_new_tokens=None),
    dict(seed=1.5),
    dict(seed="0"),
    dict(stop=[""]),
    dict(stop=[1]),
    dict(stop=["ok", ""]),
]


@pytest.mark.parametrize("kw", BAD_PARAMS, ids=lambda kw: f"{next(iter(kw))}={next(iter(kw.values()))!r}")
def test_bad_params_raise_config_error(kw):
    with pytest.raises(ConfigError) as ei:
        SamplingParams(**kw)
    assert isinstance(ei.value, ValueError)  # API users can catch a plain ValueError
    field = next(iter(kw))
    msg = str(ei.value)
    assert "\n" not in msg
    assert (field if field != "stop" else "stop") in msg


@pytest.mark.parametrize("kw", [
    dict(),
    dict(temperature=0),
    dict(temperature=0.7, top_k=5, top_p=0.9),
    dict(temperature=2, top_p=1),  # ints are fine for float fields
    dict(top_p=1e-6),
    dict(top_k=0),
    dict(max_new_tokens=1),
    dict(seed=0),
    dict(seed=-3),
    dict(stop="x"),
    dict(stop=("a", "bc")),
    dict(stop=None),
])
def test_good_params_accepted(kw):
    p = SamplingParams(**kw)
    assert isinstance(p.stop, tuple)
    if kw.get("stop") == "x":
        assert p.stop == ("x",)  # a single string is one stop string, not its characters
    if kw.get("stop") is None:
        assert p.stop == ()


def test_greedy_flag():
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=1e-3).greedy


def test_params_frozen():
    p = SamplingParams()
    with pytest.raises(Exception):
        p.temperature = 1.0  # type: ignore[misc]


# ---------------------------------------------------------------------------------------------
# logits_to_probs: independent reference
# ---------------------------------------------------------------------------------------------


def ref_probs(logits, temperature: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """Straightforward float64 implementation, one row at a time.

    temperature, then top-k (every token at least as likely as the k-th survives, so ties at the
    k-th place all survive), then softmax, then top-p: walk tokens from most to least likely and
    keep each one while the mass kept *before* it is still below top_p (so the token that crosses
    top_p is kept). Ties in the walk go to the lower token id.
    """
    row = [float(x) for x in logits]
    V = len(row)
    if temperature == 0:
        best = max(range(V), key=lambda i: (row[i], -i))  # first index of the maximum
        out = np.zeros(V)
        out[best] = 1.0
        return out
    z = [x / temperature for x in row]
    if 0 < top_k < V:
        kth = sorted(z, reverse=True)[top_k - 1]
        z = [x if x >= kth else -math.inf for x in z]
    m = max(z)
    e = [math.exp(x - m) if x != -math.inf else 0.0 for x in z]
    s = sum(e)
    p = [x / s for x in e]
    if top_p < 1.0:
        order = sorted(range(V), key=lambda i: (-p[i], i))
        kept, mass = set(), 0.0
        for i in order:
            if mass >= top_p:
                break
            kept.add(i)
            mass += p[i]
        p = [p[i] if i in kept else 0.0 for i in range(V)]
        s = sum(p)
        p = [x / s for x in p]
    return np.array(p)


def _ours(logits, **kw) -> np.ndarray:
    t = torch.as_tensor(np.asarray(logits), dtype=torch.float32)
    return logits_to_probs(t, SamplingParams(**kw)).double().numpy()


def _top_p_margin(logits, temperature, top_k, top_p) -> float:
    """Distance of top_p from every cumulative-mass boundary (float32 vs float64 must agree)."""
    p = ref_probs(logits, temperature, top_k, 1.0)
    cum = np.cumsum(np.sort(p)[::-1])
    return float(np.min(np.abs(cum - top_p)))


def _random_rows(n, V, seed, scale=3.0):
    g = np.random.default_rng(seed)
    return [g.normal(0, scale, V) for _ in range(n)]


@pytest.mark.parametrize("temperature", [0.05, 0.3, 0.7, 1.0, 1.7, 5.0])
def test_temperature_matches_reference(temperature):
    for row in _random_rows(10, 50, seed=1):
        np.testing.assert_allclose(_ours(row, temperature=temperature), ref_probs(row, temperature),
                                   rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("top_k", [1, 2, 5, 49, 50, 51, 1000])
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_top_k_matches_reference(top_k, temperature):
    for row in _random_rows(8, 50, seed=2):
        got = _ours(row, temperature=temperature, top_k=top_k)
        want = ref_probs(row, temperature, top_k)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
        assert int((got > 0).sum()) == min(top_k, 50)


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.5, 0.8, 0.9, 0.95, 0.99])
@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 0), (1.3, 10), (0.7, 3)])
def test_top_p_matches_reference(top_p, temperature, top_k):
    checked = 0
    for row in _random_rows(20, 40, seed=3, scale=2.0):
        if _top_p_margin(row, temperature, top_k, top_p) < 1e-5:
            continue  # too close to a boundary for float32 vs float64 to agree on the kept set
        got = _ours(row, temperature=temperature, top_k=top_k, top_p=top_p)
        want = ref_probs(row, temperature, top_k, top_p)
        assert np.array_equal(got > 0, want > 0), "different kept sets"
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
        checked += 1
    assert checked >= 15


def test_top_p_keeps_the_boundary_token():
    logits = np.log([0.5, 0.3, 0.2])
    # 0.5 < 0.79, so the token with 0.3 (which crosses 0.79) is kept; the mass before 0.2 is 0.8 >= 0.79.
    np.testing.assert_allclose(_ours(logits, temperature=1.0, top_p=0.79), [0.5 / 0.8, 0.3 / 0.8, 0.0], rtol=1e-6)
    np.testing.assert_allclose(_ours(logits, temperature=1.0, top_p=0.81), [0.5, 0.3, 0.2], rtol=1e-6)
    # the most likely token alone already reaches top_p: only it survives, however small top_p is
    np.testing.assert_allclose(_ours(logits, temperature=1.0, top_p=0.49), [1.0, 0.0, 0.0], rtol=1e-6)
    np.testing.assert_allclose(_ours(logits, temperature=1.0, top_p=1e-6), [1.0, 0.0, 0.0], rtol=1e-6)
    # order in the vocabulary does not matter
    perm = [2, 0, 1]
    np.testing.assert_allclose(_ours(logits[perm], temperature=1.0, top_p=0.79),
                               np.array([0.5 / 0.8, 0.3 / 0.8, 0.0])[perm], rtol=1e-6)


def test_top_k_ties_at_kth_place_all_survive():
    logits = [3.0, 2.0, 2.0, 2.0, 1.0, 2.0]
    got = _ours(logits, temperature=1.0, top_k=2)
    want = ref_probs(logits, 1.0, 2)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert (got > 0).tolist() == [True, True, True, True, False, True]


def test_top_p_ties_go_to_the_lower_token_id():
    # token 0 has 0.4, four tied tokens have 0.15 each; top_p 0.6: 0.4 then one tied token (0.55) then a
    # second one (0.70 crosses 0.6); the kept tied tokens are the lowest ids, deterministically.
    V = 200
    tied = [17, 60, 120, 199]
    probs = np.full(V, 1e-30)
    probs[0] = 0.4
    probs[tied] = 0.15
    logits = np.log(probs)
    got = _ours(logits, temperature=1.0, top_p=0.6)
    assert np.flatnonzero(got).tolist() == [0, 17, 60]
    np.testing.assert_allclose(got[[0, 17, 60]], [0.4 / 0.7, 0.15 / 0.7, 0.15 / 0.7], rtol=1e-5)
    np.testing.assert_allclose(got, ref_probs(logits, 1.0, 0, 0.6), rtol=1e-5, atol=1e-12)
    # the same in a batch, on every row, and whatever the row's position
    batch = torch.as_tensor(np.stack([logits] * 5), dtype=torch.float32)
    rows = logits_to_probs(batch, SamplingParams(temperature=1.0, top_p=0.6)).double().numpy()
    for r in rows:
        assert np.flatnonzero(r).tolist() == [0, 17, 60]


@pytest.mark.parametrize("V", [2, 16, 300, 5000])
def test_greedy_is_one_hot_argmax(V):
    g = np.random.default_rng(V)
    rows = g.normal(0, 1, (6, V)).astype(np.float32)
    rows[1, [3 % V, V - 1]] = rows[1].max() + 1.0  # a tie for the maximum: the first index wins
    got = logits_to_probs(torch.from_numpy(rows), SamplingParams(temperature=0)).numpy()
    for r, out in zip(rows, got):
        want = ref_probs(r, 0)
        assert np.array_equal(out, want)
        assert out.dtype == np.float32
    assert got[1].argmax() == min(3 % V, V - 1)
    # filters are irrelevant for greedy decoding
    got2 = logits_to_probs(torch.from_numpy(rows), SamplingParams(temperature=0, top_k=1, top_p=0.1)).numpy()
    assert np.array_equal(got, got2)
    # and next_token agrees with the one-hot
    assert next_token(torch.from_numpy(rows), SamplingParams(temperature=0), None).tolist() == \
        got.argmax(-1).tolist()


@pytest.mark.parametrize("kw", [
    dict(temperature=1.0), dict(temperature=0.3), dict(temperature=1.0, top_k=7),
    dict(temperature=0.8, top_p=0.6), dict(temperature=2.0, top_k=50, top_p=0.95), dict(temperature=0),
])
def test_rows_sum_to_one_any_shape(kw):
    logits = torch.randn(3, 4, 151, generator=torch.Generator().manual_seed(0)) * 4
    probs = logits_to_probs(logits, SamplingParams(**kw))
    assert probs.shape == logits.shape and probs.dtype == torch.float32
    assert torch.all(probs >= 0)
    torch.testing.assert_close(probs.sum(-1), torch.ones(3, 4), rtol=0, atol=1e-5)
    # batched rows equal the rows done one at a time
    for i in range(3):
        for j in range(4):
            torch.testing.assert_close(logits_to_probs(logits[i, j], SamplingParams(**kw)), probs[i, j])


def test_half_precision_logits_give_float32_probs():
    logits = torch.randn(2, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    probs = logits_to_probs(logits, SamplingParams(temperature=0.9, top_p=0.9))
    assert probs.dtype == torch.float32
    want = np.stack([ref_probs(r, 0.9, 0, 0.9) for r in logits.float().numpy()])
    np.testing.assert_allclose(probs.numpy(), want, rtol=1e-5, atol=1e-7)


def test_input_not_modified():
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(2))
    before = logits.clone()
    logits_to_probs(logits, SamplingParams(temperature=0.5, top_k=4, top_p=0.7))
    assert torch.equal(logits, before)


# ---------------------------------------------------------------------------------------------
# Against transformers' warpers (a second, external reference)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, 0, 1.0), (0.6, 0, 1.0), (1.0, 5, 1.0), (0.8, 20, 1.0), (1.0, 0, 0.9), (0.7, 0, 0.5),
    (1.2, 30, 0.8), (0.5, 3, 0.95),
])
def test_matches_transformers_warpers(temperature, top_k, top_p):
    from transformers.generation.logits_process import (LogitsProcessorList, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)

    procs = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k:
        procs.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        procs.append(TopPLogitsWarper(top_p))
    rows = [r for r in _random_rows(40, 100, seed=4, scale=2.5)
            if top_p == 1.0 or _top_p_margin(r, temperature, top_k, top_p) > 1e-4]
    logits = torch.tensor(np.stack(rows), dtype=torch.float32)
    want = torch.softmax(procs(torch.zeros(len(rows), 1, dtype=torch.long), logits.clone()), -1)
    got = logits_to_probs(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("candidates", [2, 6, 24])
def test_top_p_among_the_likeliest_keeps_the_whole_sorts_set(monkeypatch, candidates):
    """top-p looks among the TOP_P_CANDIDATES likeliest tokens first (a sort of the whole row is slow): on rows with
    many ties, at the candidates' boundary too, it keeps bit for bit the set the whole row's stable sort keeps, and
    takes each way on some rows (so both are checked)."""
    g = torch.Generator().manual_seed(11)
    logits = (torch.randn(400, 40, generator=g) * 2).round() / 2  # [400, 40]: ties everywhere
    logits[:100] *= 4  # peaked rows: the prefix ends among few candidates
    probs = torch.softmax(logits, -1)
    found = 0
    for top_p in (0.3, 0.8, 0.95):
        monkeypatch.setattr(transforms, "TOP_P_CANDIDATES", 10**6)
        whole = [transforms.top_p_drop(row, top_p) for row in probs]
        monkeypatch.setattr(transforms, "TOP_P_CANDIDATES", candidates)
        for row, want in zip(probs, whole):
            found += transforms._top_p_drop_among_candidates(row, top_p) is not None
            assert torch.equal(transforms.top_p_drop(row, top_p), want)
        assert torch.equal(transforms.top_p_drop(probs, top_p), torch.stack(whole))  # a batch: the same rows
    assert 0 < found < 3 * len(probs), found


# ---------------------------------------------------------------------------------------------
# Drawing
# ---------------------------------------------------------------------------------------------


def test_sample_seeded_and_in_support():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5], [1.0, 0.0, 0.0, 0.0]])
    a = [sample(probs, torch.Generator().manual_seed(5)).tolist() for _ in range(3)]
    assert a[0] == a[1] == a[2]
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([sample(probs, g) for _ in range(400)])  # [400, 2]
    assert set(draws[:, 0].tolist()) == {1, 3}
    assert set(draws[:, 1].tolist()) == {0}


def unscaled_sample(probs, generator):
    """A plausible bug for the negative control: the uniform draw is not scaled by the row's total weight."""
    cdf = torch.cumsum(probs, -1, dtype=torch.float64)
    u = torch.rand(probs.shape[0], 1, generator=generator, dtype=torch.float64)
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


@pytest.mark.parametrize("sampler, exact", [(sample, True), (unscaled_sample, False)])
def test_sample_draws_each_row_from_its_weights(sampler, exact):
    """Chi-square per row against the exact distribution: rows of weights that do not sum to 1 (a verifier's
    residual), with zero-weight tokens first, inside and last, and one row of a single token; the sampler that
    forgets the row's total must fail."""
    weights = torch.tensor([[0.0, 0.3, 0.0, 0.9, 0.6, 0.0, 0.2, 0.0],
                            [0.05, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.95],
                            [0.0, 0.0, 0.0, 0.0, 0.7, 0.0, 0.0, 0.0]])  # [3, 8]
    g = torch.Generator().manual_seed(3)
    draws = torch.stack([sampler(weights, g) for _ in range(6000)])  # [6000, 3]
    pvalues = [chi2_pvalue(np.bincount(draws[:, r].numpy(), minlength=8), weights[r].numpy()) for r in range(2)]
    only = set(draws[:, 2].tolist())
    assert (min(pvalues) > ALPHA and only == {4}) == exact, (pvalues, only)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_argmax_is_tensor_argmax_first_index_on_ties(dtype):
    """sampling.argmax (NumPy's argmax on float32 rows, torch.max's indices on others) picks what Tensor.argmax
    picks: the first index of the largest value, with ties (common in bf16), masked -inf rows, a row of equal
    values, NaN (the largest) and +inf; for one row, a batch of rows, a [B, T, V] block and a strided view."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(8, 151936, generator=g) * 3).to(dtype)
    x[1, 7], x[1, 90000] = 40.0, 40.0  # a tie: index 7
    x[2, :] = -float("inf")  # all masked: index 0
    x[3, :] = 1.5  # all equal: index 0
    x[4, 100:] = -float("inf")
    x[4, 50], x[4, 60] = 9.0, 9.0  # a tie before the masked tail: index 50
    x[5, 300], x[5, 200], x[5, 9] = float("nan"), float("nan"), float("inf")  # the first NaN: index 200
    x[6, 11], x[6, 12] = float("inf"), float("inf")  # index 11
    want = x.argmax(-1)
    assert torch.equal(argmax(x), want) and want[1:7].tolist() == [7, 0, 0, 50, 200, 11]
    assert argmax(x).dtype == torch.int64
    assert torch.equal(argmax(x[0]), x[0].argmax(-1))  # one row, no batch dimension
    assert torch.equal(argmax(x.view(2, 4, -1)), want.view(2, 4))
    assert torch.equal(argmax(x[:, ::3]), x[:, ::3].argmax(-1))
    assert torch.equal(next_token(x, SamplingParams(), None), want)


def test_mask_logits_is_masked_fill():
    g = torch.Generator().manual_seed(1)
    for V, rows in ((151936, (1,)), (151936, (2, 5)), (300, (3,))):
        mask = torch.rand(V, generator=g) < 0.01
        mask[-7:] = True  # a padding tail
        x = torch.randn(*rows, V, generator=g)
        assert torch.equal(mask_logits(x, mask), x.masked_fill(mask, float("-inf")))
        assert torch.equal(mask_logits(x, mask), x.masked_fill(mask, float("-inf")))  # the cached positions
    assert mask_logits(x, None) is x
