"""The P-EAGLE head (heads/peagle.py, drafters/head.py's PEagleDrafter: drafts 2..K from one pass of mask rows)
keeps the output exactly the target's.

Greedy: method="peagle" gives token for token the AR output (float32 tiny target) for a random head of 1 and of 3
decoder layers, and one whose mask rows read the first draft's hidden state, K = 1..6 (sampling: test_head_laws.py). Training: EAGLE-3's unroll with mask inputs from step 1 on, on a successor-function target,
raises held-out acceptance at every position far above the untrained head's (can fail). A head of another family
for the method is one line.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from eagle_helpers import randomize, successor_target, train_head
from test_eagle import check_greedy_identity
from verispec import LLM, SamplingParams
from verispec.errors import VerispecError
from verispec.heads import PEagleConfig, PEagleHead, save_head



def random_peagle(path, target_cfg, rows=None, seed: int = 0, scale: float = 0.15, depth: int = 1,
                  first_hidden: bool = False):
    rows = list(range(target_cfg.vocab_size)) if rows is None else rows
    config = replace(PEagleConfig.for_target(target_cfg, None, len(rows)), num_layers=depth, first_hidden=first_hidden)
    save_head(randomize(PEagleHead(config), rows, seed, scale), path, int8=False)
    return path


@pytest.fixture(scope="module", params=[(1, False), (3, False), (2, True)],
                ids=["1-layer", "3-layers", "2-layers-first-hidden"])
def llm(tiny_dirs, tmp_path_factory, request):
    cfg = LLM(target=str(tiny_dirs["qwen2"]), dtype="float32", progress=False).target.config
    depth, first_hidden = request.param
    path = random_peagle(tmp_path_factory.mktemp("peagle") / "random", cfg, depth=depth, first_hidden=first_hidden)
    return LLM(target=str(tiny_dirs["qwen2"]), dtype="float32", head=str(path), progress=False)


@pytest.mark.parametrize("K", [1, 2, 4, 6])
def test_greedy_identity(llm, K):
    check_greedy_identity(llm, "peagle", K)
    with pytest.raises(VerispecError, match=r"method eagle needs a eagle3 head, but .* is a peagle head"):
        llm.generate([1, 2, 3], SamplingParams(max_new_tokens=4), method="eagle")


def test_training_raises_heldout_acceptance_far_above_the_untrained_head(tmp_path):
    target, _ = successor_target(tmp_path / "successor")
    llm = LLM(target=str(target), dtype="float32", progress=False)
    untrained = train_head(llm, "peagle", tmp_path / "untrained", 0, 16)
    trained = train_head(llm, "peagle", tmp_path / "trained", 300, 16)
    assert len(trained["heldout_acceptance"]) == 3  # the unroll's 3 steps: the real row, then two mask rows
    for pos in range(3):
        assert trained["heldout_acceptance"][pos] > untrained["heldout_acceptance"][pos] + 0.4, (untrained, trained)
    drafted = LLM(target=str(target), dtype="float32", head=str(tmp_path / "trained"), progress=False).generate(
        [5, 1], SamplingParams(max_new_tokens=24, ignore_eos=True), method="peagle", num_draft_tokens=3)
    assert drafted.token_ids == llm.generate([5, 1], SamplingParams(max_new_tokens=24, ignore_eos=True)).token_ids
    assert drafted.stats["acceptance_rate"] > 0.5, drafted.stats
