"""Prompts for `verispec bench`: the built-in suite and readers for external prompt suites.

The built-in suite (``data/suite.jsonl``, written for this project) has 8 prompts in each of the 11
qualitative categories of SPEED-Bench. :func:`load_prompts` reads a user JSONL file, one object a line:

* verispec:    ``{"id", "category", "prompt"}``
* Spec-Bench:  ``{"question_id", "category", "turns": [str, ...]}`` (data/spec_bench/question.jsonl)
* SPEED-Bench: the same ``question_id``/``category``/``turns`` columns (plus sub_category, source, src_id,
  difficulty, multiturn), or ``messages: [{"role", "content"}, ...]`` in place of ``turns``.

Only the first turn (first user message) is used. Evidence for the SPEED-Bench shapes: the dataset card of
https://huggingface.co/datasets/nvidia/SPEED-Bench lists for every config (qualitative, throughput_*k) the
features question_id (string), category, sub_category, turns (list of string), source, src_id, difficulty,
multiturn; it is released as parquet, so we assume a JSONL export keeps those columns row by row (as
``datasets``' ``to_json`` does). NVIDIA-NeMo/Skills nemo_skills/dataset/speed-bench/prepare.py writes
``<config>.jsonl`` with ``turns`` replaced by ``messages`` [{"role": "user", "content": turn}, ...]. Rows of the
raw release whose text is a placeholder ("FULL BENCHMARK DATA SHOULD BE FETCHED FROM THE SOURCE USING
SPECDEC_BENCH") must be resolved first (Model-Optimizer examples/specdec_bench, or that prepare.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ..errors import ConfigError, VerispecError


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    text: str


DECODE_PROMPTS = (  # code and prose alternate, so --limit N keeps both kinds
    Prompt("code-lru", "coding", "Write a Python class LRUCache with get and put methods in O(1) time. "
           "Include type hints and a short docstring."),
    Prompt("prose-tides", "writing", "Explain to a curious ten-year-old why the sea has tides, in two short "
           "paragraphs."),
    Prompt("code-csv", "coding", "Write a Python function that reads a CSV file, groups rows by the 'region' "
           "column and returns the mean of the 'sales' column per region, without pandas."),
    Prompt("prose-email", "writing", "Write a polite email to a landlord asking for the heating to be repaired "
           "before the weekend."),
    Prompt("code-bsearch", "coding", "Implement binary search over a sorted list in Python, returning the index "
           "of the target or -1, and add three doctest examples."),
    Prompt("prose-story", "writing", "Write the opening paragraph of a short story about a lighthouse keeper who "
           "finds a message in a bottle."),
    Prompt("code-js-debounce", "coding", "Write a JavaScript debounce(fn, wait) function and show how to use it "
           "on a window resize handler."),
    Prompt("prose-review", "writing", "Write a short, balanced review of a neighbourhood cafe that has great "
           "coffee but slow service."),
)

_EXPECTED = ("expected {id, category, prompt} (verispec), {question_id, category, turns} (Spec-Bench, "
             "SPEED-Bench) or {question_id, category, messages} (SPEED-Bench prepared by NeMo-Skills)")
_PLACEHOLDER = "FULL BENCHMARK DATA SHOULD BE FETCHED FROM THE SOURCE"


def builtin_suite() -> list[Prompt]:
    """The shipped suite: 8 prompts in each of SPEED-Bench's 11 qualitative categories."""
    data = resources.files("verispec.bench").joinpath("data", "suite.jsonl")
    return _parse(data.read_text(encoding="utf-8"), "built-in suite.jsonl")


