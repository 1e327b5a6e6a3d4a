"""Self-distillation text (training/distill.py, training/tasks.py): prompts from local text, never the bench
suite's; answers written by the target through the batched engine; a run resumes where the last one stopped."""

from __future__ import annotations

import json
import random

import pytest
import torch

from verispec import LLM, SamplingParams
from verispec.cli import main
from verispec.training import tasks as T
from verispec.training.distill import Distiller, pack


def test_a_suite_prompt_is_dropped_and_a_local_task_is_not():
    suite = T.suite_shingles()
    line = json.loads((T.resources.files("verispec.bench") / "data" / "suite.jsonl").read_text().splitlines()[0])
    assert T.overlaps_suite(line["prompt"], suite)
    assert T.overlaps_suite("Please answer: " + line["prompt"], suite)
    assert not T.overlaps_suite("Explain what this Python code does:\n\ndef f(x):\n    return x * 2", suite)


def test_code_snippets_and_tasks_from_local_sources(tmp_path):
    src = tmp_path / "mod.py"
    body = "\n".join(f"    total += {i} * x" for i in range(12))
    src.write_text(f"def scale(x):\n    total = 0\n{body}\n    return total\n\nX = 1\n")
    snippets = T.code_snippets(src)
    assert len(snippets) == 1 and snippets[0].startswith("def scale")
    follow = T.follow_up(T.Task("a", "coding", "code", [{"role": "user", "content": "q"}]), "answer", random.Random(0))
    assert [m["role"] for m in follow.messages] == ["user", "assistant", "user"] and follow.id != "a"


@pytest.mark.parametrize("raw, clean", [
    ("What is a monad in Haskell?\n\nAssistant: A monad is", "What is a monad in Haskell?"),
    ("Calculate 11/9 + 10/3.\n\nTo solve this, we", "Calculate 11/9 + 10/3."),
    ("Given this context: the sky.\n\nQuestion: what colour?", "Given this context: the sky.\n\nQuestion: what colour?"),
    ("hi", None),
    ("<|im_start|>user say something long enough here", None),
    ("なぜ空は青いのですか？", "なぜ空は青いのですか？"),  # 11 characters, 33 bytes: a whole question
    ("Warum? Weil.", None),  # 12 bytes
])
def test_self_written_user_turns_are_cleaned(raw, clean):
    assert T.clean_user_turn(raw) == clean


def test_magpie_leads_cover_every_suite_category():
    from verispec.bench.prompts import builtin_suite

    assert set(T.LEADS) == {p.category for p in builtin_suite()}
    rng, made = random.Random(0), set()
    for n in range(400):  # with no answers yet every category is drawn, the multilingual questions too
        task = T.magpie_task(rng, n)
        made.add((task.category, task.magpie_lead))
    assert {lead for c, lead in made if c == "multilingual"} >= {"Почему", "なぜ", "为什么"}


@pytest.fixture(scope="module")
def llm(tiny_dirs):
    return LLM(target=str(tiny_dirs["qwen2"]), dtype="float32", progress=False)


def test_distill_writes_the_targets_answers_and_resumes(llm, tmp_path):
    out = tmp_path / "corpus.jsonl"
    tasks = [T.Task(f"t{i}", "coding", "code", [{"role": "user", "content": f"Write a function number {i}."}])
             for i in range(6)]
    d = Distiller(llm, out, concurrency=3, max_new_tokens=8, magpie_share=0.0, follow_up_share=0.0, tasks=tasks,
                  kv_cache_tokens=2048)
    d.run(tokens=10, progress=False)
    first = [json.loads(line) for line in out.read_text().splitlines()]
    assert first and len({r["id"] for r in first}) == len(first)
    for r in first:  # greedy answers are exactly what LLM.generate gives for the same conversation
        if r["temperature"] == 0:
            want = llm.generate(r["messages"], SamplingParams(max_new_tokens=8))
            assert r["answer"] == want.text and r["answer_tokens"] == len(want.token_ids)
    again = Distiller(llm, out, concurrency=3, max_new_tokens=8, magpie_share=0.0, follow_up_share=0.0, tasks=tasks,
                      kv_cache_tokens=2048)
    assert {t.id for t in again.queue} == {t.id for t in tasks} - {r["id"] for r in first}
    again.run(tokens=10**6, progress=False)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["id"] for r in records) == sorted(t.id for t in tasks)
    manifest = pack(out)
    assert manifest["records"] == 6 and manifest["answer_tokens_by_category"] == {"coding": manifest["answer_tokens"]}
    assert (tmp_path / "corpus.jsonl.xz").exists() and (tmp_path / "manifest.json").exists()
    assert not out.exists()  # packed: a new run appends to a fresh file and resumes from the packed ids
    third = Distiller(llm, out, concurrency=3, max_new_tokens=8, magpie_share=0.0, follow_up_share=0.0,
                      tasks=tasks + [T.Task("t9", "writing", "prose", [{"role": "user", "content": "Say hi."}])],
                      kv_cache_tokens=2048)
    assert [t.id for t in third.queue] == ["t9"]
    third.run(tokens=10**6, progress=False)
    assert pack(out)["records"] == 7


