"""The verifier alone, on scripted target (p) and draft (q) distributions: no models.

Greedy rules and the output layout are checked case by case against hand-derived expectations; the
sampling rule is checked statistically: a vectorized simulation of whole speculative rounds (one row
per independent generation, 200k rows) must emit tokens distributed exactly as autoregressive
sampling from p, by chi-square against the product of the scripted p's. Broken variants of the rule
(tests/exact_helpers.py) must fail the very same test.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from exact_helpers import ALPHA, chi2_pvalue, variant_verify
from verispec import SamplingParams
from verispec.sampling import ProcessorChain
from verispec.spec.verify import PLACEHOLDER_TOKEN_ID, verify

GREEDY = ProcessorChain.from_params(SamplingParams(temperature=0.0))
T1 = ProcessorChain.from_params(SamplingParams(temperature=1.0))


def logits_with_argmax(argmaxes: list[int], V: int = 10, seed: int = 0) -> torch.Tensor:
    """[1, len(argmaxes), V] random logits whose row i has its maximum (by a clear margin) at argmaxes[i]."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(argmaxes), V, generator=g)
    for i, a in enumerate(argmaxes):
        logits[i, a] = logits[i].max() + 1.0
    return logits[None]


def log(p) -> torch.Tensor:
    return torch.as_tensor(p, dtype=torch.float32).log()  # log 0 = -inf: a token the target never emits


# ---------------------------------------------------------------------------------------------
# Greedy: accept x_i iff it is argmax p_i; the extra token is argmax p at the first mismatch
# ---------------------------------------------------------------------------------------------

ARGMAX = [3, 7, 1, 4, 9]  # argmax p_1 .. p_{K+1}, K = 4


@pytest.mark.parametrize("j", range(5))  # the first j drafts are right, then a wrong one (j = 4: all right)
def test_greedy_accepts_matching_prefix(j):
    K = 4
    logits = logits_with_argmax(ARGMAX)
    drafts = list(ARGMAX[:K])
    if j < K:
        drafts[j] = (drafts[j] + 1) % 10  # wrong from position j on; what follows must not matter
        drafts[j + 1:] = ARGMAX[j + 1:K]
    v = verify(logits, torch.tensor([drafts]), None, GREEDY, None)
    assert v.num_accepted.tolist() == [j]
    # accepted drafts, then argmax p_{j+1} (recovered if j < K, bonus if j == K), then padding
    assert v.tokens.tolist() == [ARGMAX[: j + 1] + [PLACEHOLDER_TOKEN_ID] * (K - j)]
    assert v.tokens.dtype == torch.long and v.num_accepted.dtype == torch.long


def test_greedy_ignores_draft_probs():
    """A sampled-looking q changes nothing under greedy: the rule is argmax identity."""
    K = 4
    logits = logits_with_argmax(ARGMAX)
    drafts = torch.tensor([[3, 7, 2, 4]])
    q = torch.softmax(torch.randn(1, K, 10, generator=torch.Generator().manual_seed(1)), -1)
    q[0, 2] = F.one_hot(torch.tensor(2), 10).float()  # the draft is sure of its wrong token
    for probs in (None, q):
        v = verify(logits, drafts, probs, GREEDY, None)
        assert v.num_accepted.tolist() == [2]
        assert v.tokens.tolist() == [[3, 7, 1, -1, -1]]


def test_greedy_ties_go_to_the_lower_id():
    logits = torch.zeros(1, 2, 6)
    logits[0, 0, [2, 4]] = 5.0  # tie between 2 and 4: argmax (and autoregressive greedy) says 2
    logits[0, 1, 5] = 1.0
    assert verify(logits, torch.tensor([[4]]), None, GREEDY, None).tokens.tolist() == [[2, -1]]
    assert verify(logits, torch.tensor([[2]]), None, GREEDY, None).tokens.tolist() == [[2, 5]]


