"""A smaller LM head for the draft model: only the tokens it emits most (FR-Spec, Zhao et al. 2025,
arXiv:2502.14856).

With Qwen's 151,936-token vocabulary the LM head is about a quarter of the weight bytes a 0.5B draft
step reads. Kept to the N most frequent tokens, a draft step reads less; the verifier is unchanged, so
the output distribution is still exactly the target's for every N: the draft can only propose tokens
of the set (its q is 0 elsewhere), and recovered and bonus tokens come from the target's full
distribution. What N costs is acceptance: a target token outside the set can never be drafted.

The default draft keeps 49,152 rows (models/registry.py): its packaged table, counted from model samples and a
code corpus, covers nearly all of the target's code tokens at 49k rows, and gave the same acceptance as the full
head with a cheaper draft step; a table from model samples alone cost more acceptance on code at 32k or 49k rows
than it saved (measured: docs/BENCHMARKS.md, "Draft vocabulary"). Other drafts keep their full head unless
asked.

The frequency ranking ships per tokenizer (``data/*.draft-vocab``) and is rebuilt with
``python -m verispec.draft_vocab --model NAME --out FILE``: the draft model answers a fixed set of
seed prompts (``SEED_PROMPTS``, none from the benchmark suite) by sampling at T=1, and at every
generated position its whole next-token distribution is added to the counts, so a token's score is
the number of times the model expects to emit it (smoother than counting the sampled tokens alone).
With ``--corpus PATH ...`` the tokens of the text files under those paths are counted too (source code,
documentation), and the two counts, each normalized to a total of 1, are added: a few thousand sampled
positions miss many of the identifiers, operators and word pieces that real code and prose use.

File format: 8-byte magic, uint32 vocabulary size, uint32 n, then n uint32 token ids, most frequent
first (little-endian).
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import torch

from .errors import VerispecError

MAGIC = b"VSDVOCAB"
DATA_DIR = Path(__file__).parent / "data"

SEED_PROMPTS = (
    # code, several languages
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Implement a stack class in Java with push, pop and peek.",
    "Write a SQL query that returns the ten customers with the highest total order value.",
    "Explain what this does: `for i in range(len(xs)): xs[i] = xs[i] ** 2`, and rewrite it idiomatically.",
    "Write a Rust function that counts the words in a string.",
    "Write a bash script that renames every .jpeg file in a directory to .jpg.",
    "Write a C function that reverses a linked list in place.",
    "Write a TypeScript interface for a blog post and a function that sorts posts by date.",
    "Write a Go HTTP handler that returns the current time as JSON.",
    "Fix the bug: def mean(xs): return sum(xs) / len(xs) - it crashes on an empty list.",
    "Write unit tests with pytest for a function is_palindrome(s).",
    "Write a regular expression that matches ISO 8601 dates and explain each part.",
    "Write a C++ class for a 2D vector with addition and dot product operators.",
    "Write a React component that shows a counter with increment and reset buttons.",
    "Explain the difference between a process and a thread, with a short Python example of each.",
    "Write a Dockerfile for a small Flask application.",
    # prose, explanation, advice
    "Write a short story about a robot that learns to paint.",
    "Write a cover letter for a junior data analyst position.",
    "Describe a walk through a forest in autumn.",
    "Write a haiku sequence about the sea.",
    "Give me five tips for sleeping better.",
    "Explain how vaccines train the immune system.",
    "Why is the sky blue? Explain for a high-school student.",
    "Summarize the causes of the First World War in one paragraph.",
    "What are the pros and cons of working from home?",
    "Explain photosynthesis step by step.",
    "Write a product description for a reusable water bottle.",
    "Describe the plot of a mystery novel set on a train, without spoiling the ending.",
    "Write a dialogue between a customer and a bookshop owner.",
    "Plan a three-day trip to Rome for a family with two children.",
    "Explain inflation and how central banks respond to it.",
    "What is the difference between weather and climate?",
    "Write a motivational speech for a school sports team.",
    "Give a recipe for vegetable soup with quantities.",
    "You are a pirate captain. Greet your new crew.",
    "Explain the rules of chess to a beginner.",
    # math and reasoning
    "Solve: a train travels 240 km in 3 hours. How long does it take to travel 400 km at the same speed?",
    "Prove that the square root of 2 is irrational.",
    "What is the derivative of x^3 * sin(x)? Show the steps.",
    "If all bloops are razzies and all razzies are lazzies, are all bloops lazzies? Explain.",
    "A shop sells pens at 3 for $2. How much do 15 pens cost?",
    "Explain Bayes' theorem with a medical test example.",
    "Compute the sum of the first 100 positive integers and explain the trick.",
    "Explain big-O notation and give the complexity of binary search.",
    # other languages
    "请用中文解释什么是机器学习。",
    "写一首关于春天的短诗。",
    "日本の四季について短く説明してください。",
    "한국의 전통 음식에 대해 소개해 주세요.",
    "Erkläre kurz, wie eine Demokratie funktioniert.",
    "Explique-moi la photosynthèse simplement.",
    "¿Cuáles son los beneficios de aprender un segundo idioma?",
    "Расскажи коротко об истории Москвы.",
    "Spiega come si prepara un buon caffè espresso.",
    "Explique o que é energia renovável.",
    "اشرح أهمية القراءة للأطفال.",
)


def load_table(path: str | Path, vocab_size: int) -> torch.Tensor:
    """A frequency ranking file -> token ids [n] int64, most frequent first (checked against vocab_size)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise VerispecError(f"cannot read draft vocabulary table {path}: {e.strerror or e}") from None
    if len(data) < 16 or data[:8] != MAGIC:
        raise VerispecError(f"{path} is not a draft vocabulary table (bad header)")
    table_vocab, n = struct.unpack("<II", data[8:16])
    if len(data) != 16 + 4 * n:
        raise VerispecError(f"{path} is truncated or corrupt: header says {n} ids, file holds {(len(data) - 16) // 4}")
    if table_vocab > vocab_size:
        raise VerispecError(f"{path} was built for a vocabulary of {table_vocab} tokens; this model has {vocab_size}")
    ids = torch.frombuffer(bytearray(data[16:]), dtype=torch.int32).long() if n else torch.zeros(0, dtype=torch.long)
    if n and (int(ids.min()) < 0 or int(ids.max()) >= table_vocab or len(torch.unique(ids)) != n):
        raise VerispecError(f"{path} is corrupt: token ids repeated or outside [0, {table_vocab})")
    return ids


