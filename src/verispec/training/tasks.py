"""Training prompts without a hub, for self-distillation: tasks seeded from local text, and user turns the target
writes itself.

- code tasks (OSS-Instruct, Wei et al. 2023): a function or class cut from an installed Python source (the
  standard library, site-packages) with an instruction: explain it, write tests, find a bug, complete it,
  translate it to another language, document it;
- prose tasks over Debian's documentation (/usr/share/doc READMEs and NEWS): summarise, answer from the passage,
  rewrite, translate;
- self-written user turns (Magpie, Xu et al. 2024): the target continues its chat template's user prefix (with a
  short lead-in that steers it to one of the bench suite's categories) and the turn it writes becomes a prompt;
- follow-ups: a second user turn after an answer (multi-turn).

Evaluation sets are never training data: :func:`overlaps_suite` drops any prompt that shares an 8-word run with
the bench suite's prompts; Spec-Bench, SPEED-Bench, MT-bench and HumanEval are never read here.
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import json
import random
import re
import sysconfig
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

SHINGLE = 8  # words: a prompt sharing a run this long with an evaluation prompt is dropped

CODE_ASKS = (
    ("coding", "Explain what this Python code does, step by step, and point out any edge cases:\n\n```python\n{src}\n```"),
    ("coding", "Write pytest unit tests for the following Python code. Cover normal cases and edge cases.\n\n"
               "```python\n{src}\n```"),
    ("coding", "Review this Python code. Is there a bug, a performance problem or a readability issue? Suggest an "
               "improved version.\n\n```python\n{src}\n```"),
    ("coding", "Translate this Python code to {lang}, keeping the behaviour the same:\n\n```python\n{src}\n```"),
    ("coding", "Add type hints and a clear docstring to this function, and explain your choices briefly:\n\n"
               "```python\n{src}\n```"),
    ("coding", "Here is the start of a Python function. Complete it sensibly and explain the design:\n\n"
               "```python\n{head}\n```"),
    ("stem", "What algorithm or data structure does this code rely on? Explain its time and space complexity.\n\n"
             "```python\n{src}\n```"),
)
LANGS = ("JavaScript", "Go", "Rust", "C++", "Java", "TypeScript", "C#")
PROSE_ASKS = (
    ("summarization", "Summarize the following text in a few sentences:\n\n{text}"),
    ("summarization", "Give a bullet-point summary of the key points of this document:\n\n{text}"),
    ("rag", "Using only the passage below, answer: what is this software for, and what changed or is notable?\n\n"
            "Passage:\n{text}"),
    ("rag", "Read the passage and answer the question.\n\nPassage:\n{text}\n\nQuestion: what should a user know "
            "before installing or using this?"),
    ("writing", "Rewrite the following text so that it is clearer and friendlier for a beginner:\n\n{text}"),
    ("multilingual", "Translate the following text into {human}:\n\n{text}"),
)
HUMAN_LANGS = ("French", "German", "Spanish", "Chinese", "Japanese", "Portuguese", "Italian", "Russian")
# Magpie lead-ins: the first words of a user turn the target then completes, one set per suite category
LEADS = {
    "math": ("Solve", "Calculate", "Prove that", "A train", "What is the probability", "Find all"),
    "reasoning": ("Puzzle:", "If all", "Which of the following", "Three friends", "Is it logical"),
    "roleplay": ("Pretend you are", "Act as", "You are a", "Let's play a game where you"),
    "humanities": ("Why did", "Discuss", "What were the causes", "Compare the philosophy"),
    "stem": ("Explain how", "What is the difference between", "How does", "Describe the process"),
    "qa": ("What is", "Who", "When", "How many", "Where"),
    "writing": ("Write a", "Compose", "Draft an email", "Write a short story"),
    # translation, and questions asked in the language they are to be answered in (the head meets both)
    "multilingual": ("Traduis", "Übersetze", "¿Cómo", "请", "Explique en français", "Warum", "¿Por qué", "Pourquoi",
                     "为什么", "なぜ", "Por que", "Perché", "Почему"),
    "coding": ("Write a Python", "How do I", "Implement", "Fix this code", "Write a SQL query"),
    "summarization": ("Summarize", "TL;DR"),
    "rag": ("Based on the following", "Given this context"),
}
FOLLOW_UPS = ("Can you make that shorter?", "Explain the most important part in more detail.",
              "Give me a concrete example.", "What are the limitations of this?",
              "Now do the same in a different way.", "Thanks! Can you summarize it in one sentence?")


@dataclass
class Task:
    id: str
    category: str
    source: str  # code | prose | magpie | follow-up
    messages: list[dict] = field(default_factory=list)  # the conversation so far (the last turn is the user's)
    magpie_lead: str | None = None  # magpie: the user turn is still to be written by the target


def _id(*parts: str) -> str:
    return hashlib.sha1("\x00".join(parts).encode()).hexdigest()[:16]


def python_sources(limit_files: int = 4000) -> list[Path]:
    """Installed Python files: the standard library first, then site-packages (tests and vendored copies left out)."""
    roots = [Path(sysconfig.get_paths()["stdlib"]), Path(sysconfig.get_paths()["purelib"])]
    files = []
    for root in roots:
        for p in sorted(root.rglob("*.py")):
            if any(part in ("test", "tests", "idlelib", "_vendor", "verispec") for part in p.parts):
                continue
            files.append(p)
    return files[:limit_files] if limit_files else files


def code_snippets(path: Path, max_chars: int = 1800) -> list[str]:
    """Top-level functions and small classes of one file, as source text."""
    try:
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return []
    out = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            src = ast.get_source_segment(text, node) or ""
            if 200 <= len(src) <= max_chars:
                out.append(src)
    return out


def prose_passages(root: Path = Path("/usr/share/doc"), max_chars: int = 1200) -> list[tuple[str, str]]:
    """(name, passage) from Debian's package documentation: READMEs and NEWS, gzipped or not (changelogs left out).
    Passages stay short (~300 tokens): a summary or an answer is ~150-230 tokens whatever the passage's length, so
    the prefill of a long one costs more than the answer it buys (docs/BENCHMARKS.md, "Self-distilled data")."""
    out = []
    for p in sorted(root.rglob("*")):
        name = p.name.lower()
        if not p.is_file() or "changelog" in name or "copyright" in name:
            continue
        if not (name.startswith("readme") or name.startswith("news") or name.endswith((".md", ".txt"))):
            continue
        try:
            raw = gzip.open(p).read() if name.endswith(".gz") else p.read_bytes()
            text = raw.decode("utf-8")
        except (OSError, UnicodeDecodeError, EOFError):
            continue
        paragraphs = [t.strip() for t in re.split(r"\n\s*\n", text) if len(t.strip()) > 80]
        buf = ""
        for para in paragraphs:
            if len(buf) + len(para) > max_chars:
                if len(buf) > 400:
                    out.append((str(p), buf))
                buf = ""
            buf = f"{buf}\n\n{para}" if buf else para[:max_chars]
        if len(buf) > 400:
            out.append((str(p), buf))
    return out


def suite_shingles() -> set[tuple[str, ...]]:
    """Every 8-word run of the bench suite's prompts (the evaluation set shipped with verispec)."""
    from ..bench.prompts import DECODE_PROMPTS

    texts = [p.text for p in DECODE_PROMPTS]
    suite = resources.files("verispec.bench") / "data" / "suite.jsonl"
    for line in suite.read_text(encoding="utf-8").splitlines():
        if line.strip():
            texts.append(json.loads(line)["prompt"])
    return {s for t in texts for s in _shingles(t)}


