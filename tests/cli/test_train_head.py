"""`verispec train-head` on a tiny target: it learns, --resume continues bit for bit, bad input is one line
(exit 2), and torchrun splits it over two processes.

Every run shares one feature directory (extracted once: the settings recorded in its features.json are the same),
so most of a test's time is training; all runs are in-process through ``verispec.cli.main`` but torchrun's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny import make_hf_dir

from verispec.cli import main
from verispec.training.corpus import Document

TORCHRUN_TIMEOUT = 180  # seconds; the run itself takes ~15 s on a busy 2-core box
PATTERN = "alpha beta gamma delta."  # strong structure: a tiny head can learn to follow the target on it


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    return str(make_hf_dir(tmp_path_factory.mktemp("target") / "qwen2", "qwen2"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """Repeated lines; the held-out split is chosen by a hash of each file's path, so pick names that give 3
    held-out documents (>= --heldout-tokens) and 40 training ones whatever the temporary directory is."""
    root = tmp_path_factory.mktemp("corpus")
    text = "\n".join([PATTERN] * 20) + "\n"  # ~480 byte tokens
    held, train, i = 0, 0, 0
    while held < 3 or train < 40:
        f = root / f"doc{i:05d}.txt"
        i += 1
        if Document(str(f)).heldout:
            if held < 3:
                f.write_text(text)
                held += 1
        elif train < 40:
            f.write_text(text)
            train += 1
    return str(root)


@pytest.fixture(scope="module")
def features(target, corpus, tmp_path_factory) -> Path:
    """The shared feature shards: extracted by a one-step run (which later runs find and skip)."""
    root = tmp_path_factory.mktemp("shared")
    assert main(args(target, corpus, root / "out", root / "features", steps=1)) == 0
    assert (root / "features" / "features.json").exists()
    return root / "features"


def args(target, corpus, out, features=None, steps=40, *extra) -> list[str]:
    a = ["train-head", "--target", str(target), "--data", str(corpus), "--out", str(out),
         "--steps", str(steps), "--extract-tokens", "4096", "--heldout-tokens", "512", "--seq-len", "64",
         "--draft-vocab", "64", "--eval-every", "50", "--ckpt-every", "100", "--lr", "3e-3", "--threads", "1",
         "--no-progress", *extra]
    if features is not None:
        a += ["--features", str(features)]
    return a


def history(out: Path) -> list[dict]:
    return json.loads((Path(out) / "history.json").read_text())


def checkpoint(out: Path) -> dict:
    return torch.load(Path(out) / "checkpoint.pt", map_location="cpu", weights_only=False)


# -- 5. training raises held-out acceptance ---------------------------------------------------------------------

ACCEPT_FIRST = 0.5  # the head's first draft matches the target's greedy pick in at least half the held-out rows
TAU = 1.8  # expected tokens per round of a 3-token chain


def test_training_raises_heldout_acceptance(target, corpus, features, tmp_path, capsys):
    # untrained (one step at a warm-up learning rate): far from the bar
    assert main(args(target, corpus, tmp_path / "one", features, 1)) == 0
    (untrained,) = history(tmp_path / "one")
    assert untrained["step"] == 1
    assert untrained["heldout_acceptance"][0] < ACCEPT_FIRST and untrained["heldout_tau"] < TAU, untrained
    capsys.readouterr()

    assert main(args(target, corpus, tmp_path / "long", features, 300)) == 0
    err = capsys.readouterr().err
    assert "extracted" not in err  # the shared features were reused, not extracted again
    assert err.count("held-out acceptance per position") == 6, err  # steps 50, 100, ..., 300
    h = history(tmp_path / "long")
    assert [r["step"] for r in h] == [50, 100, 150, 200, 250, 300]
    first, last = h[0], h[-1]
    assert last["heldout_acceptance"][0] >= ACCEPT_FIRST and last["heldout_tau"] >= TAU, last
    assert last["heldout_tau"] > first["heldout_tau"] + 0.3 and last["heldout_loss"] < first["heldout_loss"], h
    assert last["heldout_tau"] > untrained["heldout_tau"] + 0.5
    # the written head is the trained one, loads back for this target, and its config records the run
    from verispec.models.config import ModelConfig
    from verispec.heads import read_head

    cfg = json.loads((tmp_path / "long" / "config.json").read_text())
    assert cfg["verispec_training"]["step"] == 300
    tcfg = ModelConfig.from_hf(json.loads((Path(target) / "config.json").read_text()))
    head, has_lm_head = read_head(tmp_path / "long", tcfg, "tiny")
    assert not has_lm_head and head.config.draft_vocab_size == 64 and head.config.layers == (1, 2)
    state = checkpoint(tmp_path / "long")
    assert state["step"] == 300 and torch.equal(head.d2t, state["d2t"])
    fc = state["head"]["fc.weight"]
    assert (head.fc.weight - fc).abs().max() <= fc.abs().amax() / 127  # int8 file of the checkpoint's weights


def test_init_from_a_trained_head_continues_to_lower_its_heldout_loss(target, corpus, features, tmp_path, capsys):
    """Continual training (--init HEAD_DIR): the head read back (int8 file) starts where it ended and trains on;
    its family, layers and draft vocabulary are the head's. A wrong --init is one line, exit 2."""
    assert main(args(target, corpus, tmp_path / "a", features, 50)) == 0
    before = history(tmp_path / "a")[-1]
    assert main(args(target, corpus, tmp_path / "b", features, 100, "--init", str(tmp_path / "a"))) == 0
    h = history(tmp_path / "b")
    assert h[-1]["heldout_loss"] < before["heldout_loss"], (before, h)
    # one step (a warm-up learning rate: nearly no change) starts where "a" ended, far from a fresh head
    assert main(args(target, corpus, tmp_path / "one", features, 1)) == 0
    assert main(args(target, corpus, tmp_path / "a1", features, 1, "--init", str(tmp_path / "a"))) == 0
    fresh, (start, cont) = history(tmp_path / "one")[-1], history(tmp_path / "a1")
    assert start["step"] == 0 and start["train_loss"] is None  # --init: the head as read, evaluated before step 1
    assert abs(start["heldout_loss"] - before["heldout_loss"]) < 0.01 * abs(before["heldout_loss"]), (start, before)
    assert abs(cont["heldout_loss"] - before["heldout_loss"]) < 0.05 * abs(before["heldout_loss"]), (cont, before)
    assert fresh["heldout_loss"] > before["heldout_loss"] + 1.0, (fresh, before)  # 10.4 against 7.9
    a_cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    b_cfg = json.loads((tmp_path / "b" / "config.json").read_text())
    assert (b_cfg["family"], b_cfg["draft_vocab_size"]) == (a_cfg["family"], a_cfg["draft_vocab_size"])
    # --keep-draft-vocab: the head's draft tokens as they were (here the 64 highest ids, which this data would not
    # choose), not chosen again from this run's data
    from verispec.heads import read_head, save_head
    from verispec.models.config import ModelConfig

    head, _ = read_head(tmp_path / "a", ModelConfig.from_hf(json.loads((Path(target) / "config.json").read_text())))
    head.d2t = torch.arange(head.config.vocab_size - head.config.draft_vocab_size, head.config.vocab_size)
    save_head(head, tmp_path / "odd")
    for flags, kept in (["--keep-draft-vocab"], True), ([], False):
        assert main(args(target, corpus, tmp_path / f"k{kept}", features, 1, "--init", str(tmp_path / "odd"),
                         *flags)) == 0
        assert torch.equal(checkpoint(tmp_path / f"k{kept}")["d2t"], head.d2t) == kept
    # P-EAGLE from an EAGLE-3 head: its weights and draft tokens, the mask inputs new
    assert main(args(target, corpus, tmp_path / "p", features, 1, "--arch", "peagle", "--init",
                     str(tmp_path / "a"))) == 0
    assert json.loads((tmp_path / "p" / "config.json").read_text())["family"] == "peagle"
    head_a, head_p = checkpoint(tmp_path / "a")["head"], checkpoint(tmp_path / "p")["head"]
    assert set(head_p) - set(head_a) == {"mask_hidden", "mask_embed"}
    capsys.readouterr()
    assert main(args(target, corpus, tmp_path / "c", features, 1, "--keep-draft-vocab")) == 2
    assert "only with --init HEAD_DIR" in capsys.readouterr().err
    capsys.readouterr()
    assert main(args(target, corpus, tmp_path / "c", features, 1, "--init", str(tmp_path / "nowhere"))) == 2
    err = capsys.readouterr().err.strip()
    assert "--init" in err and "nowhere" in err and len(err.splitlines()) == 1
    assert main(args(target, corpus, tmp_path / "c", features, 1, "--init", str(tmp_path / "a"),
                     "--layers", "1")) == 2
    assert "reads layers" in capsys.readouterr().err
    narrow = make_hf_dir(tmp_path / "narrow", "qwen2", hidden_size=32, intermediate_size=64)  # another target
    capsys.readouterr()
    assert main(args(narrow, corpus, tmp_path / "c", tmp_path / "nf", 1, "--init", str(tmp_path / "a"))) == 2
    err = capsys.readouterr().err.strip()
    assert "does not fit" in err and len(err.splitlines()) == 1, err


