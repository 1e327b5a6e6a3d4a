#!/usr/bin/env python3
"""Repeat forwards of the default native target (or the 4-bit draft) for a while: a steady state to profile.

    perf record -D 20000 python3 scripts/forward_loop.py [--draft] [--tokens 1] [--seconds 25]

Loads the default pair as `verispec generate` does, fills a cache (128 tokens for the target, 200 for the
draft, as scripts/kernel_ab.py does), then runs forwards over --tokens new tokens (1: a decode step; k + 1: a
verify pass, logits for every row; with --draft, a catch-up: logits for the last row only) until --seconds
have passed, with Python's cycle collector off as in decoding, and prints the mean ms per forward. perf's -D
skips the load.
"""

from __future__ import annotations

import gc
import sys
import time


def main(argv=None) -> int:
    from verispec.flags import Parser, run_tool

    ap = Parser(prog="python3 scripts/forward_loop.py", description=__doc__.split("\n")[0])
    ap.add_argument("--draft", action="store_true", help="the 4-bit 0.5B draft instead of the native target")
    ap.add_argument("--tokens", type=int, default=1, help="new tokens per forward (default 1)")
    ap.add_argument("--seconds", type=float, default=25.0)
    return run_tool(ap, argv, loop)  # bad input: one line, exit 2


def loop(args) -> None:
    import torch

    from verispec import LLM
    from verispec.errors import VerispecError
    from verispec.models.kv_cache import KVCache

    if not args.seconds > 0:
        raise VerispecError(f"--seconds must be > 0, got {args.seconds}")
    if not 1 <= args.tokens <= 64:
        raise VerispecError(f"--tokens must be in 1..64, got {args.tokens}")
    torch.set_num_threads(2)
    llm = LLM(progress=False)
    model = llm.draft_model().model if args.draft else llm.target.model
    ctx = 200 if args.draft else 128
    t = args.tokens
    cache = KVCache.for_model(model.config, 1, ctx + t, model.dtype)
    ids = torch.randint(0, model.config.vocab_size, (1, ctx + t), generator=torch.Generator().manual_seed(0))
    model(ids[:, :ctx], torch.arange(ctx)[None], cache, num_logits=1)
    # as LLM's decoding loop does: else Python's cycle collector shows in the profile (docs/BENCHMARKS.md,
    # "Draft step cost")
    gc.disable()
    pos, n, t0 = torch.arange(ctx, ctx + t)[None], 0, time.perf_counter()
    while time.perf_counter() - t0 < args.seconds:
        cache.truncate(ctx)
        model(ids[:, ctx:], pos, cache, num_logits=1 if args.draft else None)  # a draft's catch-up: the last row's
        n += 1
    gc.enable()
    print(f"{'draft' if args.draft else 'target'}: {(time.perf_counter() - t0) / n * 1e3:.2f} ms per {t}-token forward ({n})")


if __name__ == "__main__":
    sys.exit(main())
