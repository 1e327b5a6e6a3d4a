#!/usr/bin/env python3
"""One load and one short generation of the default pair in a given weights mode and dtype (a quick check of
which dtype suits this CPU; one process per setting, one prompt: not a same-run ratio).

    python3 scripts/dtype_check.py WEIGHTS DTYPE [NEW_TOKENS]     # e.g. native bfloat16 16
"""
import sys
import time

from verispec import LLM, SamplingParams

weights, dtype = sys.argv[1], sys.argv[2]
t = time.perf_counter()
llm = LLM(weights=weights, dtype=dtype, progress=False)
load = time.perf_counter() - t
p = SamplingParams(max_new_tokens=int(sys.argv[3]) if len(sys.argv) > 3 else 32)
llm.generate("def quicksort(arr):", SamplingParams(max_new_tokens=4))
out = llm.generate("def quicksort(arr):", p)
s = out.stats
print(f"{weights} {dtype}: load {load:.1f}s, {s['new_tokens']/s['wall_s']:.2f} tok/s AR", flush=True)
out = llm.generate("def quicksort(arr):", p, method="draft")
s = out.stats
print(f"{weights} {dtype}: draft {s['new_tokens']/s['wall_s']:.2f} tok/s", flush=True)
