#!/usr/bin/env python3
"""How often the default draft's first choice is the target's greedy token, teacher-forced: a quick estimate of
greedy acceptance for a change to the draft, here dropping some of its layers (self-speculation-style layer
skipping).

    python3 scripts/draft_agreement.py [--prompts 4] [--categories coding,writing] [--skip 12,13 --skip 21 ...]

The target answers the first --prompts prompts of each category of the built-in suite (greedy, 64 new tokens,
chat template). Then for each --skip set (comma-separated draft layer indices; none given: the full draft
only) one draft forward over prompt + answer gives, at every answer position, the draft's argmax, and the
share that equals the target's token is printed per category. Any draft is exact under the verifier; this
measures only how much it would agree.
"""

from __future__ import annotations

import sys


def main(argv=None) -> int:
    from verispec.cli import _Parser, run_tool

    ap = _Parser(prog="python3 scripts/draft_agreement.py", description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=4, help="prompts per category (default 4)")
    ap.add_argument("--categories", default="coding,writing", help="comma-separated suite categories")
    ap.add_argument("--skip", action="append", default=[], help="draft layers to leave out, comma-separated")
    return run_tool(ap, argv, run)  # bad input: one line, exit 2


def run(args) -> None:
    import torch
    from torch import nn

    from verispec import LLM, SamplingParams
    from verispec.bench.prompts import builtin_suite, select
    from verispec.errors import VerispecError
    from verispec.models.kv_cache import KVCache

    if args.prompts < 1:
        raise VerispecError(f"--prompts must be >= 1, got {args.prompts}")
    try:
        skips = [set(map(int, s.split(","))) for s in args.skip]
    except ValueError:
        raise VerispecError(f"--skip takes comma-separated layer indices, got {args.skip}") from None
    prompts = [p for c in args.categories.split(",") for p in select(builtin_suite(), [c])[:args.prompts]]
    torch.set_num_threads(2)
    llm = LLM(progress=False)
    draft = llm.draft_model().model
    layers = list(draft.layers)
    if any(not 0 <= i < len(layers) for s in skips for i in s):
        raise VerispecError(f"--skip: the draft has layers 0..{len(layers) - 1}")
    answers = []
    for p in prompts:
        ids = llm.codec.encode(p.text, chat=True)
        answers.append((p.category, ids, llm.generate(ids, SamplingParams(max_new_tokens=64, ignore_eos=True)).token_ids))
    print("| draft layers left out | " + " | ".join(dict.fromkeys(c for c, _, _ in answers)) + " |")
    for skip in [set()] + skips:
        draft.layers = nn.ModuleList(layer for i, layer in enumerate(layers) if i not in skip)
        share = {}
        for category, ids, out in answers:
            full = ids + out
            cache = KVCache.for_model(draft.config, 1, len(full), draft.dtype)
            logits, _ = draft(torch.tensor([full]), torch.arange(len(full))[None], cache)  # [1, T, V]
            guesses = logits[0, len(ids) - 1:-1].argmax(-1).tolist()  # the draft's choice for each answer token
            share.setdefault(category, []).append(sum(g == t for g, t in zip(guesses, out)) / len(out))
        draft.layers = nn.ModuleList(layers)
        print(f"| {','.join(map(str, sorted(skip))) or 'none'} | "
              + " | ".join(f"{sum(v) / len(v):.3f}" for v in share.values()) + " |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
