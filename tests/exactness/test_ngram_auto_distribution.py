"""Sampling with the n-gram drafter (a deterministic draft: one-hot q) and with ``auto`` (n-gram and draft
model mixed round by round, lengths chosen adaptively) draws from exactly the target's distribution.

The machinery is test_speculative_distribution.py's: a 16-token vocabulary, table-backed networks, the
joint law of the first three tokens enumerated exactly, chi-square, and a broken verifier that must fail.
The prompt repeats tokens (1 twice; every generated token that occurs in the prompt matches a 1-gram), so
the n-gram drafter proposes in most rounds.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import verispec.engine.engine
import verispec.drafters.auto
from exact_helpers import ALPHA, chi2_pvalue, variant_verify
import test_speculative_distribution as base
from test_speculative_distribution import N, N_NEG, PROMPT, V, exact_joint, make_llm
from verispec import SamplingParams
from verispec.spec.costs import Costs

CASES = {  # name: (method, draft model, K, SamplingParams fields, speculative options)
    "ngram-T1-K2": ("ngram", "near", 2, dict(temperature=1.0), {}),
    "ngram-top_p0.8-K2": ("ngram", "near", 2, dict(temperature=1.0, top_p=0.8), {}),
    "auto-T0.7-top_k5-K2": ("auto", "near", 2, dict(temperature=0.7, top_k=5), {}),
    # seeded samples under auto: one delegate, the fixed K (drafters/auto.py), its own path
    "auto_seeded-T0.7-top_k5-K2": ("auto", "near", 2, dict(temperature=0.7, top_k=5), {}),
    "adaptive_draft-T1-K2": ("draft", "other", 2, dict(temperature=1.0), dict(adaptive=True)),
    # adaptive n-gram: drafts cut per match length (drafters/auto.py with one drafter)
    "adaptive_ngram-T1-K2": ("ngram", "near", 2, dict(temperature=1.0), dict(adaptive=True)),
}
model_dirs, tables = base.model_dirs, base.tables  # the same fixtures: tiny models and their logit tables
NEGATIVE = [("ngram-T1-K2", "always_accept"), ("auto-T0.7-top_k5-K2", "recover_from_p"),
            ("auto_seeded-T0.7-top_k5-K2", "always_accept"),
            ("adaptive_draft-T1-K2", "always_accept"), ("adaptive_ngram-T1-K2", "always_accept")]


def draw(llm, method: str, K: int, params: SamplingParams, n: int, opts: dict, first_seed: int = 0,
         seeded: bool | None = None):
    counts = np.zeros((V, V, V), dtype=np.int64)
    drafted = accepted = 0
    used: dict[str, int] = {}
    # auto's draws (adaptive n-gram's too) are unseeded, so that its rounds mix drafters and cut drafts: a seeded
    # sample under auto drafts its fixed K with one delegate (drafters/auto.py)
    unseeded = (method == "auto" or opts.get("adaptive", False)) if seeded is None else not seeded
    torch.manual_seed(first_seed)
    for seed in range(first_seed, first_seed + n):
        out = llm.generate(PROMPT, dataclasses.replace(params, max_new_tokens=K + 2,
                                                       seed=None if unseeded else seed),
                           method=method, num_draft_tokens=K, **opts)
        a, b, c = out.token_ids[:3]
        counts[a, b, c] += 1
        drafted += out.stats["drafted_tokens"]
        accepted += out.stats["accepted_tokens"]
        for name, rounds in out.stats.get("drafter_rounds", {}).items():
            if rounds:  # every delegate is reported, those that never drafted with 0
                used[name] = used.get(name, 0) + rounds
    return counts, drafted / n, accepted / max(drafted, 1), used


def try_short_matches(monkeypatch, llm):
    """``auto`` tries untried n-gram matches of any length: this prompt's are 1-2 tokens, and beside a draft
    model auto would otherwise never take them (drafters/auto.py, TRY_MIN_MATCH); rounds must mix drafters. And
    it drafts whenever a drafter is worth anything: on these table models a draft step costs as much as a target
    step, so auto would rightly settle on plain decoding (its estimates carry over from draw to draw) and leave
    the verifier nothing to judge. The costs it reads are pinned at what these models cost (a flat verify, a free
    n-gram lookup, a draft step as dear as a target step), so that the choices (which drafter, how long a draft)
    do not follow the machine's load: the n-gram drafts where it matches, the draft model where it does not."""
    monkeypatch.setattr(verispec.drafters.auto, "TRY_MIN_MATCH", 1)
    monkeypatch.setattr(verispec.drafters.auto, "SPEC_MARGIN", 0.0)
    monkeypatch.setattr(verispec.drafters.auto, "REALIZED_MARGIN", 0.0)
    for name in ("observe_forward", "observe_round", "observe_draft", "observe_catch_up"):
        monkeypatch.setattr(Costs, name, lambda *a: None)
    costs = llm.costs
    for table in (costs.forward, costs.round, costs.draft, costs.catch_up):
        table.clear()
    costs.forward.update({T: 1.0 for T in range(1, 64)})
    costs.round.update({T: 1.0 for T in range(1, 8)})
    costs.draft.update({"ngram": 0.0, "draft": 1.0, "auto": 0.5})


@pytest.fixture(scope="module")
def table_llms(model_dirs, tables):
    return {d: make_llm(model_dirs, d, tables) for d in ("near", "other")}


@pytest.mark.parametrize("name", list(CASES))
def test_sampling_matches_exact_distribution(table_llms, tables, monkeypatch, name):
    method, draft, K, kw, opts = CASES[name]
    params = SamplingParams(**kw)
    try_short_matches(monkeypatch, table_llms[CASES[name][1]])
    seeded = "seeded" in name or None
    counts, drafted_per_run, acceptance, used = draw(table_llms[draft], method, K, params, N, opts, seeded=seeded)
    assert drafted_per_run > 1.0, f"{name}: too few drafts ({drafted_per_run:.2f} per run) to test anything"
    assert 0.01 < acceptance < 0.98, f"{name}: acceptance {acceptance:.3f}"  # >= ~400 accepted drafts
    if method == "auto" and seeded:
        assert set(used) == {"draft"}, used  # the one delegate
    elif method == "auto":
        # how often each wins follows their measured costs (timing): a share of the rounds, not half
        assert min(used.values()) > 0.01 * N and set(used) == {"ngram", "draft"}, used
    p = chi2_pvalue(counts, exact_joint(tables, params))
    assert p > ALPHA, f"{name}: chi-square p = {p:.3g} (acceptance {acceptance:.3f}, drafters {used})"


@pytest.mark.parametrize("name,bug", NEGATIVE)
def test_negative_control_broken_verifier_fails(table_llms, tables, monkeypatch, name, bug):
    method, draft, K, kw, opts = CASES[name]
    params = SamplingParams(**kw)
    try_short_matches(monkeypatch, table_llms[CASES[name][1]])
    monkeypatch.setattr(verispec.engine.engine, "verify", variant_verify(bug))
    counts, *_ = draw(table_llms[draft], method, K, params, N_NEG, opts, seeded="seeded" in name or None)
    p = chi2_pvalue(counts, exact_joint(tables, params))
    assert p < ALPHA, f"negative control {name}/{bug} not detected: p = {p:.3g}"
