"""Sampling with the Medusa, MTP and P-EAGLE drafters is AR sampling: the chi-square harness of
test_speculative_distribution.py (the 16-token target as a table whose "hidden states" are the token embeddings:
test_eagle.FeatureTable) with a random head of each family (P-EAGLE of 1 layer, and of 2 whose mask rows read the
first draft's hidden state) over 12 of the 16 tokens, at T = 0.8 with top-k 6 (the draft law q goes through the
same processors as p), against the exact law; and a broken verifier (accepting every draft) that the same test must
reject. The sampling transform at other settings is the verifier's and the sampler's, whatever drafted: their laws
are test_speculative_distribution.py's and test_ar_distribution.py's (EAGLE-3's own: test_eagle.py, at T = 1 too).
"""

from __future__ import annotations

import pytest
from test_eagle import check_broken_verifier_fails, check_law, table_llm_with
from test_medusa import random_head as random_medusa
from test_mtp import random_module
from test_peagle import random_peagle

import test_speculative_distribution as base
from verispec import LLM
from verispec.heads import save_head

model_dirs, tables = base.model_dirs, base.tables
CASES = {"T0.8-top_k6-K2": (2, dict(temperature=0.8, top_k=6))}
ROWS = list(range(12))


def write_mtp(path, cfg, rows, scale):
    save_head(random_module(cfg, rows=rows, scale=scale), path, int8=False)
    return path


MAKERS = {"medusa": lambda path, cfg: random_medusa(path, cfg, rows=ROWS, scale=0.5),
          "mtp": lambda path, cfg: write_mtp(path, cfg, ROWS, 0.3),
          "peagle": lambda path, cfg: random_peagle(path, cfg, rows=ROWS, scale=0.3),
          "peagle 2 layers, first hidden": lambda path, cfg: random_peagle(path, cfg, rows=ROWS, scale=0.3, depth=2,
                                                                           first_hidden=True)}


@pytest.fixture(scope="module")
def table_llms(model_dirs, tables, tmp_path_factory):
    root = tmp_path_factory.mktemp("head_laws")
    cfg = LLM(target=str(model_dirs["target"]), dtype="float32", progress=False).target.config
    return {name: table_llm_with(model_dirs, tables, make(root / name.replace(" ", "-"), cfg))
            for name, make in MAKERS.items()}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("method", list(MAKERS))
def test_sampling_matches_exact_distribution(table_llms, tables, method, name):
    check_law(table_llms[method], tables, f"{method} {name}", *CASES[name], method.split()[0])


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("method", list(MAKERS))
def test_negative_control_broken_verifier_fails(table_llms, tables, monkeypatch, method, name):
    check_broken_verifier_fails(table_llms[method], tables, monkeypatch, *CASES[name], method.split()[0])