def test_magpie_turn_writing_is_counted(llm, tmp_path):
    d = Distiller(llm, tmp_path / "c.jsonl", concurrency=3, max_new_tokens=8, magpie_share=1.0, follow_up_share=0.0,
                  tasks=[], kv_cache_tokens=2048)
    for _ in range(3):
        d._add(d._next_task())
    turns = [req for _, _, req, _ in d.live.values()]
    with (tmp_path / "c.jsonl").open("a") as fh:
        while d.live:
            for req in d.engine.step():
                if req.finished:
                    d._finish(*d.live.pop(req.request_id), fh)
    assert d.turns_kept + d.turns_dropped == 3 and d.turns_kept == len(d.follow_ups) == len(d.seen_turns)
    assert d.turn_tokens == sum(len(req.output_ids) for req in turns) > 0
    assert d.written_tokens == 0 and f"{d.turns_kept} kept / {d.turns_dropped} dropped" in d.turn_summary()


def test_distill_command_refuses_bad_input(tmp_path, capsys):
    assert main(["distill", "--out", str(tmp_path / "x.jsonl"), "--pack"]) == 2
    assert "no records" in capsys.readouterr().err
    assert main(["distill", "--out", str(tmp_path / "x.jsonl"), "--tokens", "0"]) == 2
    assert "--tokens must be >= 1" in capsys.readouterr().err
    assert main(["distill", "--out", str(tmp_path / "x.jsonl"), "--threads", "0"]) == 2
    assert "--threads must be >= 1" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    assert main(["distill", "--out", str(tmp_path / "file" / "x.jsonl")]) == 2
    assert "not writable" in capsys.readouterr().err