def load_prompts(path: str | Path) -> list[Prompt]:
    """Read a prompt file in verispec, Spec-Bench or SPEED-Bench JSONL format (detected per file)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise _error(f"bench prompts: {path}: no such file") from None
    except (OSError, UnicodeError) as e:
        raise _error(f"bench prompts: {path}: cannot read ({e})") from None
    return _parse(text, str(path))


def select(prompts: list[Prompt] | tuple[Prompt, ...], categories: list[str] | None = None,
           limit_per_category: int | None = None) -> list[Prompt]:
    """Keep `categories` (None or empty: all, in order of first appearance), at most `limit_per_category`
    prompts each, then interleave the categories round-robin so that a cut-short run has covered all of them."""
    by_category: dict[str, list[Prompt]] = {}
    for p in prompts:
        by_category.setdefault(p.category, []).append(p)
    if categories:
        unknown = [c for c in categories if c not in by_category]
        if unknown:
            raise _error(f"bench prompts: unknown categor{'y' if len(unknown) == 1 else 'ies'} "
                         f"{', '.join(map(repr, unknown))}; available: {', '.join(by_category) or 'none'}")
        by_category = {c: by_category[c] for c in dict.fromkeys(categories)}
    if limit_per_category is not None:
        if isinstance(limit_per_category, bool) or not isinstance(limit_per_category, int) \
                or limit_per_category < 1:
            raise ConfigError(f"bench prompts: limit per category must be a positive integer, "
                              f"got {limit_per_category!r}")
        by_category = {c: ps[:limit_per_category] for c, ps in by_category.items()}
    columns = list(by_category.values())
    depth = max((len(col) for col in columns), default=0)
    return [col[i] for i in range(depth) for col in columns if i < len(col)]


def _error(message: str) -> VerispecError:
    """A VerispecError whose message is one line, whatever file names or field names it quotes."""
    return VerispecError(message.replace("\r", "\\r").replace("\n", "\\n"))


def _parse(text: str, name: str) -> list[Prompt]:
    prompts: list[Prompt] = []
    first_fmt: tuple[str, int] | None = None
    seen: dict[str, int] = {}
    # split on "\n" only: str.splitlines() would also split inside strings holding U+2028 and friends
    for lineno, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        where = f"bench prompts: {name} line {lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise _error(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict):
            raise _error(f"{where}: not a JSON object; {_EXPECTED}")
        fmt, prompt = _record(obj, where)
        if first_fmt is None:
            first_fmt = (fmt, lineno)
        elif fmt != first_fmt[0]:
            raise _error(f"{where}: {fmt} record, but line {first_fmt[1]} is {first_fmt[0]}; "
                         f"use one format per file")
        if prompt.id in seen:
            raise _error(f"{where}: duplicate id {prompt.id!r} (first on line {seen[prompt.id]})")
        seen[prompt.id] = lineno
        prompts.append(prompt)
    if not prompts:
        raise _error(f"bench prompts: {name}: empty file, no prompts; {_EXPECTED}")
    return prompts


def _record(obj: dict, where: str) -> tuple[str, Prompt]:
    """(format, prompt) of one JSONL object; format: 'verispec', 'turns' or 'messages'."""
    if {"id", "category", "prompt"} <= obj.keys():
        fmt, rid, text = "verispec", obj["id"], obj["prompt"]
    elif {"question_id", "category", "turns"} <= obj.keys():
        turns = obj["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise _error(f"{where}: 'turns' must be a non-empty list of strings")
        fmt, rid, text = "turns", obj["question_id"], turns[0]
    elif {"question_id", "category", "messages"} <= obj.keys():
        msgs = obj["messages"]
        users = [m.get("content") for m in msgs if isinstance(m, dict) and m.get("role") == "user"] \
            if isinstance(msgs, list) else []
        if not users or not isinstance(users[0], str):
            raise _error(f"{where}: 'messages' must be a list of {{role, content}} with a user message")
        fmt, rid, text = "messages", obj["question_id"], users[0]
    else:
        fields = ", ".join(sorted(obj)[:10]) + (", ..." if len(obj) > 10 else "")
        raise _error(f"{where}: unknown format (fields: {fields or 'none'}); {_EXPECTED}")
    id_field = "id" if fmt == "verispec" else "question_id"
    if isinstance(rid, bool) or not isinstance(rid, (str, int)) or not str(rid).strip():
        raise _error(f"{where}: '{id_field}' must be a non-empty string or an integer")
    category = obj["category"]
    if not isinstance(category, str) or not category.strip():
        raise _error(f"{where}: 'category' must be a non-empty string")
    if not isinstance(text, str) or not text.strip():
        raise _error(f"{where}: empty prompt")
    if text.startswith(_PLACEHOLDER):
        raise _error(f"{where}: unresolved SPEED-Bench placeholder; fetch the full data first "
                     f"(Model-Optimizer examples/specdec_bench or NeMo-Skills speed-bench prepare.py)")
    return fmt, Prompt(str(rid), category, text)
