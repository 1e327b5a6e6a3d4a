"""`verispec generate --method eagle --head DIR`: the AR text, and one error line for a head that cannot run."""

from __future__ import annotations

import json

import pytest
from eagle_helpers import random_head
from test_cli import assert_one_error_line, gen, run_main

from verispec import LLM, SamplingParams


@pytest.fixture(scope="module")
def setup(tiny_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle_cli")
    target = str(tiny_dirs["qwen2"])
    cfg = LLM(target, dtype="float32", progress=False).target.config
    other = LLM(str(tiny_dirs["qwen3"]), dtype="float32", progress=False).target.config
    return {"target": target, "head": str(random_head(root / "head", cfg)),
            "other": str(random_head(root / "other", other.__class__(**{**other.__dict__, "hidden_size": 96}))),
            "root": root}


def test_eagle_prints_the_ar_text(capsys, setup):
    runs = {}
    for method in ("ar", "eagle"):
        rc, out, err = run_main(capsys, gen(setup["target"], "--method", method, "--head", setup["head"], "--json",
                                            "--max-new-tokens", "20", "--no-stream"))
        assert rc == 0, err
        runs[method] = json.loads(out.splitlines()[-1])
    assert runs["eagle"]["token_ids"] == runs["ar"]["token_ids"]
    assert runs["eagle"]["stats"]["drafted_tokens"] > 0


def test_eagle_streams_the_generated_text(setup):
    llm = LLM(setup["target"], dtype="float32", head=setup["head"], progress=False)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    pieces = list(llm.stream("Hello", params, method="eagle", num_draft_tokens=3))
    assert llm.last_output.token_ids == llm.generate("Hello", params).token_ids
    assert "".join(pieces) == llm.last_output.text and len(pieces) > 1


@pytest.mark.parametrize("case", ["missing", "no_config", "mismatch", "corrupt"])
def test_bad_heads_are_one_line(capsys, setup, case):
    root = setup["root"]
    if case == "missing":
        head = root / "nope"
    elif case == "no_config":
        head = root / "empty"
        head.mkdir(exist_ok=True)
    elif case == "mismatch":
        head = setup["other"]
    else:
        head = root / "corrupt"
        head.mkdir(exist_ok=True)
        (head / "config.json").write_text((root / "head" / "config.json").read_text())
        (head / "model.safetensors").write_bytes(b"\x00garbage" * 50)
    for method in ("eagle", "auto"):  # a head asked for is never skipped, whichever method would use it
        rc, out, err = run_main(capsys, gen(setup["target"], "--method", method, "--head", str(head)))
        assert_one_error_line(rc, out, err)
        assert "head" in err
    if case == "mismatch":
        assert "hidden_size 96 != 64" in err
