#!/usr/bin/env python3
"""Interleaved A/B of C++ kernel source trees on the GGUF matrix kernel alone, weights streamed from memory.

    python3 scripts/kernel_stream.py NAME=DIR NAME=DIR [...] [--rows 1,2,8] [--copies 24] [--rounds 7] [--isa auto|avx2]

Each DIR is a copy of src/verispec/csrc, built as its own extension as scripts/kernel_ab.py does. The
matrices are random GGUF blocks (fp16 scales fixed at 0.01) of the default target's two largest shapes:
Q4_K 17920 x 1536 (fused gate/up) and Q6_K 1536 x 8960 (down). --copies distinct copies are called in turn,
so with the default 24 (~380 / 350 MB) every call reads its weights from DRAM, as a forward does; --copies 1
keeps one matrix in the caches (compute-bound timing). A round times one pass over the copies per tree; the
report gives the median over rounds of ms per matrix, and checks each tree's outputs bitwise against the
first's. --isa avx2 forces every tree's AVX2 path (on an AVX512 machine). A tree whose module reads an older GGUF
layout (its gguf_layout(), 1 where it has none) gets the same blocks in that layout.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

SHAPES = (("Q4_K", 17920, 1536), ("Q6_K", 1536, 8960))
BLOCK = {"Q4_K": (144, 256, (0, 2)), "Q6_K": (210, 256, (208,))}  # bytes, weights, fp16 fields per block


def random_weight(type_name: str, N: int, K: int, rng, layouts=(3,)):
    """-> {layout: NativeWeight}: the same random blocks laid out for each kernel layout in layouts (1: before
    Q6_K was stored in 6 bits, for A/B against trees from before that change)."""
    import numpy as np

    from kernel_ab import packing
    from verispec.models import gguf_native as gn

    nbytes, per, halves = BLOCK[type_name]
    raw = rng.integers(0, 256, size=(N, K // per, nbytes), dtype=np.uint8)
    for at in halves:  # finite scales: random fp16 bits would give infs and NaNs
        raw[..., at:at + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    q, s = gn.decode(raw.reshape(-1), type_name, N, K)
    out = {}
    for layout in layouts:
        with packing(layout):
            out[layout] = gn.NativeWeight.from_parts([gn.NativePart(type_name, q, s)])
    return out


def main(argv=None) -> int:
    from verispec.flags import Parser, run_tool

    ap = Parser(prog="python3 scripts/kernel_stream.py", description=__doc__.split("\n")[0])
    ap.add_argument("trees", nargs="+", metavar="NAME=DIR", help="source trees to compare (the first is the baseline)")
    ap.add_argument("--rows", default="1,2,8", help="activation rows M, comma-separated (1-4096; > 16: prefill)")
    ap.add_argument("--copies", type=int, default=24, help="distinct copies of each matrix (1: cache-resident)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--isa", default="auto", choices=["auto", "avx2"], help="avx2: force the AVX2 paths")
    ap.add_argument("--work", default="kernel_ab_builds", help="where the builds go")
    return run_tool(ap, argv, report)  # bad input: one line, exit 2


def report(args) -> None:
    import numpy as np
    import torch

    from verispec.errors import VerispecError
    from kernel_ab import build, parse

    trees, rows = parse(args.trees, "--rows", args.rows)
    if not all(1 <= M <= 4096 for M in rows) or args.rounds < 1 or args.copies < 1:
        raise VerispecError("--rows must lie in 1..4096, --rounds and --copies be >= 1")
    layout = {}  # tree -> the GGUF block layout its kernel reads
    for name, path in trees:
        module = build(name, path, Path(args.work))
        module.set_isa(args.isa)
        layout[name] = getattr(module, "gguf_layout", lambda: 1)()
    ops = {name: getattr(torch.ops, name) for name, _ in trees}
    torch.set_num_threads(2)
    rng = np.random.default_rng(0)
    first = trees[0][0]
    print(f"ms per matrix call, median of {args.rounds} interleaved rounds over {args.copies} copies, isa {args.isa}")
    print("| matrix | M | " + " | ".join(ops) + " | outputs as the first tree's |")
    print("|---|---|" + "---|" * (len(ops) + 1))
    for type_name, N, K in SHAPES:
        ws = [random_weight(type_name, N, K, rng, sorted(set(layout.values()))) for _ in range(args.copies)]
        for M in rows:
            x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).bfloat16()
            times, outs = {n: [] for n in ops}, {}
            for _ in range(args.rounds):
                for name, op in ops.items():
                    t0 = time.perf_counter()
                    for w in ws:
                        outs[name] = op.linear_gguf(x, *w[layout[name]].tensors, None)
                    times[name].append((time.perf_counter() - t0) / len(ws) * 1e3)
            same = all(torch.equal(o.view(torch.int16), outs[first].view(torch.int16)) for o in outs.values())
            print(f"| {type_name} {N} x {K} | {M} | " + " | ".join(f"{statistics.median(v):.3f}" for v in times.values())
                  + f" | {'bitwise' if same else 'DIFFERENT'} |", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