def test_extracted_features_train_again_without_data(target, corpus, features, tmp_path, capsys):
    """Shards an earlier run extracted are trained on as they are when --data is left out (other steps, another
    recipe); --data then is optional only while such shards are there, and a head for another target is one line."""
    no_data = [a for a in args(target, corpus, tmp_path / "again", features, 50) if a not in ("--data", corpus)]
    assert "--data" not in no_data
    capsys.readouterr()
    assert main(no_data) == 0
    err = capsys.readouterr().err
    assert "extracted " not in err and "tokens/s)" not in err, err  # no "extracted N tokens in S s (R tokens/s)"
    assert history(tmp_path / "again")[-1]["step"] == 50, history(tmp_path / "again")
    # the same run with --data: identical (the shards are the same; nothing is extracted again)
    assert main(args(target, corpus, tmp_path / "with", features, 50)) == 0
    speed = "train_tokens_per_s"
    assert [{k: v for k, v in r.items() if k != speed} for r in history(tmp_path / "with")] == \
        [{k: v for k, v in r.items() if k != speed} for r in history(tmp_path / "again")]
    empty = [a for a in args(target, corpus, tmp_path / "e", tmp_path / "nothing", 1) if a not in ("--data", corpus)]
    capsys.readouterr()
    assert main(empty) == 2
    err = capsys.readouterr().err.strip()
    assert "--data: training text needed" in err and len(err.splitlines()) == 1, err
    narrow = make_hf_dir(tmp_path / "narrow", "qwen2", hidden_size=32, intermediate_size=64)
    capsys.readouterr()
    assert main([a for a in args(narrow, corpus, tmp_path / "n", features, 1) if a not in ("--data", corpus)]) == 2
    err = capsys.readouterr().err.strip()
    assert "made from another target" in err and len(err.splitlines()) == 1, err


