#!/usr/bin/env python3
"""How much of the target's own greedy output a draft-vocabulary table covers (FR-Spec, draft_vocab.py).

    python3 scripts/vocab_coverage.py [--tables OLD NEW ...] [--categories coding,writing] [--limit 4] [--new-tokens 256]

Generates AR (greedy, chat template) on the built-in suite's prompts with the default target, then prints, per
table and per category, the share of generated tokens among the table's top 16k / 32k / 48k ids. Default table:
the packaged one. A one-off measurement for docs/BENCHMARKS.md, not a test.
"""

from __future__ import annotations

import argparse

import torch

from verispec import LLM, SamplingParams
from verispec.bench.prompts import builtin_suite, select
from verispec.draft_vocab import DATA_DIR, load_table

ROWS = (16384, 32768, 49152)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tables", nargs="+", default=[str(DATA_DIR / "qwen2.5.draft-vocab")])
    ap.add_argument("--categories", default="coding,writing")
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=256)
    args = ap.parse_args()
    llm = LLM(target="qwen2.5-coder-1.5b-instruct", progress=False)
    vocab = llm.target.config.vocab_size
    outputs: dict[str, list[int]] = {}  # category -> generated ids
    for p in select(builtin_suite(), args.categories.split(","), args.limit):
        out = llm.generate(p.text, SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True), method="ar", chat=True)
        outputs.setdefault(p.category, []).extend(out.token_ids)
    for path in args.tables:
        table = load_table(path, vocab)
        rank = torch.full((vocab,), len(table))  # ids outside the table rank last
        rank[table] = torch.arange(len(table))
        cells = [f"{cat} " + " / ".join(f"{n // 1024}k {(rank[torch.tensor(ids)] < n).float().mean():.3f}" for n in ROWS)
                 for cat, ids in outputs.items()]
        print(f"{path}: " + "; ".join(cells))


if __name__ == "__main__":
    main()
