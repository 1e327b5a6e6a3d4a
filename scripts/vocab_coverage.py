#!/usr/bin/env python3
"""How much of the target's own greedy output a draft-vocabulary table covers (FR-Spec, draft_vocab.py).

    python3 scripts/vocab_coverage.py [--tables OLD NEW ...] [--categories coding,writing] [--limit 4] [--new-tokens 256]

Generates AR (greedy, chat template) on the built-in suite's prompts with the default target, then prints, per
table and per category, the share of generated tokens among the table's top 16k / 32k / 48k ids. Default table:
the packaged one. A one-off measurement for docs/BENCHMARKS.md, not a test.
"""

from __future__ import annotations

import sys

import torch

from verispec import LLM, SamplingParams
from verispec.bench.prompts import builtin_suite, select
from verispec.draft_vocab import DATA_DIR, load_table
from verispec.errors import VerispecError

ROWS = (16384, 32768, 49152)


def main(argv=None) -> int:
    from verispec.cli import _Parser, run_tool

    ap = _Parser(prog="python3 scripts/vocab_coverage.py", description=__doc__.splitlines()[0])
    ap.add_argument("--tables", nargs="+", default=[str(DATA_DIR / "qwen2.5.draft-vocab")])
    ap.add_argument("--categories", default="coding,writing")
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=256)
    return run_tool(ap, argv, coverage)  # bad input: one line, exit 2


def coverage(args) -> None:
    if args.limit < 1 or args.new_tokens < 1:
        raise VerispecError("--limit and --new-tokens must be >= 1")
    llm = LLM(target="qwen2.5-coder-1.5b-instruct", progress=False)
    vocab = llm.target.config.vocab_size
    tables = {path: load_table(path, vocab) for path in args.tables}  # a bad file fails before minutes of generation
    outputs: dict[str, list[int]] = {}  # category -> generated ids
    for p in select(builtin_suite(), args.categories.split(","), args.limit):
        out = llm.generate(p.text, SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True), method="ar", chat=True)
        outputs.setdefault(p.category, []).extend(out.token_ids)
    for path, table in tables.items():
        rank = torch.full((vocab,), len(table))  # ids outside the table rank last
        rank[table] = torch.arange(len(table))
        cells = [f"{cat} " + " / ".join(f"{n // 1024}k {(rank[torch.tensor(ids)] < n).float().mean():.3f}" for n in ROWS)
                 for cat, ids in outputs.items()]
        print(f"{path}: " + "; ".join(cells))


if __name__ == "__main__":
    sys.exit(main())