# -- 6. --resume continues bit for bit -------------------------------------------------------------------------

def assert_same_training(a: dict, b: dict) -> None:
    assert a["step"] == b["step"]
    assert a["head"].keys() == b["head"].keys()
    for k in a["head"]:
        assert torch.equal(a["head"][k], b["head"][k]), k
    assert torch.equal(a["d2t"], b["d2t"])
    sa, sb = a["opt"]["state"], b["opt"]["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        for k in sa[i]:
            assert torch.equal(sa[i][k], sb[i][k]), (i, k)


def test_resume_from_shorter_run_equals_one_run(target, corpus, features, tmp_path):
    """--steps 20, then --resume --steps 40 == --steps 40 in one go (all within the warm-up, whose learning rate
    does not depend on --steps)."""
    assert main(args(target, corpus, tmp_path / "whole", features, 40)) == 0
    assert main(args(target, corpus, tmp_path / "split", features, 20)) == 0
    first = checkpoint(tmp_path / "split")
    assert first["step"] == 20
    assert main(args(target, corpus, tmp_path / "split", features, 40, "--resume")) == 0
    whole, split = checkpoint(tmp_path / "whole"), checkpoint(tmp_path / "split")
    assert_same_training(whole, split)
    assert not torch.equal(first["head"]["fc.weight"], split["head"]["fc.weight"])  # it did train on
    assert (tmp_path / "split" / "model.safetensors").read_bytes() == (tmp_path / "whole" / "model.safetensors").read_bytes()


def test_resume_after_interruption_equals_one_run(target, corpus, features, tmp_path, monkeypatch, capsys):
    """A run of 80 steps (past the warm-up, into the cosine decay) stopped after its checkpoint at step 60 and
    resumed with the same arguments ends exactly where the uninterrupted run does."""
    from verispec.training import trainer

    extra = ("--ckpt-every", "30", "--eval-every", "40")
    assert main(args(target, corpus, tmp_path / "whole", features, 80, *extra)) == 0

    save = trainer.Trainer.save

    def save_then_stop(self):
        save(self)
        if self.step == 60:
            raise KeyboardInterrupt

    monkeypatch.setattr(trainer.Trainer, "save", save_then_stop)
    assert main(args(target, corpus, tmp_path / "cut", features, 80, *extra)) == 130
    assert checkpoint(tmp_path / "cut")["step"] == 60
    monkeypatch.setattr(trainer.Trainer, "save", save)
    capsys.readouterr()
    assert main(args(target, corpus, tmp_path / "cut", features, 80, *extra, "--resume")) == 0
    assert "steps 60..80" in capsys.readouterr().err
    whole, cut = checkpoint(tmp_path / "whole"), checkpoint(tmp_path / "cut")
    assert_same_training(whole, cut)
    strip = [{k: v for k, v in r.items() if k != "train_tokens_per_s"} for r in whole["history"]]
    assert strip == [{k: v for k, v in r.items() if k != "train_tokens_per_s"} for r in cut["history"]]
    assert [r["step"] for r in cut["history"]] == [40, 80]


# -- 7. bad input: exit 2, one line ----------------------------------------------------------------------------

def one_error_line(argv, capsys) -> str:
    capsys.readouterr()
    rc = main(argv)
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert rc == 2, err
    assert len(lines) == 1 and lines[0].startswith("verispec: error:"), err
    return lines[0]


def test_error_missing_data(target, tmp_path, capsys):
    line = one_error_line(args(target, tmp_path / "no-such-corpus", tmp_path / "out"), capsys)
    assert "--data" in line and "no-such-corpus" in line, line


def test_error_empty_corpus(target, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "blank.txt").write_text("  \n\n")
    (empty / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    (empty / "sub").mkdir()
    line = one_error_line(args(target, empty, tmp_path / "out"), capsys)
    assert "empty corpus" in line or "no text" in line, line


def test_error_unwritable_out(target, corpus, tmp_path, capsys):
    (tmp_path / "file").write_text("a regular file")
    line = one_error_line(args(target, corpus, tmp_path / "file" / "out"), capsys)
    assert "--out" in line and "not writable" in line, line


def test_error_resume_without_checkpoint(target, corpus, tmp_path, capsys):
    line = one_error_line(args(target, corpus, tmp_path / "fresh", None, 40, "--resume"), capsys)
    assert "--resume" in line and "checkpoint" in line, line


def test_error_negative_step_weight(target, corpus, tmp_path, capsys):
    line = one_error_line(args(target, corpus, tmp_path / "out", None, 1, "--step-weight", "-0.5"), capsys)
    assert "--step-weight -0.5" in line and ">= 0" in line, line


def test_error_unknown_arch(target, corpus, tmp_path, capsys):
    """--arch takes the families with a training recipe (training/recipes/)."""
    line = one_error_line(args(target, corpus, tmp_path / "out", None, 1, "--arch", "medusa-9"), capsys)
    assert "--arch" in line and "eagle3" in line, line


def test_head_layers(target, corpus, features, tmp_path, capsys):
    """--head-layers: a deeper P-EAGLE head (its layers after the first are extra.*; --mask-first-hidden recorded),
    one line for an MTP module (one layer), a depth other than the --init head's, or a mask option on EAGLE-3."""
    assert main(args(target, corpus, tmp_path / "deep", features, 1, "--arch", "peagle", "--head-layers", "2",
                     "--mask-first-hidden")) == 0
    config = json.loads((tmp_path / "deep" / "config.json").read_text())
    assert config["num_hidden_layers"] == 2 and config["mask_reads_first_hidden"] is True
    assert any(k.startswith("extra.0.") for k in checkpoint(tmp_path / "deep")["head"])
    line = one_error_line(args(target, corpus, tmp_path / "m", tmp_path / "mf", 1, "--arch", "mtp", "--head-layers",
                               "2"), capsys)
    assert "--head-layers" in line and "one decoder layer" in line, line
    line = one_error_line(args(target, corpus, tmp_path / "c", features, 1, "--arch", "peagle", "--init",
                               str(tmp_path / "deep"), "--head-layers", "3"), capsys)
    assert "--head-layers 3" in line and "has 2" in line, line
    line = one_error_line(args(target, corpus, tmp_path / "e", features, 1, "--mask-first-hidden"), capsys)
    assert "--mask-first-hidden: only for a new --arch peagle head" in line, line


@pytest.mark.parametrize("layers,expect", [("x", "layer numbers"), ("1,x", "layer numbers"), (",", "at least one"),
                                           ("1,3", "3"), ("-1", "-1")])
def test_error_bad_layers(target, corpus, features, tmp_path, capsys, layers, expect):
    line = one_error_line(args(target, corpus, tmp_path / "out", features, 1, f"--layers={layers}"), capsys)
    assert "--layers" in line and expect in line, line


# -- 8. torchrun: two processes -------------------------------------------------------------------------------

def test_torchrun_two_processes(target, corpus, tmp_path):
    out = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "verispec.cli", *args(target, corpus, out, None, 20, "--eval-every", "10", "--ckpt-every", "10")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=TORCHRUN_TIMEOUT, env=env, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    assert p.stderr.count("head written to") == 1, p.stderr[-3000:]  # rank 0 reports, rank 1 does not
    # both ranks extracted their own shares
    names = sorted(f.name for f in (out / "features").glob("*.safetensors"))
    assert any("-r0-" in n for n in names) and any("-r1-" in n for n in names), names
    assert (out / "model.safetensors").exists() and (out / "config.json").exists()
    state = checkpoint(out)
    assert state["step"] == 20 and [r["step"] for r in state["history"]] == [10, 20]
    assert all(torch.isfinite(t).all() for t in state["head"].values())


def test_suite_eval_scores_the_targets_answers_to_the_suite(target, corpus, features, tmp_path, capsys,
                                                            monkeypatch):
    """--suite-eval N: at each evaluation the head is also scored on the target's greedy answers to the suite's first
    N prompts a category, on the answer rows only (the rows a drafter meets); a negative N is one line, exit 2."""
    from verispec.bench.prompts import builtin_suite, select
    from verispec.training import extract

    seen = []
    real = extract.suite_answers

    def spy(*a, **k):
        seen.extend(real(*a, **k))
        return seen

    monkeypatch.setattr(extract, "suite_answers", spy)
    assert main(args(target, corpus, tmp_path / "s", features, 50, "--suite-eval", "1")) == 0
    assert 0 < len(seen) <= len(select(builtin_suite(), None, 1))  # prompts the tiny context holds
    (rec,) = history(tmp_path / "s")
    assert len(rec["suite_acceptance"]) == 3 and all(0 <= a <= 1 for a in rec["suite_acceptance"])
    assert "suite answers" in capsys.readouterr().err
    for row in seen:  # the rows counted are exactly those before each answer token
        n_answer = int(row["answer"].sum())
        assert 0 < n_answer < len(row["tokens"]) - 1
        assert not row["answer"][: len(row["tokens"]) - n_answer - 1].any() and not row["answer"][-1]
    assert "--suite-eval" in one_error_line(args(target, corpus, tmp_path / "n", features, 1, "--suite-eval", "-1"),
                                            capsys)