def _shingles(text: str) -> set[tuple[str, ...]]:
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i:i + SHINGLE]) for i in range(max(len(words) - SHINGLE + 1, 0))}


def overlaps_suite(text: str, suite: set[tuple[str, ...]]) -> bool:
    return not _shingles(text).isdisjoint(suite)


def seeded_tasks(seed: int = 0) -> list[Task]:
    """Code and prose tasks from local text, shuffled (seeded), each id stable across runs (resumable)."""
    rng = random.Random(seed)
    tasks = []
    for path in python_sources():
        for src in code_snippets(path):
            category, ask = rng.choice(CODE_ASKS)
            head = "\n".join(src.splitlines()[: max(3, len(src.splitlines()) // 3)])
            prompt = ask.format(src=src, head=head, lang=rng.choice(LANGS))
            tasks.append(Task(_id("code", str(path), src[:80], ask), category, "code",
                              [{"role": "user", "content": prompt}]))
    for name, text in prose_passages():
        category, ask = rng.choice(PROSE_ASKS)
        prompt = ask.format(text=text, human=rng.choice(HUMAN_LANGS))
        tasks.append(Task(_id("prose", name, text[:80], ask), category, "prose", [{"role": "user", "content": prompt}]))
    rng.shuffle(tasks)
    return tasks


def magpie_task(rng: random.Random, n: int, tokens: dict[str, int] | None = None) -> Task:
    """A user turn for the target to write, in a category drawn with weight 1 / (its answer tokens so far + 5000):
    the categories the local text feeds least (roleplay, qa, reasoning) catch up with code and prose."""
    names = sorted(LEADS)
    tokens = tokens or {}
    category = rng.choices(names, weights=[1.0 / (tokens.get(c, 0) + 5000) for c in names])[0]
    lead = rng.choice(LEADS[category])
    return Task(_id("magpie", str(n), lead), category, "magpie", magpie_lead=lead)


def follow_up(task: Task, answer: str, rng: random.Random) -> Task:
    messages = [*task.messages, {"role": "assistant", "content": answer},
                {"role": "user", "content": rng.choice(FOLLOW_UPS)}]
    return Task(_id(task.id, "follow-up", messages[-1]["content"]), task.category, "follow-up", messages)


def clean_user_turn(text: str) -> str | None:
    """A self-written user turn, or None when it is unusable (too short or long, repetitive, a template leak)."""
    text = re.split(r"\n\s*(?:Assistant|ASSISTANT|Answer|Solution|Response)\b", text.strip())[0].strip()
    first, _, rest = text.partition("\n\n")
    answering = rest.lstrip().startswith(("To ", "Sure", "Here", "Let's", "Let me", "First", "Step", "The answer"))
    if rest and (first.rstrip().endswith("?") or answering):  # a request, then the model answering it itself
        text = first.strip()
    # at least 20 bytes of UTF-8: a question of 7 CJK characters is a whole one, "Why?" is not
    if not 20 <= len(text.encode("utf-8")) or len(text) > 1500 or "<|im_" in text or "assistant" == text.lower()[:9]:
        return None
    words = text.split()
    if len(set(words)) < 0.4 * len(words):
        return None
    return text
