"""Sampling with ``auto`` mixing two draft heads that read different target layers (an EAGLE-3 head on three
streams, a Medusa head on the last one) is AR sampling, and a broken verifier under the same mix is caught.

The machinery is test_speculative_distribution.py's (a 16-token table target, the joint law of the first three
tokens, chi-square) with test_eagle.FeatureTable standing in for the network: every layer's "hidden state" differs
(the embedding times 1 + layer), so each head drafts from the columns auto hands it (drafters/auto.py, ``_for``).
The draws are unseeded, so that auto mixes its delegates round by round (a seeded sample drafts with one), and the
costs are pinned (test_ngram_auto_distribution.try_short_matches): both heads draft whatever the machine's load.
"""

from __future__ import annotations

import pytest
from test_eagle import FeatureTable
from test_medusa import random_head as random_medusa
from test_ngram_auto_distribution import draw, try_short_matches

import test_speculative_distribution as base
import verispec.engine.engine
from eagle_helpers import randomize
from exact_helpers import ALPHA, chi2_pvalue, variant_verify
from test_speculative_distribution import N, N_NEG, exact_joint
from verispec import LLM, SamplingParams
from verispec.heads import Eagle3Config, Eagle3Head, save_head

model_dirs, tables = base.model_dirs, base.tables
ROWS = list(range(12))  # the heads' draft vocabulary: 12 of the 16 tokens
K = 2
CASES = {"T0.8-top_k6": dict(temperature=0.8, top_k=6)}


@pytest.fixture(scope="module")
def mixed(model_dirs, tables, tmp_path_factory):
    """The table target (one layer) with a random EAGLE-3 head on streams 0 and 1 (the embeddings, the layer's
    output) and a random Medusa head on stream 1: auto keeps (0, 1) and hands Medusa the second half."""
    root = tmp_path_factory.mktemp("auto_heads")
    cfg = LLM(target=str(model_dirs["target"]), dtype="float32", progress=False).target.config
    eagle = randomize(Eagle3Head(Eagle3Config.for_target(cfg, (0, 1), len(ROWS))), ROWS, 0, 0.3)
    save_head(eagle, root / "eagle", int8=False)
    heads = [root / "eagle", random_medusa(root / "medusa", cfg, rows=ROWS, scale=0.5)]
    llm = LLM(target=str(model_dirs["target"]), dtype="float32", head=[str(h) for h in heads], progress=False)
    eagle, medusa = llm.draft_head("eagle", "eagle3"), llm.draft_head("medusa", "medusa")  # loaded on the network
    assert (eagle.feature_layers, medusa.feature_layers) == ((0, 1), (1,))
    llm.target.model = FeatureTable(llm.target.model, tables["target"])
    return llm


def _pin(monkeypatch, llm):
    try_short_matches(monkeypatch, llm)
    llm.costs.draft.update({"eagle": 0.1, "medusa": 0.1})  # as cheap as each other: auto keeps revisiting both
    llm.auto_memory.clear()  # each test explores both heads afresh


@pytest.mark.parametrize("name", list(CASES))
def test_auto_mixing_heads_of_different_layers_samples_the_target_law(mixed, tables, monkeypatch, name):
    _pin(monkeypatch, mixed)
    params = SamplingParams(**CASES[name])
    counts, drafted_per_run, acceptance, used = draw(mixed, "auto", K, params, N, {}, seeded=False)
    assert drafted_per_run > 1.0, f"{name}: too few drafts ({drafted_per_run:.2f} per run)"
    assert 0.02 < acceptance < 0.98, f"{name}: acceptance {acceptance:.3f}"
    assert min(used.get("eagle", 0), used.get("medusa", 0)) > 0.01 * N, used  # both heads drafted, often
    p = chi2_pvalue(counts, exact_joint(tables, params))
    assert p > ALPHA, f"{name}: chi-square p = {p:.3g} (acceptance {acceptance:.3f}, drafters {used})"


@pytest.mark.parametrize("bug", ["always_accept", "recover_from_p"])
def test_negative_control_broken_verifier_fails_under_the_mix(mixed, tables, monkeypatch, bug):
    _pin(monkeypatch, mixed)
    params = SamplingParams(**CASES["T0.8-top_k6"])
    monkeypatch.setattr(verispec.engine.engine, "verify", variant_verify(bug))
    counts, _, _, used = draw(mixed, "auto", K, params, N_NEG, {}, seeded=False)
    assert min(used.get("eagle", 0), used.get("medusa", 0)) > 0, used
    p = chi2_pvalue(counts, exact_joint(tables, params))
    assert p < ALPHA, f"negative control {bug} not detected: p = {p:.3g} (drafters {used})"
