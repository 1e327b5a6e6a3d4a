"""The Medusa head drafter (heads/medusa.py, drafters/medusa.py) keeps the output exactly the target's, and its loader
reads the Medusa authors' layout.

Training: Medusa-1 on a target with a learnable next-next token (a successor function: a random target's is not
learnable from one row) raises held-out acceptance far above the untrained head's (can fail).
Greedy: method="medusa" gives token for token the AR output (float32 tiny target) for a random head and a head in the
authors' layout (own LM head per head), K = 1..6 (capped at the head count); sampling: test_head_laws.py. A head of
the wrong family for the method, or the wrong shape for the target, is one line.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from eagle_helpers import random_head as random_eagle_head
from test_eagle import check_greedy_identity
from eagle_helpers import successor_target, train_head
from verispec import LLM, SamplingParams
from verispec.cli import main
from verispec.errors import VerispecError
from verispec.heads import MedusaConfig, MedusaHead, read_head, save_head



def random_head(path: Path, target_cfg, rows: list[int] | None = None, seed: int = 0, scale: float = 0.3,
                num_heads: int = 4) -> Path:
    """A random Medusa head in our layout (no LM head: the target's rows for ``rows``, default all)."""
    rows = list(range(target_cfg.vocab_size)) if rows is None else rows
    head = MedusaHead(MedusaConfig.for_target(target_cfg, None, len(rows), num_heads))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    head.d2t = torch.tensor(sorted(rows))
    save_head(head, path, int8=False)
    return path


def authors_head(path: Path, target_cfg, num_heads: int = 3, seed: int = 1) -> Path:
    """A head as the Medusa authors publish one: config.json with medusa_num_heads / medusa_num_layers and
    medusa_lm_head.safetensors with "{k}.0.linear.*" ResBlocks and a full "{k}.1.weight" LM head per head."""
    from safetensors.torch import save_file

    D, Vt = target_cfg.hidden_size, target_cfg.vocab_size
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for k in range(num_heads):
        sd[f"{k}.0.linear.weight"] = torch.randn(D, D, generator=g) * 0.05
        sd[f"{k}.0.linear.bias"] = torch.randn(D, generator=g) * 0.05
        sd[f"{k}.1.weight"] = torch.randn(Vt, D, generator=g) * 0.2
    path.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(path / "medusa_lm_head.safetensors"))
    (path / "config.json").write_text(json.dumps({"medusa_num_heads": num_heads, "medusa_num_layers": 1,
                                                  "base_model_name_or_path": "tiny"}))
    return path


def test_training_raises_heldout_acceptance_far_above_the_untrained_head(tmp_path):
    target, sigma = successor_target(tmp_path / "successor")
    llm = LLM(target=str(target), dtype="float32", progress=False)
    out = llm.generate([3], SamplingParams(max_new_tokens=3, ignore_eos=True)).token_ids
    assert out == [sigma[3], sigma[sigma[3]], sigma[sigma[sigma[3]]]]  # the target is what it claims
    untrained = train_head(llm, "medusa", tmp_path / "untrained", 0, 16)
    trained = train_head(llm, "medusa", tmp_path / "trained", 300, 16)
    assert len(trained["heldout_acceptance"]) == 4  # one rate per head
    assert trained["heldout_acceptance"][0] > untrained["heldout_acceptance"][0] + 0.5, (untrained, trained)
    assert trained["heldout_tau"] > untrained["heldout_tau"] + 1.0, (untrained, trained)
    drafted = LLM(target=str(target), dtype="float32", head=str(tmp_path / "trained"), progress=False).generate(
        [5, 1], SamplingParams(max_new_tokens=24, ignore_eos=True), method="medusa", num_draft_tokens=4)
    assert drafted.token_ids == llm.generate([5, 1], SamplingParams(max_new_tokens=24, ignore_eos=True)).token_ids
    assert drafted.stats["acceptance_rate"] > 0.5, drafted.stats


@pytest.fixture(scope="module")
def heads(tiny_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("medusa")
    cfg = LLM(target=str(tiny_dirs["qwen2"]), dtype="float32", progress=False).target.config
    return {"random": random_head(root / "random", cfg, rows=list(range(0, cfg.vocab_size, 2)) + [1]),
            "authors": authors_head(root / "authors", cfg)}


@pytest.fixture(scope="module")
def llms(tiny_dirs, heads):
    return {name: LLM(target=str(tiny_dirs["qwen2"]), dtype="float32", head=str(heads[name]), progress=False)
            for name in ("random", "authors")}


@pytest.mark.parametrize("K", [1, 2, 4, 6])
@pytest.mark.parametrize("name", ["random", "authors"])
def test_greedy_identity(llms, name, K):
    check_greedy_identity(llms[name], "medusa", K)


def test_the_authors_layout_is_read_as_published(tiny_dirs, heads):
    from verispec.models.config import ModelConfig

    cfg = ModelConfig.from_hf(json.loads((Path(tiny_dirs["qwen2"]) / "config.json").read_text()))
    head, has_lm_head = read_head(heads["authors"], cfg, "tiny")
    from safetensors.torch import load_file

    sd = load_file(str(Path(heads["authors"]) / "medusa_lm_head.safetensors"))
    assert head.config.family == "medusa" and head.config.num_heads == 3 and head.config.own_lm_heads
    assert head.config.layers == (cfg.num_layers,) and not has_lm_head
    assert torch.equal(head.blocks[2][0].linear.weight, sd["2.0.linear.weight"])
    assert torch.equal(head.lm_heads[1].weight, sd["1.1.weight"])
    assert torch.equal(head.d2t, torch.arange(cfg.vocab_size))


def test_a_head_of_the_wrong_family_or_shape_is_one_line(tiny_dirs, heads, tmp_path, capsys):
    target = str(tiny_dirs["qwen2"])
    llm = LLM(target=target, dtype="float32", head=str(heads["random"]), progress=False)
    with pytest.raises(VerispecError, match=r"method eagle needs a eagle3 head, but .* is a medusa head"):
        llm.generate([1, 2, 3], SamplingParams(max_new_tokens=4), method="eagle")
    eagle = random_eagle_head(tmp_path / "eagle", llm.target.config)
    assert main(["generate", "1 2 3", "--target", target, "--dtype", "float32", "--head", str(eagle),
                 "--method", "medusa", "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert "method medusa needs a medusa head" in err and "eagle3" in err and len(err.splitlines()) == 1, err
    narrow = tmp_path / "narrow"
    authors_head(narrow, dataclasses.replace(llm.target.config, hidden_size=32))
    with pytest.raises(VerispecError, match="does not fit target"):
        LLM(target=target, dtype="float32", head=str(narrow), progress=False).draft_head()