def test_greedy_batch_rows_are_independent():
    K, B = 4, 6
    rows = [logits_with_argmax([(s + i) % 10 for i in range(K + 1)], seed=s) for s in range(B)]
    drafts = []
    for s in range(B):
        d = [(s + i) % 10 for i in range(K)]
        if s < K:
            d[s] = (d[s] + 5) % 10
        drafts.append(d)
    batch = verify(torch.cat(rows), torch.tensor(drafts), None, GREEDY, None)
    for s in range(B):
        one = verify(rows[s], torch.tensor([drafts[s]]), None, GREEDY, None)
        assert batch.tokens[s].tolist() == one.tokens[0].tolist()
        assert int(batch.num_accepted[s]) == int(one.num_accepted[0]) == min(s, K)


# ---------------------------------------------------------------------------------------------
# Sampling: the special cases that are certain, not statistical
# ---------------------------------------------------------------------------------------------


def test_q_equal_p_always_accepts_and_bonus_is_from_p_last():
    B, K, V = 20_000, 3, 6
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(K + 1, V, generator=g), -1)
    p[K] = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.2, 0.0])  # bonus row with visible zeros
    q = p[:K].expand(B, K, V).contiguous()
    drafts = torch.multinomial(q.reshape(-1, V), 1, generator=g).reshape(B, K)
    v = verify(log(p).expand(B, K + 1, V), drafts, q, T1, g)
    assert (v.num_accepted == K).all()
    assert torch.equal(v.tokens[:, :K], drafts)
    counts = np.bincount(v.tokens[:, K].numpy(), minlength=V)
    assert counts[[0, 2, 5]].sum() == 0
    assert chi2_pvalue(counts, p[K].double().numpy()) > ALPHA


def test_zero_target_probability_always_rejects():
    B, K, V = 20_000, 2, 5
    g = torch.Generator().manual_seed(1)
    p = torch.tensor([[0.5, 0.0, 0.3, 0.2, 0.0], [0.2, 0.2, 0.2, 0.2, 0.2], [0.1, 0.2, 0.3, 0.2, 0.2]])
    q = torch.tensor([[0.1, 0.6, 0.1, 0.1, 0.1], [0.2, 0.2, 0.2, 0.2, 0.2]]).expand(B, K, V).contiguous()
    drafts = torch.tensor([[1, 0]]).expand(B, K).contiguous()  # x_1 = 1 has p_1(1) = 0: never accepted
    v = verify(log(p).expand(B, K + 1, V), drafts, q, T1, g)
    assert (v.num_accepted == 0).all()
    assert (v.tokens[:, 1:] == PLACEHOLDER_TOKEN_ID).all()
    rec = v.tokens[:, 0].numpy()
    assert not np.isin(rec, [1, 4]).any()  # never the rejected draft, never a token the target cannot emit
    residual = (p[0] - q[0, 0]).clamp(min=0)  # [0.4, 0, 0.2, 0.1, 0]
    assert chi2_pvalue(np.bincount(rec, minlength=V), (residual / residual.sum()).double().numpy()) > ALPHA


def test_deterministic_draft_is_one_hot_q():
    """draft_probs=None means q = one-hot(x): accept x with probability p(x), else draw from p without x."""
    B, V = 40_000, 5
    g = torch.Generator().manual_seed(2)
    p = torch.tensor([[0.1, 0.3, 0.2, 0.4, 0.0], [0.2, 0.2, 0.2, 0.2, 0.2]])
    drafts = torch.full((B, 1), 3)
    v = verify(log(p).expand(B, 2, V), drafts, None, T1, g)
    acc = v.num_accepted.double().mean().item()
    assert abs(acc - 0.4) < 4 * (0.4 * 0.6 / B) ** 0.5  # binomial, 4 sigma
    rec = v.tokens[v.num_accepted == 0, 0].numpy()
    assert chi2_pvalue(np.bincount(rec, minlength=V), np.array([0.1, 0.3, 0.2, 0.0, 0.0]) / 0.6) > ALPHA
    # the same as passing the one-hot q explicitly, draw for draw
    one_hot = F.one_hot(drafts, V).float()
    w = verify(log(p).expand(B, 2, V), drafts, one_hot, T1, torch.Generator().manual_seed(2))
    assert torch.equal(v.tokens, w.tokens)


