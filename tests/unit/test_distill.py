"""Self-distillation text (training/distill.py, training/tasks.py): prompts from local text, never the bench
suite's; answers written by the target through the batched engine; a run resumes where the last one stopped."""

from __future__ import annotations

import json
import random

import pytest

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
])
def test_self_written_user_turns_are_cleaned(raw, clean):
    assert T.clean_user_turn(raw) == clean


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
