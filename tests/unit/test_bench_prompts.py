"""The built-in bench suite, the readers for verispec / Spec-Bench / SPEED-Bench JSONL, and select()."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from verispec.bench.prompts import DECODE_PROMPTS, Prompt, builtin_suite, load_prompts, select
from verispec.errors import VerispecError

CATEGORIES = ["coding", "math", "humanities", "stem", "writing", "summarization", "roleplay", "rag",
              "multilingual", "reasoning", "qa"]


def _write(tmp_path, rows, name="p.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r, ensure_ascii=False) for r in rows)
                    + "\n", encoding="utf-8")
    return path


def _raises(path, *fragments):
    with pytest.raises(VerispecError) as info:
        load_prompts(path)
    msg = str(info.value)
    assert "\n" not in msg and "\r" not in msg, msg
    for f in fragments:
        assert f in msg, (f, msg)
    return msg


# --- built-in suite ---------------------------------------------------------------------------------

def test_builtin_suite_shape():
    suite = builtin_suite()
    assert all(isinstance(p, Prompt) for p in suite)
    counts = Counter(p.category for p in suite)
    assert list(counts) == CATEGORIES  # first-appearance order
    assert all(n == 8 for n in counts.values()) and len(suite) == 88
    ids = [p.id for p in suite]
    assert len(set(ids)) == len(ids)
    assert all(i == i.lower() and " " not in i for i in ids)
    for p in suite:
        assert p.text.strip() and len(p.text) < 3000, p.id
        if p.category in ("summarization", "rag"):
            assert len(p.text) > 600, p.id


def test_builtin_suite_starts_with_decode_prompts():
    suite = builtin_suite()
    for cat in ("coding", "writing"):
        expected = [p for p in DECODE_PROMPTS if p.category == cat]
        assert len(expected) == 4
        assert [p for p in suite if p.category == cat][:4] == expected


def test_builtin_suite_is_a_loadable_file():
    from importlib import resources
    path = resources.files("verispec.bench").joinpath("data", "suite.jsonl")
    assert path.is_file()
    with resources.as_file(path) as real:
        assert load_prompts(real) == builtin_suite()


# --- formats ----------------------------------------------------------------------------------------

def test_verispec_format_and_blank_lines(tmp_path):
    path = _write(tmp_path, ["", {"id": "a", "category": "math", "prompt": "1+1?"}, "   ",
                             {"id": "b", "category": "qa", "prompt": "Capital of France?", "extra": 1}, ""])
    assert load_prompts(str(path)) == [Prompt("a", "math", "1+1?"), Prompt("b", "qa", "Capital of France?")]


def test_spec_bench_format_uses_first_turn(tmp_path):
    path = _write(tmp_path, [
        {"question_id": 81, "category": "writing", "turns": ["Write a travel blog post.", "Now rewrite it."]},
        {"question_id": 161, "category": "translation", "turns": ["Translate: bonjour"]},
        {"question_id": 481, "category": "math_reasoning", "turns": ["What is 12*12?"], "reference": []},
    ])
    got = load_prompts(path)
    assert got == [Prompt("81", "writing", "Write a travel blog post."),
                   Prompt("161", "translation", "Translate: bonjour"),
                   Prompt("481", "math_reasoning", "What is 12*12?")]


def test_speed_bench_hf_columns(tmp_path):
    row = {"question_id": "qual-coding-0", "category": "coding", "sub_category": "python",
           "turns": ["Write a function.", "Add tests."], "source": "some/dataset", "src_id": "x_1",
           "difficulty": "medium", "multiturn": True}
    path = _write(tmp_path, [row, dict(row, question_id="qual-rag-3", category="rag", turns=["Context: ..."],
                                       multiturn=False)])
    assert load_prompts(path) == [Prompt("qual-coding-0", "coding", "Write a function."),
                                  Prompt("qual-rag-3", "rag", "Context: ...")]


def test_speed_bench_messages(tmp_path):
    path = _write(tmp_path, [
        {"question_id": "q1", "category": "qa", "sub_category": "", "source": "s", "src_id": "1",
         "difficulty": "easy", "multiturn": True,
         "messages": [{"role": "user", "content": "First?"}, {"role": "user", "content": "Second?"}]},
        {"question_id": "q2", "category": "math",
         "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]},
    ])
    assert load_prompts(path) == [Prompt("q1", "qa", "First?"), Prompt("q2", "math", "2+2?")]


def test_unicode_line_separator_inside_a_string(tmp_path):
    path = _write(tmp_path, [{"id": "u", "category": "multilingual", "prompt": "a\u2028b\u0085c"}])
    assert load_prompts(path)[0].text == "a\u2028b\u0085c"


# --- errors -----------------------------------------------------------------------------------------

def test_missing_file(tmp_path):
    _raises(tmp_path / "nope.jsonl", "nope.jsonl", "no such file")


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_file(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    _raises(path, "empty.jsonl", "empty", "question_id, category, turns")


def test_invalid_json_names_line(tmp_path):
    path = _write(tmp_path, [{"id": "a", "category": "c", "prompt": "p"}, "", '{"id": "b", "category":'])
    _raises(path, "p.jsonl line 3", "invalid JSON")


def test_unknown_format_lists_expected_fields(tmp_path):
    path = _write(tmp_path, [{"id": "a", "category": "c", "prompt": "p"}, {"text": "hi", "label": "x"}])
    msg = _raises(path, "p.jsonl line 2", "unknown format", "{id, category, prompt} (verispec)",
                  "{question_id, category, turns} (Spec-Bench", "SPEED-Bench", "messages")
    assert "label, text" in msg


def test_not_an_object(tmp_path):
    _raises(_write(tmp_path, ['["a", "b"]']), "line 1", "not a JSON object", "{id, category, prompt}")


@pytest.mark.parametrize("turns", [[], "just a string", [1, 2], ["ok", None], None])
def test_bad_turns(tmp_path, turns):
    _raises(_write(tmp_path, [{"question_id": 1, "category": "c", "turns": turns}]),
            "line 1", "'turns' must be a non-empty list of strings")


@pytest.mark.parametrize("messages", [[], [{"role": "assistant", "content": "x"}], "x", [{"role": "user"}]])
def test_bad_messages(tmp_path, messages):
    _raises(_write(tmp_path, [{"question_id": "1", "category": "c", "messages": messages}]),
            "line 1", "'messages'")


@pytest.mark.parametrize("row", [
    {"id": "a", "category": "c", "prompt": ""},
    {"id": "a", "category": "c", "prompt": "   \n "},
    {"id": "a", "category": "c", "prompt": None},
    {"question_id": 1, "category": "c", "turns": ["", "second"]},
    {"question_id": 1, "category": "c", "messages": [{"role": "user", "content": " "}]},
])
def test_empty_prompt(tmp_path, row):
    _raises(_write(tmp_path, ["", row]), "line 2", "empty prompt")


@pytest.mark.parametrize("row, field", [
    ({"id": "", "category": "c", "prompt": "p"}, "'id'"),
    ({"id": ["x"], "category": "c", "prompt": "p"}, "'id'"),
    ({"question_id": None, "category": "c", "turns": ["p"]}, "'question_id'"),
    ({"id": "a", "category": "", "prompt": "p"}, "'category'"),
    ({"id": "a", "category": 3, "prompt": "p"}, "'category'"),
])
def test_bad_id_or_category(tmp_path, row, field):
    _raises(_write(tmp_path, [row]), "line 1", field)


def test_duplicate_id(tmp_path):
    path = _write(tmp_path, [{"question_id": 1, "category": "c", "turns": ["a"]},
                             {"question_id": "1", "category": "c", "turns": ["b"]}])
    _raises(path, "line 2", "duplicate id '1'", "line 1")


def test_mixed_formats(tmp_path):
    path = _write(tmp_path, [{"id": "a", "category": "c", "prompt": "p"},
                             {"question_id": 2, "category": "c", "turns": ["q"]}])
    _raises(path, "line 2", "one format per file")


def test_speed_bench_placeholder(tmp_path):
    row = {"question_id": "x", "category": "rag",
           "turns": ["FULL BENCHMARK DATA SHOULD BE FETCHED FROM THE SOURCE USING SPECDEC_BENCH\n\n{article}"]}
    _raises(_write(tmp_path, [row]), "line 1", "placeholder", "specdec_bench")


def test_message_is_single_line_even_with_odd_names(tmp_path):
    path = _write(tmp_path, [{"a\nb": 1}], name="odd.jsonl")
    _raises(path, "odd.jsonl line 1", "unknown format")


# --- select -----------------------------------------------------------------------------------------

def _prompts(spec: str) -> list[Prompt]:
    """'a1 a2 b1 a3 c1 b2' -> prompts with category = first letter."""
    return [Prompt(tok, tok[0], f"text {tok}") for tok in spec.split()]


def _ids(prompts):
    return " ".join(p.id for p in prompts)


def test_select_interleaves_all_categories():
    ps = _prompts("a1 a2 a3 b1 b2 c1")
    assert _ids(select(ps, None, None)) == "a1 b1 c1 a2 b2 a3"
    assert _ids(select(ps, [], None)) == "a1 b1 c1 a2 b2 a3"


def test_select_keeps_order_within_category():
    ps = _prompts("b1 a1 b2 a2 b3")
    assert _ids(select(ps)) == "b1 a1 b2 a2 b3"


def test_select_limit():
    ps = _prompts("a1 a2 a3 b1 b2 c1")
    assert _ids(select(ps, None, 2)) == "a1 b1 c1 a2 b2"
    assert _ids(select(ps, None, 1)) == "a1 b1 c1"


def test_select_categories_in_given_order():
    ps = _prompts("a1 a2 b1 b2 c1 c2")
    assert _ids(select(ps, ["c", "a"], None)) == "c1 a1 c2 a2"
    assert _ids(select(ps, ["b", "b"], 1)) == "b1"


def test_select_unknown_category():
    with pytest.raises(VerispecError) as info:
        select(_prompts("a1 b1"), ["a", "zz"], None)
    msg = str(info.value)
    assert "zz" in msg and "available: a, b" in msg and "\n" not in msg


@pytest.mark.parametrize("limit", [0, -1])
def test_select_bad_limit(limit):
    with pytest.raises(VerispecError):
        select(_prompts("a1"), None, limit)


def test_select_builtin_suite_round_robin():
    picked = select(builtin_suite(), None, 2)
    assert len(picked) == 22
    assert [p.category for p in picked[:11]] == CATEGORIES
    assert [p.category for p in picked[11:]] == CATEGORIES
    assert [p.id for p in picked[:11] if p.category in ("coding", "writing")] == ["code-lru", "prose-tides"]
