"""Training text for draft heads: files, directories and JSONL, cut into fixed-length token sequences.

A source is a directory (every text file under it: .py .md .rst .txt .c .h .js .json ...), a single text file, or a
JSONL file (or ``.jsonl.xz``) whose records carry ``"text"`` (plain text), ``"messages"`` (a conversation, put
through the chat template as it stands; with ``"answer"``, as `verispec distill` writes them, that answer is the
assistant's last turn) or ``"prompt"`` (self-distillation: the target answers it, greedily, and the sequence is the
templated prompt plus that answer). Documents are interleaved across sources in a seeded order, so any prefix of
the token budget holds some of each; a stable ~2% of documents (by name) is held out, never trained on.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..errors import VerispecError

TEXT_SUFFIXES = {".py", ".pyi", ".md", ".rst", ".txt", ".c", ".h", ".cc", ".cpp", ".js", ".ts", ".java", ".go",
                 ".rs", ".sh", ".html", ".css", ".toml", ".cfg", ".ini", ".yaml", ".yml", ".json", ".tex"}
HELDOUT_EVERY = 50  # one document in this many (by a hash of its name) is held out


@dataclass
class Document:
    name: str
    text: str | None = None  # plain text
    messages: list | None = None  # a conversation
    prompt: str | None = None  # self-distillation: the target writes the answer

    @property
    def heldout(self) -> bool:
        return int(hashlib.sha1(self.name.encode()).hexdigest(), 16) % HELDOUT_EVERY == 0


def _files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*") if p.is_file() and (p.suffix in TEXT_SUFFIXES or p.name.endswith(".rst.txt")))


def read_source(path: Path) -> list[Document]:
    """Every document of one source (one line naming the problem for a missing or unreadable one)."""
    if not path.exists():
        raise VerispecError(f"--data {path}: no such file or directory")
    docs = []
    for f in _files(path):
        if f.name.endswith((".jsonl", ".jsonl.xz")):
            docs += _jsonl(f)
            continue
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # binary or unreadable files under a directory are skipped
        if text.strip():
            docs.append(Document(str(f), text=text))
    return docs


def _jsonl(f: Path) -> list[Document]:
    import lzma

    docs = []
    text = lzma.open(f, "rt", encoding="utf-8").read() if f.suffix == ".xz" else f.read_text(encoding="utf-8")
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise VerispecError(f"--data {f}:{n}: not JSON ({e.msg})") from None
        name = str(rec["id"]) if isinstance(rec, dict) and "id" in rec else f"{f}:{n}"  # held out by id, not line
        if isinstance(rec, dict) and isinstance(rec.get("text"), str):
            docs.append(Document(name, text=rec["text"]))
        elif isinstance(rec, dict) and isinstance(rec.get("messages"), list):
            answer = rec.get("answer")
            turns = rec["messages"] + ([{"role": "assistant", "content": answer}] if isinstance(answer, str) else [])
            docs.append(Document(name, messages=turns))
        elif isinstance(rec, dict) and isinstance(rec.get("prompt"), str):
            docs.append(Document(name, prompt=rec["prompt"]))
        else:
            raise VerispecError(f"--data {f}:{n}: a record needs \"text\", \"messages\" or \"prompt\"")
    return docs


def read_corpus(paths: list[str], seed: int) -> list[Document]:
    """All sources' documents, interleaved in a seeded order."""
    per_source = []
    for p in paths:
        docs = read_source(Path(p))
        random.Random(f"{seed}:{p}").shuffle(docs)
        per_source.append(docs)
    out = []
    for i in range(max((len(d) for d in per_source), default=0)):
        out += [d[i] for d in per_source if i < len(d)]
    if not out:
        raise VerispecError(f"--data {' '.join(paths)}: no text found (empty corpus)")
    return out


def sequences(docs: list[Document], encode, seq_len: int, separator: int) -> Iterator[list[int]]:
    """Token sequences of exactly seq_len: documents' tokens back to back, each followed by ``separator``."""
    buf: list[int] = []
    for doc in docs:
        buf += encode(doc) + [separator]
        while len(buf) >= seq_len:
            yield buf[:seq_len]
            buf = buf[seq_len:]
