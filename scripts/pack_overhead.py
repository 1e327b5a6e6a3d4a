#!/usr/bin/env python3
"""Per-call cost of a oneDNN-packed float32 linear against F.linear (MKL), by matrix size and row count.

    python3 scripts/pack_overhead.py [--threads 1,2] [--rows 1,2,4,8]

Where models/linear.py's PACK_MIN_WEIGHTS comes from: a packed call carries a fixed cost that a small matrix
never wins back. Median of 7 rounds of n calls each (n scaled to the matrix), microseconds per call.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

SHAPES = [(64, 32, 1), (64, 32, 8), (896, 896, 1), (1152, 896, 1), (1536, 1536, 1), (8960, 1536, 1),
          (8960, 1536, 8)]  # (out, in, rows): a test model's matrix, the 0.5B and 1.5B models' matrices


def per_call_us(f, n: int) -> float:
    for _ in range(3):
        f()
    rounds = []
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(n):
            f()
        rounds.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(rounds)


def _ints(ap, flag: str, text: str) -> list[int]:
    try:
        values = [int(t) for t in text.split(",")]
    except ValueError:
        ap.error(f"{flag} takes comma-separated integers, got {text!r}")
    if min(values) < 1:
        ap.error(f"{flag} values must be >= 1")
    return values


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    ap.add_argument("--rows", default=None, help="comma-separated row counts: the 1.5B model's 8960 x 1536 "
                                                 "matrix at each (a verify pass's rows), instead of the table")
    args = ap.parse_args()
    counts, rows = _ints(ap, "--threads", args.threads), args.rows and _ints(ap, "--rows", args.rows)
    shapes = [(8960, 1536, r) for r in rows] if rows else SHAPES
    print("| threads | out x in | rows | F.linear us | packed us |\n|---|---|---|---|---|")
    for threads in counts:
        torch.set_num_threads(threads)
        for n_out, n_in, rows in shapes:
            w, x = torch.randn(n_out, n_in), torch.randn(1, rows, n_in)
            packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
            n = max(5, 20_000_000 // (n_out * n_in * rows))
            plain = per_call_us(lambda: F.linear(x, w), n)
            onednn = per_call_us(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), n)
            print(f"| {threads} | {n_out} x {n_in} | {rows} | {plain:.0f} | {onednn:.0f} |")


if __name__ == "__main__":
    main()
