#!/usr/bin/env python3
"""How far can model-free lookup go? Replays n-gram drafting rules on the target's own greedy outputs.

    python3 scripts/ngram_replay.py [--categories summarization,rag] [--limit-per-category 8] [--cache FILE]

Generates each prompt's greedy output once with the default target (bf16, 64 new tokens, chat template;
cached in --cache), then replays, with no further model calls, what each drafting rule would have had
accepted at every round: the draft is accepted up to its first token that differs from the output (exactly
what greedy verification does), and the round adds one more token. tau = new tokens / target forwards with
the prefill counted as one, as `verispec bench` counts it; median per category, as the bench reports it.

Rules:
- chain: the most recent occurrence of the longest matching n-gram (n = 4 .. 1), K tokens (ngram.py);
- tree, N nodes: the continuations of every occurrence of every matching n (longest n and most recent
  first), merged into a prefix tree of at most N nodes, all verified in one target pass (SpecInfer-style).
  Greedy verification then walks the tree along the output;
- pool: the same with earlier prompts' text (prompt + output, in suite order) searchable as well, as a
  server that keeps what it has seen could do.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

N_MAX, N_MIN = 4, 1


def greedy_outputs(categories, per_category, cache: Path) -> dict:
    from verispec.bench.prompts import builtin_suite, select
    from verispec.errors import VerispecError

    try:
        outs = json.loads(cache.read_text()) if cache.exists() else {}
    except (OSError, ValueError) as e:
        raise VerispecError(f"cannot read the cache {cache}: {e}") from None

    todo = [p for p in select(builtin_suite(), categories, per_category) if p.id not in outs]
    if todo:
        import torch

        from verispec import LLM, SamplingParams

        torch.set_num_threads(2)
        llm = LLM(weights="dequantized", draft=None, progress=False)
        for p in todo:
            ids = llm.codec.encode(p.text, chat=True)
            out = llm.generate(ids, SamplingParams(max_new_tokens=64, ignore_eos=True))
            outs[p.id] = {"cat": p.category, "prompt": ids, "out": out.token_ids}
        cache.write_text(json.dumps(outs))
    keep = {p.id for p in select(builtin_suite(), categories, per_category)}
    return {k: v for k, v in outs.items() if k in keep}


def continuations(ctx: list[int], K: int, text: list[int] | None = None) -> list[list[int]]:
    """K-token continuations after each earlier occurrence of ctx's last n tokens in ``text`` (default: ctx
    itself), longest n first, most recent first within an n."""
    text = ctx if text is None else text
    out = []
    for n in range(min(N_MAX, len(ctx) - 1), N_MIN - 1, -1):
        suffix = ctx[len(ctx) - n:]
        last = len(text) - n - 1 if text is ctx else len(text) - n  # ctx's own suffix never matches itself
        out += [text[s + n:s + n + K] for s in range(last, -1, -1) if text[s:s + n] == suffix]
    return [c for c in out if c]


def accepted_in_tree(paths: list[list[int]], budget: int, future: list[int]) -> int:
    """Merge ``paths`` in order into a prefix tree of at most ``budget`` nodes; the accepted length is the
    longest prefix of ``future`` that is a path from the root."""
    tree, nodes = {}, 0
    for p in paths:
        node = tree
        for t in p:
            if t not in node:
                if nodes == budget:
                    break
                node[t], nodes = {}, nodes + 1
            node = node[t]
        if nodes == budget:
            break
    n, node = 0, tree
    for t in future:
        if t not in node:
            break
        node, n = node[t], n + 1
    return n


def replay(outs: dict, K: int, budget: int, pool: bool, chain: bool) -> dict[str, float]:
    per_cat, seen = {}, []
    for r in outs.values():
        prompt, out = r["prompt"], r["out"]
        pos, forwards = 1, 1  # the prefill's forward gives the first token
        while pos < len(out):
            ctx, future = prompt + out[:pos], out[pos:]
            paths = continuations(ctx, K)
            if pool and seen:
                paths += continuations(ctx, K, seen)
            n = min(accepted_in_tree(paths[:1] if chain else paths, budget, future), len(future) - 1)
            pos, forwards = pos + n + 1, forwards + 1
        seen += prompt + out
        per_cat.setdefault(r["cat"], []).append(len(out) / forwards)
    return {c: statistics.median(v) for c, v in per_cat.items()}


def main(argv=None) -> int:
    from verispec.cli import _Parser, run_tool

    ap = _Parser(prog="python3 scripts/ngram_replay.py", description=__doc__.split("\n")[0])
    ap.add_argument("--categories", default="summarization,rag")
    ap.add_argument("--limit-per-category", type=int, default=8)
    ap.add_argument("--cache", default="ngram_replay_outputs.json")
    return run_tool(ap, argv, report)  # bad input: one line, exit 2


def report(args) -> None:
    cats = args.categories.split(",")
    outs = greedy_outputs(cats, args.limit_per_category, Path(args.cache))
    rows = [("chain", 4, 4), ("chain", 8, 8), ("tree", 4, 8), ("tree", 4, 16), ("tree", 8, 16), ("tree", 8, 32),
            ("tree", 16, 64)]
    print("| rule | K | nodes (verify size - 1) | " + " | ".join(cats) + " | with the pool: " + " | ".join(cats) + " |")
    print("|---" * (3 + 2 * len(cats)) + "|")
    for rule, K, budget in rows:
        alone, pooled = (replay(outs, K, budget, pool, rule == "chain") for pool in (False, True))
        print(f"| {rule} | {K} | {budget} | " + " | ".join(f"{alone[c]:.2f}" for c in cats) + " | "
              + " | ".join(f"{pooled[c]:.2f}" for c in cats) + " |")


if __name__ == "__main__":
    sys.exit(main())
