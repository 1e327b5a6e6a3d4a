#!/usr/bin/env python3
"""One load and one short generation of the default pair in a given weights mode and dtype (a quick check of
which dtype suits this CPU; AR and draft run back to back in one process, on one prompt).

    python3 scripts/dtype_check.py WEIGHTS DTYPE [NEW_TOKENS]     # e.g. native bfloat16 16
"""

from __future__ import annotations

import argparse
import time

PROMPT = "def quicksort(arr):"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("weights", choices=["auto", "native", "dequantized"])
    ap.add_argument("dtype", choices=["auto", "bfloat16", "float16", "float32"])
    ap.add_argument("new_tokens", type=int, nargs="?", default=32)
    args = ap.parse_args()
    if args.new_tokens < 1:
        ap.error("NEW_TOKENS must be >= 1")

    from verispec import LLM, SamplingParams
    from verispec.errors import VerispecError

    try:
        t = time.perf_counter()
        llm = LLM(weights=args.weights, dtype=args.dtype, progress=False)
        load = time.perf_counter() - t
        params = SamplingParams(max_new_tokens=args.new_tokens)
        llm.generate(PROMPT, SamplingParams(max_new_tokens=4))  # warm-up
        for method in ("ar", "draft"):
            s = llm.generate(PROMPT, params, method=method).stats
            print(f"{args.weights} {args.dtype}: {method} {s['new_tokens'] / s['wall_s']:.2f} tok/s"
                  + (f" (load {load:.1f} s)" if method == "ar" else ""), flush=True)
    except VerispecError as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