def test_train_head_reads_the_packed_corpus(tmp_path):
    """A distilled record (packed .jsonl.xz) trains as its conversation with the answer as the assistant's turn,
    and is held out by its id, not by its line (a repack keeps the split)."""
    import lzma

    from verispec.training.corpus import read_source

    recs = [{"id": f"r{i}", "messages": [{"role": "user", "content": f"q{i}"}], "answer": f"a{i}"} for i in range(3)]
    path = tmp_path / "answers.jsonl.xz"
    with lzma.open(path, "wt", encoding="utf-8") as fh:
        fh.write("".join(json.dumps(r) + "\n" for r in recs))
    docs = read_source(path)
    assert [d.name for d in docs] == ["r0", "r1", "r2"]
    assert docs[1].messages == [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"}]


def test_features_captured_by_the_batched_engine_equal_a_separate_prefill(llm):
    """Capture (Engine.add): every fed position's hidden states and top-k log-probabilities, from the forwards that
    generate (chunked prefill, decode rows, other requests in the batch), equal what one prefill of the finished
    sequence gives (extraction's features_of): the tokens are the same, the numbers within float rounding."""
    from verispec.engine import Capture, Engine
    from verispec.training.extract import features_of

    model = llm.target.model
    eng = Engine(model, num_blocks=64, block_size=4, chunk_size=8, max_num_batched_tokens=24,
                 logit_mask=llm.logit_mask)
    cap = Capture((1, 2), topk=4)
    prompts = [list(range(3, 3 + n)) for n in (21, 5, 13)]
    reqs = [eng.add(p, SamplingParams(max_new_tokens=9, temperature=0.0 if i != 1 else 1.0, seed=i),
                    capture=cap if i != 1 else None) for i, p in enumerate(prompts)]
    while eng.has_work:
        eng.step()
    for req in (reqs[0], reqs[2]):
        n = len(req.seq.prompt) + len(req.output_ids) - 1  # every position fed: all tokens but the last
        want = features_of(model, req.seq.tokens[:n + 1], cap.layers, cap.topk)
        # both as shards store them (bf16): one rounding step apart at most
        torch.testing.assert_close(req.features[:n].to(torch.bfloat16).float(), want["features"][:n].float(),
                                   atol=1e-3, rtol=2 ** -7)
        assert torch.equal(req.topk_ids[:n], want["topk_ids"][:n])
        torch.testing.assert_close(req.topk_logp[:n].float(), want["topk_logp"][:n].float(), atol=2e-3, rtol=1e-3)
    assert reqs[1].features is None and reqs[1].topk_ids is None  # a request without capture keeps nothing


def test_distill_with_features_writes_shards_train_head_trains_on(llm, tiny_dirs, tmp_path, capsys):
    """`distill --features DIR` keeps the rows of every answered prompt as shards (train and held-out, by record
    id), and `train-head --features DIR` trains on them with no --data and no extraction."""
    from verispec.engine import Capture
    from verispec.training.capture import FeatureWriter, captured
    from verispec.training.extract import shards
    from verispec.training.trainer import load_split

    from verispec.training.corpus import Document

    held = [f"t{i}" for i in range(2000) if Document(f"t{i}").heldout][:12]  # ids held out by their hash
    ids = held + [f"t{i}" for i in range(30) if f"t{i}" not in held]
    tasks = [T.Task(t, "coding", "code", [{"role": "user", "content": f"Write function {t} " * (len(t) % 3 + 1)}])
             for t in ids]
    writer = FeatureWriter(tmp_path / "f", Capture((1, 2), 4), 32, "tiny", llm.target.config.hidden_size)
    d = Distiller(llm, tmp_path / "c.jsonl", concurrency=4, max_new_tokens=6, magpie_share=0.0, follow_up_share=0.0,
                  tasks=tasks, kv_cache_tokens=4096, features=writer)
    d.run(tokens=10**6, progress=False)
    assert captured(tmp_path / "f")["layers"] == [1, 2]
    assert shards(tmp_path / "f", "train") and shards(tmp_path / "f", "heldout")
    train = load_split(tmp_path / "f", "train")
    assert train["tokens"].shape[1] == 32 and train["features"].shape[-1] == 2 * llm.target.config.hidden_size
    assert train["topk_ids"].dtype == torch.int32 and train["topk_logp"].dtype == torch.float16
    out = tmp_path / "head"
    assert main(["train-head", "--target", str(tiny_dirs["qwen2"]), "--features", str(tmp_path / "f"), "--out",
                 str(out), "--steps", "2", "--draft-vocab", "64", "--threads", "1", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "extracted" not in err and (out / "config.json").exists()
    D = llm.target.config.hidden_size  # one capture serves heads of other layers: a layer's block of it
    assert torch.equal(load_split(tmp_path / "f", "train", (1,), 2)["features"], train["features"][..., D:])
    assert main(["train-head", "--target", str(tiny_dirs["qwen2"]), "--features", str(tmp_path / "f"), "--out",
                 str(tmp_path / "medusa"), "--arch", "medusa", "--steps", "2", "--draft-vocab", "64", "--threads",
                 "1", "--no-progress"]) == 0  # reads the last layer (2) of the two kept
    assert json.loads((tmp_path / "medusa" / "config.json").read_text())["medusa_feature_layers"] == [2]
    assert main(["train-head", "--target", str(tiny_dirs["qwen2"]), "--features", str(tmp_path / "f"), "--out",
                 str(out), "--layers", "0", "--steps", "2", "--no-progress"]) == 2
    assert "holds layers 1,2, not 0" in capsys.readouterr().err


def test_a_capture_without_held_out_records_holds_out_its_last_shard(llm, tiny_dirs, tmp_path, capsys):
    """One record in 50 is held out, so a short capture may hold none: train-head then holds out the last train shard
    (and says so) rather than failing or evaluating on what it trains on."""
    from verispec.engine import Capture
    from verispec.training.capture import FeatureWriter
    from verispec.training.corpus import Document
    from verispec.training.extract import shards

    ids = [f"t{i}" for i in range(40) if not Document(f"t{i}").heldout]
    tasks = [T.Task(t, "coding", "code", [{"role": "user", "content": f"Write function {t} " * 3}]) for t in ids]
    writer = FeatureWriter(tmp_path / "f", Capture((1, 2), 4), 32, "tiny", llm.target.config.hidden_size)
    Distiller(llm, tmp_path / "c.jsonl", concurrency=4, max_new_tokens=6, magpie_share=0.0, follow_up_share=0.0,
              tasks=tasks, kv_cache_tokens=4096, features=writer).run(tokens=10**6, progress=False)
    train = shards(tmp_path / "f", "train")
    assert len(train) > 1 and not shards(tmp_path / "f", "heldout")
    assert main(["train-head", "--target", str(tiny_dirs["qwen2"]), "--features", str(tmp_path / "f"), "--out",
                 str(tmp_path / "head"), "--steps", "1", "--draft-vocab", "64", "--threads", "1",
                 "--no-progress"]) == 0
    assert f"holding out {train[-1].name}" in capsys.readouterr().err