def save_table(path: str | Path, ranking: torch.Tensor, vocab_size: int) -> None:
    ids = ranking.to(torch.int32).contiguous()
    try:
        Path(path).write_bytes(MAGIC + struct.pack("<II", vocab_size, len(ids)) + ids.numpy().tobytes())
    except OSError as e:
        raise VerispecError(f"cannot write draft vocabulary table {path}: {e.strerror or e}") from None


def head_ids(table: torch.Tensor, rows: int, always: tuple[int, ...] = ()) -> torch.Tensor:
    """The ``rows`` most frequent token ids plus ``always`` (e.g. EOS), sorted -> [<= rows + len(always)]."""
    if rows < 1:
        raise VerispecError(f"draft vocabulary must be >= 1 tokens, got {rows}")
    if rows > len(table):
        raise VerispecError(f"draft vocabulary of {rows} tokens asked for, but the frequency table ranks only "
                            f"{len(table)}: use a smaller --draft-vocab or 0 for the full vocabulary")
    return torch.unique(torch.cat([table[:rows], torch.tensor(always, dtype=torch.long)]))


def head_ids_for(source: str, vocab_size: int, rows: int | None, table_path: str | None,
                 always: tuple[int, ...] = ()) -> torch.Tensor | None:
    """The LM-head rows for draft ``source``: the ``rows`` most frequent tokens plus ``always``, from the table
    at ``table_path`` or the one packaged for a named model; None (the full head) when rows is 0, or None for a
    draft without a default (a named model's ``draft_vocab_rows``)."""
    from .models.registry import REGISTRY

    if rows is None:
        rows = getattr(REGISTRY.get(source), "draft_vocab_rows", None)
    if not rows:
        return None
    if table_path is None and getattr(REGISTRY.get(source), "draft_vocab_table", None):
        table_path = DATA_DIR / REGISTRY[source].draft_vocab_table
    if table_path is None:
        raise VerispecError(f"--draft-vocab {rows}: no token-frequency table ships for draft {source!r}; build one "
                            f"with python -m verispec.draft_vocab --model {source} --out FILE and pass "
                            f"--draft-vocab-table FILE")
    return head_ids(load_table(table_path, vocab_size), rows, always)


@torch.inference_mode()
def expected_counts(model, prompts: list[list[int]], new_tokens: int, seed: int = 0,
                    eos: tuple[int, ...] = (), progress: bool = True) -> torch.Tensor:
    """Sum over every generated position of the model's next-token distribution (T=1) -> [V] float64."""
    from tqdm import tqdm

    from .models.kv_cache import KVCache

    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(model.config.vocab_size, dtype=torch.float64)
    for ids in tqdm(prompts, desc="draft vocabulary", unit="prompt", disable=not progress, dynamic_ncols=True):
        cache = KVCache.for_model(model.config, 1, len(ids) + new_tokens, model.dtype)
        tokens = torch.tensor([ids])  # [1, T]
        for _ in range(new_tokens):
            positions = torch.arange(cache.length, cache.length + tokens.shape[1])[None]
            logits, _ = model(tokens, positions, cache, num_logits=1)
            probs = torch.softmax(logits[0, -1].double(), dim=-1)  # [V]
            counts += probs
            token = int(torch.multinomial(probs, 1, generator=gen))
            if token in eos:
                break
            tokens = torch.tensor([[token]])
    return counts


