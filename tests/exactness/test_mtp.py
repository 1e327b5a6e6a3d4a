"""The MTP module (heads/mtp.py, drafted by drafters/head.py's MtpDrafter) keeps the output exactly the target's, and
its loader reads MiMo's, DeepSeek-V3's and Qwen3.5's namings of the module.

Loaders: one module written in each layout (with trunk tensors and an LM-head copy around it, as a whole checkpoint
holds them) reads back to the same weights; our own files are MiMo's layout. Greedy: method="mtp" gives token for
token the AR output (float32 tiny target) for a random module, K = 1..6 (sampling: test_head_laws.py).
Training: the next-next-token objective on a successor-function target raises held-out acceptance far above the
untrained module's (can fail). A module of the wrong family for the method is one line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from eagle_helpers import random_head as random_eagle_head
from test_eagle import NEW, PROMPTS, check_greedy_identity
from eagle_helpers import randomize, successor_target, train_head
from verispec import LLM, SamplingParams
from verispec.errors import VerispecError
from verispec.heads import MtpConfig, MtpHead, read_head, save_head

DEEPSEEK = {"token_layernorm.": "enorm.", "hidden_layernorm.": "hnorm.", "input_proj.": "eh_proj.",
            "final_layernorm.": "shared_head.norm."}
QWEN35 = {"token_layernorm.": "pre_fc_norm_embedding.", "hidden_layernorm.": "pre_fc_norm_hidden.",
          "input_proj.": "fc.", "final_layernorm.": "norm."}


def random_module(target_cfg, rows: list[int] | None = None, seed: int = 0, scale: float = 0.15) -> MtpHead:
    rows = list(range(target_cfg.vocab_size)) if rows is None else rows
    return randomize(MtpHead(MtpConfig.for_target(target_cfg, None, len(rows))), rows, seed, scale)


def write_layout(head: MtpHead, path: Path, layout: str) -> Path:
    """The module as a published checkpoint holds it (full vocabulary), with a trunk tensor and an LM-head copy
    around it: MiMo (model.mtp_layers.0.*), DeepSeek-V3 (model.layers.{L}.*, the module's own names) or Qwen3.5
    (mtp.*)."""
    from safetensors.torch import save_file

    L, D = head.config.layers[0], head.config.hidden_size
    sd = {}
    for name, t in head.state_dict().items():
        if name.startswith("lm_head"):
            continue
        mimo = head.public_name(name).removeprefix("model.mtp_layers.0.")  # e.g. mlp.gate_proj.weight
        if layout == "mimo":
            key = "model.mtp_layers.0." + mimo
        elif layout == "deepseek":
            key = f"model.layers.{L}." + next((mimo.replace(a, b, 1) for a, b in DEEPSEEK.items()
                                               if mimo.startswith(a)), mimo)
        else:
            part = next((mimo.replace(a, b, 1) for a, b in QWEN35.items() if mimo.startswith(a)), None)
            key = "mtp." + (part if part is not None else "layers.0." + mimo)
        sd[key] = t.detach().clone()
    sd["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(D, D)  # the trunk: not the module's
    sd["model.embed_tokens.weight"] = torch.zeros(head.config.vocab_size, D)
    if layout == "deepseek":
        sd[f"model.layers.{L}.shared_head.head.weight"] = torch.zeros(head.config.vocab_size, D)
    path.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(path / "model.safetensors"))
    cfg = head.config.to_json()
    del cfg["draft_vocab_size"]
    key = {"mimo": "num_nextn_predict_layers", "deepseek": "num_nextn_predict_layers",
           "qwen35": "mtp_num_hidden_layers"}[layout]
    (path / "config.json").write_text(json.dumps({**{k: v for k, v in cfg.items() if k != "num_nextn_predict_layers"},
                                                  key: 1}))
    return path


@pytest.fixture(scope="module")
def target_cfg(tiny_dirs):
    return LLM(target=str(tiny_dirs["qwen2"]), dtype="float32", progress=False).target.config


@pytest.fixture(scope="module")
def heads(target_cfg, tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    module = random_module(target_cfg)
    save_head(module, root / "ours", int8=False)
    return {"ours": root / "ours", "module": module,
            **{layout: write_layout(module, root / layout, layout) for layout in ("mimo", "deepseek", "qwen35")}}


@pytest.mark.parametrize("layout", ["ours", "mimo", "deepseek", "qwen35"])
def test_every_layout_reads_back_to_the_same_module(heads, target_cfg, layout):
    head, has_lm_head = read_head(heads[layout], target_cfg, "tiny")
    assert head.config.family == "mtp" and not has_lm_head and head.config.layers == (target_cfg.num_layers,)
    want = heads["module"].state_dict()
    for name, t in head.state_dict().items():
        if not name.startswith("lm_head"):  # our file (int8=False) keeps bf16 (save_head)
            expect = want[name].to(torch.bfloat16).float() if layout == "ours" else want[name]
            torch.testing.assert_close(t, expect, rtol=0, atol=0, msg=f"{layout}: {name}")
    assert torch.equal(head.d2t, heads["module"].d2t)


def test_our_files_are_mimos_layout(heads):
    from safetensors import safe_open

    with safe_open(str(heads["ours"] / "model.safetensors"), "pt") as f:
        keys = set(f.keys()) - {"d2t", "t2d"}
    assert keys and all(k.startswith("model.mtp_layers.0.") for k in keys), sorted(keys)[:5]
    for part in ("token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm", "self_attn.q_proj",
                 "mlp.gate_proj", "input_layernorm", "post_attention_layernorm"):
        assert any(k.startswith(f"model.mtp_layers.0.{part}.") for k in keys), part


@pytest.fixture(scope="module")
def llms(tiny_dirs, heads):
    return {layout: LLM(target=str(tiny_dirs["qwen2"]), dtype="float32", head=str(heads[layout]), progress=False)
            for layout in ("ours", "deepseek")}


@pytest.mark.parametrize("K", [1, 2, 4, 6])
@pytest.mark.parametrize("layout", ["ours", "deepseek"])
def test_greedy_identity(llms, layout, K):
    llm = llms[layout]
    check_greedy_identity(llm, "mtp", K)
    with pytest.raises(VerispecError, match=r"method medusa needs a medusa head, but .* is a mtp head"):
        llm.generate(PROMPTS[0], SamplingParams(max_new_tokens=4), method="medusa")


def test_heads_of_several_families_serve_their_methods_and_auto(tiny_dirs, heads, target_cfg, tmp_path):
    """--head given twice (an MTP module and an EAGLE-3 head, reading different target layers): each method drafts
    with its family's; auto explores both (each handed its own layers' features), all exact; two heads of one family
    are one line."""
    eagle = random_eagle_head(tmp_path / "eagle", target_cfg)
    llm = LLM(target=str(tiny_dirs["qwen2"]), dtype="float32", head=[str(heads["ours"]), str(eagle)], progress=False)
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    want = llm.generate(PROMPTS[1], params).token_ids
    rounds = {}
    for method in ("mtp", "eagle", "auto"):
        out = llm.generate(PROMPTS[1], params, method=method, num_draft_tokens=3)
        assert out.token_ids == want, method
        rounds[method] = {k for k, r in out.stats.get("drafter_rounds", {}).items() if r}  # delegates that drafted
    assert {h.config.family for h in llm.draft_heads()} == {"mtp", "eagle3"}
    assert {"eagle", "mtp"} <= rounds["auto"] <= {"ngram", "eagle", "mtp"}, rounds["auto"]
    assert llm.draft_head("mtp", "mtp").feature_layers != llm.draft_head("eagle", "eagle3").feature_layers
    with pytest.raises(VerispecError, match="two mtp heads given"):
        LLM(target=str(tiny_dirs["qwen2"]), dtype="float32", head=[str(heads["ours"]), str(heads["mimo"])],
            progress=False).draft_head()


def test_training_raises_heldout_acceptance_far_above_the_untrained_module(tmp_path):
    target, sigma = successor_target(tmp_path / "successor")
    llm = LLM(target=str(target), dtype="float32", progress=False)
    untrained = train_head(llm, "mtp", tmp_path / "untrained", 0, 16)
    trained = train_head(llm, "mtp", tmp_path / "trained", 200, 16)
    assert trained["heldout_acceptance"][0] > untrained["heldout_acceptance"][0] + 0.5, (untrained, trained)
    drafted = LLM(target=str(target), dtype="float32", head=str(tmp_path / "trained"), progress=False).generate(
        [5, 1], SamplingParams(max_new_tokens=24, ignore_eos=True), method="mtp", num_draft_tokens=3)
    assert drafted.token_ids == llm.generate([5, 1], SamplingParams(max_new_tokens=24, ignore_eos=True)).token_ids
    assert drafted.stats["acceptance_rate"] > 0.5, drafted.stats