def test_output_layout_and_padding():
    B, K, V = 5_000, 4, 7
    g = torch.Generator().manual_seed(3)
    p = torch.softmax(2 * torch.randn(B, K + 1, V, generator=g), -1)
    q = torch.softmax(2 * torch.randn(B, K, V, generator=g), -1)
    drafts = torch.multinomial(q.reshape(-1, V), 1, generator=g).reshape(B, K)
    v = verify(p.log(), drafts, q, T1, g)
    assert v.tokens.shape == (B, K + 1) and v.num_accepted.shape == (B,)
    n = v.num_accepted
    assert ((n >= 0) & (n <= K)).all()
    assert len(set(n.tolist())) == K + 1  # every outcome happens: the checks below are not vacuous
    pos = torch.arange(K + 1)[None]
    assert torch.equal(v.tokens[:, :K][pos[:, :K] < n[:, None]], drafts[pos[:, :K] < n[:, None]])
    assert (v.tokens[pos > n[:, None]] == PLACEHOLDER_TOKEN_ID).all()
    extra = v.tokens[torch.arange(B), n]
    assert ((extra >= 0) & (extra < V)).all()


def test_sampled_batch_rows_are_independent():
    """Rows with different p/q in one batch: a sure accept, a sure reject and a mixed row keep their own law."""
    B, V = 30_000, 4
    g = torch.Generator().manual_seed(4)
    p_sure = torch.tensor([[0.25, 0.25, 0.25, 0.25], [0.1, 0.2, 0.3, 0.4]])
    p_zero = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.1, 0.2, 0.3, 0.4]])
    p_mix = torch.tensor([[0.7, 0.1, 0.1, 0.1], [0.4, 0.3, 0.2, 0.1]])
    q = torch.tensor([0.25, 0.25, 0.25, 0.25])
    kind = torch.arange(B) % 3
    p = torch.stack([p_sure, p_zero, p_mix])[kind]  # [B, 2, V]
    drafts = torch.where(kind == 1, 0, torch.multinomial(q.expand(B, V), 1, generator=g)[:, 0])[:, None]
    v = verify(log(p), drafts, q.expand(B, 1, V).contiguous(), T1, g)
    assert (v.num_accepted[kind == 0] == 1).all()
    assert (v.num_accepted[kind == 1] == 0).all()
    first = v.tokens[:, 0].numpy()
    assert chi2_pvalue(np.bincount(first[kind == 1], minlength=V), p_zero[0].double().numpy()) > ALPHA
    assert chi2_pvalue(np.bincount(first[kind == 2], minlength=V), p_mix[0].double().numpy()) > ALPHA


# ---------------------------------------------------------------------------------------------
# Sampling: the law of the emitted tokens, by simulation of whole rounds
# ---------------------------------------------------------------------------------------------

V = 5
K = 2
N_ROWS = 200_000  # independent generations, simulated side by side (one verify call per round)
N_TOKENS = 3  # the joint of the first three emitted tokens: V**3 = 125 cells
# A target whose next-token law depends on the position only (p_d for the d-th emitted token) and a
# draft that proposes x ~ q_d at position d: then AR sampling gives t_0, t_1, t_2 independent with
# laws p_0, p_1, p_2, and the emitted tokens of a correct verifier must have exactly that joint law.
# Chosen for coverage: q > p, q < p, q == p, p = 0 < q (never accepted), q = 0 < p (only ever recovered).
P_TAB = torch.tensor([
    [0.40, 0.25, 0.20, 0.15, 0.00],
    [0.05, 0.45, 0.00, 0.30, 0.20],
    [0.30, 0.10, 0.25, 0.05, 0.30],
    [0.10, 0.20, 0.30, 0.30, 0.10],
    [0.60, 0.10, 0.10, 0.10, 0.10],
])  # p_0 .. p_4 (a round starting at position d reads p_d .. p_{d+K})
Q_TAB = torch.tensor([
    [0.10, 0.30, 0.20, 0.10, 0.30],
    [0.30, 0.30, 0.20, 0.00, 0.20],
    [0.25, 0.25, 0.25, 0.25, 0.00],
    [0.20, 0.20, 0.20, 0.20, 0.20],
])  # q_0 .. q_3


