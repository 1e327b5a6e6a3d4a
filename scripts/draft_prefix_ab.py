#!/usr/bin/env python3
"""Interleaved A/B of the draft's KV cache kept across requests (models/kv_cache.PrefixCache) on the default pair.

    python3 scripts/draft_prefix_ab.py [--rounds 2] [--prompts 4] [--categories coding,writing] [--methods draft,auto]
                                       [--conversation]

Each prompt of the built-in suite (the first --prompts of each category, chat template, 64 new tokens, greedy)
runs AR once, then each method twice, the two taking turns (the order flips every prompt): "cold", the draft
prefilling the whole prompt, and "kept", the draft starting from the cache the prompt before left, as far as the
two requests agree (the chat template's system prompt, as `verispec bench` now runs). Prints, per category and
method, the median speedup over AR (wall time, prefill included), decode ms per token, the median tokens the
draft was fed before its first draft token, the median seconds of that first forward, and whether every output
equals AR's. With --conversation the prompts of a category are the turns of one chat: each request is the
chat template over every earlier turn, with the target's answers, plus the next prompt, so a "kept" draft
starts from the whole conversation so far.
"""

from __future__ import annotations

import statistics
import sys
import time


def main(argv=None) -> int:
    from verispec.cli import _Parser, run_tool

    ap = _Parser(prog="python3 scripts/draft_prefix_ab.py", description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=4, help="prompts per category (default 4)")
    ap.add_argument("--categories", default="coding,writing", help="comma-separated suite categories")
    ap.add_argument("--methods", default="draft,auto", help="comma-separated: draft, auto")
    ap.add_argument("--conversation", action="store_true", help="each category's prompts as the turns of one chat")
    return run_tool(ap, argv, run)  # bad input: one line, exit 2


def run(args) -> None:
    import torch

    from verispec import LLM, SamplingParams
    from verispec.bench.prompts import builtin_suite, select
    from verispec.drafters import draft_model
    from verispec.errors import VerispecError

    methods = args.methods.split(",")
    if args.rounds < 1 or args.prompts < 1 or not set(methods) <= {"draft", "auto"}:
        raise VerispecError("--rounds and --prompts must be >= 1, --methods a list of draft and auto")
    chats = [select(builtin_suite(), [c])[:args.prompts] for c in args.categories.split(",")]
    torch.set_num_threads(2)
    llm = LLM(progress=False)
    params = SamplingParams(max_new_tokens=64, ignore_eos=True)
    first, real = [], draft_model.DraftModelDrafter._forward

    def spy(self, tokens):  # the first draft forward of a request: (tokens fed, seconds)
        t0 = time.perf_counter()
        out = real(self, tokens)
        if not first:
            first.append((tokens.shape[1], time.perf_counter() - t0))
        return out

    draft_model.DraftModelDrafter._forward = spy
    warm = SamplingParams(max_new_tokens=4, ignore_eos=True)
    for m in methods:
        llm.generate(chats[0][0].text, warm, method=m, chat=True)
    rows = {}  # (category, method, mode) -> [(speedup, decode ms/token, fed, first s, identical)]
    previous, i = None, 0
    for r in range(args.rounds):
        for chat in chats:
            messages = []
            for p in chat:
                if args.conversation:
                    messages.append({"role": "user", "content": p.text})
                    ids = llm.codec.tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
                    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
                else:
                    ids = llm.codec.encode(p.text, chat=True)
                answer, previous = one_prompt(llm, methods, rows, first, params, p, ids, previous, (r + i) % 2)
                if args.conversation:
                    messages.append({"role": "assistant", "content": answer})
                i += 1
    print("| category | method | draft cache | speedup over AR | decode ms/token | tokens fed first | first forward ms | outputs = AR |")
    print("|---|---|---|---|---|---|---|---|")
    for (cat, m, mode), rs in rows.items():
        med = [statistics.median(col) for col in list(zip(*rs))[:4]]
        print(f"| {cat} | {m} | {mode} | {med[0]:.2f}x | {med[1]:.1f} | {med[2]:.0f} | {1e3 * med[3]:.0f} | "
              f"{sum(r[4] for r in rs)}/{len(rs)} |")


def one_prompt(llm, methods, rows, first, params, p, ids, previous, flip) -> tuple[str, list[int]]:
    """AR, then each method cold and kept (in turns); rows get the results. ``previous``: the last request's
    tokens, prompt and answer (what a kept draft cache holds). Returns AR's text and this request's tokens."""
    from verispec.models.kv_cache import common_prefix

    shared = common_prefix(ids, previous) if previous else 0
    ar = llm.generate(ids, params)
    modes = ("kept", "cold") if flip else ("cold", "kept")
    for m in methods:
        for mode in modes:
            llm.draft_prefixes.limit(shared if mode == "kept" else 0)
            first.clear()
            out = llm.generate(ids, params, method=m)
            fed, s = first[0] if first else (0, 0.0)
            rows.setdefault((p.category, m, mode), []).append(
                (ar.stats["wall_s"] / out.stats["wall_s"], out.stats["decode_ms_per_token"], fed, s,
                 out.token_ids == ar.token_ids))
    print(f"{p.id}: {len(ids)} prompt tokens, {shared} shared with the one before", flush=True)
    return ar.text, ids + ar.token_ids


if __name__ == "__main__":
    sys.exit(main())