CORPUS_SUFFIXES = (".py", ".md", ".rst", ".txt", ".js", ".ts", ".html", ".c", ".h", ".cpp", ".java", ".go", ".rs",
                   ".sh", ".json", ".toml", ".yaml", ".yml", ".sql")


def corpus_files(paths: list[str]) -> list[Path]:
    """Text files under ``paths`` (files given directly, or found under directories by suffix), sorted."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_file():
            files.append(p)
        elif p.is_dir():
            files += sorted(f for f in p.rglob("*") if f.suffix in CORPUS_SUFFIXES and f.is_file())
        else:
            raise VerispecError(f"--corpus {p}: no such file or directory")
    return files


def corpus_counts(tokenizer, files: list[Path], vocab_size: int, max_bytes: int, progress: bool = True) -> torch.Tensor:
    """How often each token id occurs in the files' UTF-8 text (files that do not decode are skipped), reading
    at most ``max_bytes`` characters in all, files in a fixed shuffled order -> [vocab_size] float64."""
    import random

    from tqdm import tqdm

    files = list(files)
    random.Random(0).shuffle(files)  # a budget then samples every directory, not the first few
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    read = 0
    with tqdm(total=max_bytes, desc="corpus", unit="B", unit_scale=True, disable=not progress, dynamic_ncols=True) as bar:
        for f in files:
            if read >= max_bytes:
                break
            try:
                text = f.read_text(encoding="utf-8")[: max_bytes - read]
            except (OSError, UnicodeDecodeError):
                continue
            ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
            counts += torch.bincount(ids[ids < vocab_size], minlength=vocab_size).double()
            read += len(text)
            bar.update(len(text))
    return counts


def main(argv=None) -> int:
    from .flags import Parser, run_tool

    p = Parser(prog="python -m verispec.draft_vocab",
                description="Rank a draft model's tokens by expected frequency (FR-Spec).")
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", help="model name, HF directory or .gguf")
    p.add_argument("--out", required=True, help="table file to write")
    p.add_argument("--new-tokens", type=int, default=160, help="tokens generated per seed prompt (default: 160)")
    p.add_argument("--keep", type=int, default=65536, help="ids stored, most frequent first (default: 65536)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--corpus", nargs="+", default=[], metavar="PATH",
                   help="text files or directories whose tokens are counted too (e.g. a Python installation's lib/)")
    p.add_argument("--corpus-bytes", type=int, default=40_000_000, help="characters of corpus read at most (default: 40M)")

    def body(args):
        from .models.loader import load
        from .tokenizer import Codec

        if args.new_tokens < 1 or args.keep < 1 or args.corpus_bytes < 1:
            raise VerispecError("--new-tokens, --keep and --corpus-bytes must be >= 1")
        files = corpus_files(args.corpus)
        if args.corpus and not files:
            raise VerispecError(f"--corpus: no text files ({', '.join(CORPUS_SUFFIXES)}) under {' '.join(args.corpus)}")
        if not Path(args.out).expanduser().parent.is_dir():  # before minutes of generation, not after
            raise VerispecError(f"--out {args.out}: directory {Path(args.out).parent} does not exist")
        loaded = load(args.model, torch.bfloat16, "cpu")
        loaded.model.quantize_weights(8)  # faster steps; the ranking is a statistic, not exact arithmetic
        codec = Codec(loaded.tokenizer, loaded.config.vocab_size)
        prompts = [codec.encode(text, chat=True) for text in SEED_PROMPTS]
        counts = expected_counts(loaded.model, prompts, args.new_tokens, args.seed, loaded.config.eos_token_ids)
        if files:
            if loaded.tokenizer is None:
                raise VerispecError(f"--corpus: {args.model} has no tokenizer to count a corpus with")
            seen = corpus_counts(loaded.tokenizer, files, len(counts), args.corpus_bytes)
            if seen.sum() == 0:
                raise VerispecError("--corpus: no readable UTF-8 text in the files given")
            counts = counts / counts.sum() + seen / seen.sum()
        real = len(loaded.tokenizer) if loaded.tokenizer is not None else loaded.config.vocab_size
        ranking = torch.argsort(counts[:real], descending=True, stable=True)[: args.keep]
        save_table(args.out, ranking, real)
        top = counts[ranking].sum() / counts.sum()
        print(f"wrote {args.out}: {len(ranking)} of {real} tokens, {top:.4f} of the expected mass")

    return run_tool(p, argv, body)


if __name__ == "__main__":
    sys.exit(main())