def simulate(verify_fn, seed: int, n_rows: int = N_ROWS, deterministic_draft: bool = False) -> np.ndarray:
    """Run rounds (draft K from q, verify against p) until every row has N_TOKENS tokens -> [n_rows, N_TOKENS]."""
    g = torch.Generator().manual_seed(seed)
    out = torch.full((n_rows, N_TOKENS + K + 1), -1, dtype=torch.long)
    depth = torch.zeros(n_rows, dtype=torch.long)  # tokens emitted so far, per row
    active = torch.arange(n_rows)
    while active.numel():
        d = depth[active]
        b = d.numel()
        logits = log(P_TAB)[d[:, None] + torch.arange(K + 1)]  # [b, K+1, V]
        q = Q_TAB[d[:, None] + torch.arange(K)]  # [b, K, V]
        x = torch.multinomial(q.reshape(-1, V), 1, generator=g).reshape(b, K)
        verdict = verify_fn(logits, x, None if deterministic_draft else q, T1, g)
        n = verdict.num_accepted
        for j in range(K + 1):
            m = j <= n
            out[active[m], d[m] + j] = verdict.tokens[m, j]
        assert (verdict.tokens[torch.arange(b), n] >= 0).all()
        depth[active] = d + n + 1
        active = active[depth[active] < N_TOKENS]
    return out[:, :N_TOKENS].numpy()


def joint_counts(tokens: np.ndarray) -> np.ndarray:
    assert tokens.min() >= 0
    return np.bincount(tokens @ (V ** np.arange(N_TOKENS)[::-1]), minlength=V ** N_TOKENS).reshape((V,) * N_TOKENS)


EXACT = np.einsum("a,b,c->abc", *P_TAB[:N_TOKENS].double().numpy())


def test_scripted_tables_exercise_every_branch():
    """Rejections, recoveries and full acceptance (bonus) all happen often in the simulation."""
    accept = (np.minimum(P_TAB[:K + 1], Q_TAB[:K + 1]).sum(-1)).numpy()  # P(accept x_d) = sum min(p_d, q_d)
    assert ((accept > 0.3) & (accept < 0.8)).all()
    assert (P_TAB.sum(-1) - 1).abs().max() < 1e-6 and (Q_TAB.sum(-1) - 1).abs().max() < 1e-6


def test_first_emitted_tokens_follow_p_exactly():
    counts = joint_counts(simulate(verify, seed=10))
    p = chi2_pvalue(counts, EXACT)
    assert p > ALPHA, f"chi-square p = {p:.3g}"
    # single-token margins too (each a 5-cell test, far more sensitive to a one-position error)
    for axis in range(N_TOKENS):
        margin = counts.sum(axis=tuple(i for i in range(N_TOKENS) if i != axis))
        assert chi2_pvalue(margin, P_TAB[axis].double().numpy()) > ALPHA, axis


def test_one_hot_q_for_a_sampled_draft_is_still_exact():
    """Drafts sampled from q but verified as deterministic (draft_probs=None): lossless, only slower."""
    p = chi2_pvalue(joint_counts(simulate(verify, seed=11, deterministic_draft=True)), EXACT)
    assert p > ALPHA, f"chi-square p = {p:.3g}"


def test_copied_rule_passes():
    """The negative controls below differ from this copy by one line; the copy itself must pass."""
    p = chi2_pvalue(joint_counts(simulate(variant_verify(None), seed=12)), EXACT)
    assert p > ALPHA, f"chi-square p = {p:.3g}"


@pytest.mark.parametrize("bug", ["recover_from_p", "bonus_from_p_K", "shared_u", "always_accept"])
def test_negative_control_broken_verifier_fails(bug):
    p = chi2_pvalue(joint_counts(simulate(variant_verify(bug), seed=13)), EXACT)
    assert p < ALPHA, f"broken verifier {bug} not detected: p = {p:.3g}"
