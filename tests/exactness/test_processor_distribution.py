"""Speculative sampling with a prefix-dependent logits processor draws exactly what autoregressive sampling under
the same processor draws (house rule: a chi-square test against exact probabilities, and a negative control that
must fail).

The processor is BanLast (tests/exact_helpers.py): the token that ends a row's prefix can never come next, so in a
verify pass row i must ban draft x_{i-1}, not the last committed token. A scripted target over a 5-token vocabulary
(logits set by the last token) and a scripted draft: the joint law of the first three generated tokens is
enumerated exactly from the chain, P(a, b, c) = p(a | prompt) p(b | prompt a) p(c | prompt a b), 125 cells (those
that repeat a token are impossible). The generations run the real ``draw`` (the drafters' helper) for K = 2 drafts
and the real ``verify`` for each round. The negative control verifies with every row given the committed context
only, ignoring the drafts before it: it must be rejected.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from exact_helpers import ALPHA, BanLast, chi2_pvalue, naive_probs, variant_verify
from verispec import SamplingParams
from verispec.sampling import Prefix, ProcessorChain, draw
from verispec.spec.verify import verify

V, K, N_TOKENS = 5, 2, 3
N = 5_000  # generations per positive case (~1 ms each)
N_NEG = 1_000  # per negative control: its broken rule emits ~100 impossible repeats in 1,000
PROMPT = [1, 3]
g = torch.Generator().manual_seed(0)
P_LOGITS = 1.5 * torch.randn(V, V, generator=g)  # target: row t = the logits after a prefix ending in t
Q_LOGITS = P_LOGITS + torch.randn(V, V, generator=g)  # draft: the target plus noise

# an adversarial draft: it proposes what the processors forbid or penalise (the token that ended the prefix again,
# and token 0, which a logit bias of -100 bans)
ADVERSARY = P_LOGITS.clone()
ADVERSARY[torch.arange(V), torch.arange(V)] += 4.0
ADVERSARY[:, 0] += 3.0

# name: (target's SamplingParams fields, BanLast on the target, on the draft too, the draft's logits); the
# params' own processors (sampling/processors.py: logit bias, penalties, min-p) apply to the target's rows only
CASES = {
    "T1-draft_bans_too": (dict(temperature=1.0), True, True, Q_LOGITS),
    "T0.7-top_k3-draft_without_processor": (dict(temperature=0.7, top_k=3), True, False, Q_LOGITS),
    "penalties-adversarial-draft": (dict(temperature=1.0, presence_penalty=1.5, frequency_penalty=1.0,
                                         repetition_penalty=1.5), False, False, ADVERSARY),
    "bias-min_p-adversarial-draft": (dict(temperature=0.9, logit_bias={0: -100, 2: 2.0}, min_p=0.1), False, False,
                                     ADVERSARY),
}


def chains(name: str) -> tuple[ProcessorChain, ProcessorChain]:
    kw, ban, draft_bans, _ = CASES[name]
    params = SamplingParams(**kw)
    return (ProcessorChain.from_params(params, extra=[BanLast()] if ban else [], prompt_len=len(PROMPT)),
            ProcessorChain.from_params(SamplingParams(**{k: v for k, v in kw.items() if k in ("temperature", "top_k")}),
                                       extra=[BanLast()] if draft_bans else []))


def exact_joint(chain: ProcessorChain) -> np.ndarray:
    """[V, V, V]: P(first three tokens) under AR sampling through the chain, every prefix enumerated."""
    p = lambda h: chain.probs([PROMPT + list(h)], P_LOGITS[([*PROMPT, *h])[-1]][None])[0].double()  # noqa: E731
    joint = np.zeros((V,) * N_TOKENS)
    for a, b in itertools.product(range(V), repeat=2):
        joint[a, b] = (p(())[a] * p((a,))[b] * p((a, b))).numpy()
    return joint / joint.sum()


def generate(verify_fn, name: str, n: int, seed: int) -> np.ndarray:
    """n generations of N_TOKENS tokens by speculative rounds -> counts [V, V, V]; one generator for all."""
    chain_p, chain_q = chains(name)
    q_logits = CASES[name][3]
    g = torch.Generator().manual_seed(seed)
    counts = np.zeros((V,) * N_TOKENS, dtype=np.int64)
    for _ in range(n):
        ctx = list(PROMPT)
        while len(ctx) - len(PROMPT) < N_TOKENS:
            drafts, qs = [], []
            for _ in range(K):  # x_i ~ q_i, given context + x_1..x_{i-1}
                token, q = draw(q_logits[(drafts or ctx)[-1]][None], Prefix(ctx, drafts), chain_q, g)
                drafts.append(int(token))
                qs.append(q)
            target_logits = P_LOGITS[[ctx[-1], *drafts]][None]  # [1, K+1, V]: row i after context + x_1..x_i
            v = verify_fn(target_logits, torch.tensor([drafts]), torch.stack(qs, 1), chain_p, g, [ctx])
            ctx += v.tokens[0, :int(v.num_accepted[0]) + 1].tolist()
        counts[tuple(ctx[len(PROMPT):len(PROMPT) + N_TOKENS])] += 1
    return counts


@pytest.mark.parametrize("name", [n for n in CASES if CASES[n][1]])
def test_exact_law_is_independently_right(name):
    """The expected cells come from the chain, which verify uses too: check them against naive float64 rows with
    the previous token's logit set to -inf by hand."""
    kw = CASES[name][0]
    z = P_LOGITS.double().numpy()
    naive = lambda last: naive_probs(np.where(np.arange(V) == last, -np.inf, z[last]), kw["temperature"],  # noqa: E731
                                     kw.get("top_k", 0))
    want = np.einsum("a,ab,abc->abc", naive(PROMPT[-1]), np.stack([naive(a) for a in range(V)]),
                     np.stack([np.stack([naive(b) for b in range(V)])] * V))
    got = exact_joint(chains(name)[0])
    assert np.array_equal(got > 0, want > 0) and (got > 0).sum() < V ** 3  # repeats are impossible
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("name", list(CASES))
def test_speculative_sampling_with_a_prefix_processor_is_ar_sampling(name):
    counts = generate(verify, name, N, seed=1)
    p = chi2_pvalue(counts, exact_joint(chains(name)[0]))
    assert p > ALPHA, f"{name}: chi-square p = {p:.3g}"


@pytest.mark.parametrize("bug", [None, "committed_prefix_only"])
def test_negative_control_committed_prefix_only_fails(bug):
    """The copied rule passes; the same rule with every row's processors given the committed context alone (the
    drafts before the row ignored) must be rejected."""
    name = "T1-draft_bans_too"
    p = chi2_pvalue(generate(variant_verify(bug), name, N_NEG, seed=2), exact_joint(chains(name)[0]))
    if bug:
        assert p < ALPHA, f"processor given the committed context only not detected: p = {p:.3g}"
    else:
        assert p > ALPHA, f"the copied rule: chi-square p = {p:.3g}"


@pytest.mark.parametrize("name,bug", [("penalties-adversarial-draft", "committed_prefix_only"),
                                      ("bias-min_p-adversarial-draft", "always_accept")])
def test_negative_controls_of_the_params_processors_fail(name, bug):
    """Penalties given the committed context only (the drafts before a row ignored), and a verifier that accepts
    the drafts the bias bans, must be rejected."""
    p = chi2_pvalue(generate(variant_verify(bug), name, N_NEG, seed=3), exact_joint(chains(name)[0]))
    assert p < ALPHA, f"{name} / {bug} not detected: p = {p:.3g}"
