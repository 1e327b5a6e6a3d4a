"""Time the native GGUF matrix products of one forward (every layer matrix and the LM head) for M rows, against
the machine's measured integer peak.

    python -m verispec.bench.native_matmul [--model NAME_OR_PATH] [--rows 1,2,4,5,8,9,16] [--repeats 9]

The matrices of ``--model`` loaded with weights="native" (csrc/linear_gguf.cpp), grouped as a forward uses
them (fused q/k/v, o, fused gate/up, down, head), called in model order with M random bf16 rows; M rows is
what a forward over M new tokens multiplies. Per group and in total: the median of ``--repeats`` timed
passes, rounds interleaved across M so that the VM's bandwidth swings hit every M alike. A second table gives
each group's achieved G MAC/s (M x N x K a call over its time) and its share of the peak: one core's measured
vpdpbusd (AVX512-VNNI) or vpmaddubsw (AVX2) multiply-accumulates a second (csrc/peak.cpp) times the threads.
The weights stream from memory as in a forward, so small M is bound by bandwidth, not by the peak.
A micro-benchmark for kernel work: `verispec bench` measures whole forwards (attention, norms, Python) and
what users get.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from ..flags import Parser, run_tool
from ..errors import VerispecError
from ..models import loader
from ..models.registry import DEFAULT_TARGET

GROUPS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj", "lm_head")


def run(args, rows: list[int]) -> None:
    from .. import kernels

    model = loader.load(args.model, weights="native").model
    mats = {g: [m.native for name, m in model.named_modules() if name.endswith(g) and getattr(m, "native", None)]
            for g in GROUPS}
    if not any(mats.values()):
        raise VerispecError(f"{args.model} has no native GGUF matrices (a GGUF file or a named model is needed)")
    times = {(g, M): [] for g in GROUPS for M in rows}
    xs = {(M, k): torch.randn(M, k).bfloat16() for M in rows for ws in mats.values() for k in {w.in_features for w in ws}}
    for _ in range(args.repeats + 2):
        for M in rows:
            for g, ws in mats.items():
                t0 = time.perf_counter()
                for w in ws:
                    kernels.ops.linear_gguf(xs[(M, w.in_features)], *w.tensors, None)
                times[(g, M)].append(time.perf_counter() - t0)
    nbytes = sum(w.nbytes for ws in mats.values() for w in ws)
    print(f"{args.model}: {len(sum(mats.values(), []))} native matrices, {nbytes / 1e9:.2f} GB; {kernels.isa()}, "
          f"{torch.get_num_threads()} threads; median ms per forward's worth of products")
    print("| M | " + " | ".join(g.split(".")[-1] for g in GROUPS) + " | total | vs M=1 |")
    print("|---" * (len(GROUPS) + 3) + "|")
    base = None
    for M in rows:
        ms = [statistics.median(times[(g, M)][2:]) * 1e3 for g in GROUPS]
        base = base or sum(ms)
        print(f"| {M} | " + " | ".join(f"{t:.2f}" for t in ms) + f" | {sum(ms):.1f} | {sum(ms) / base:.2f}x |")
    peak = kernels.int8_peak_macs() * torch.get_num_threads()
    if not peak:
        return
    macs = {g: sum(w.out_features * w.in_features for w in ws) for g, ws in mats.items()}
    print(f"\nG MAC/s (share of the measured int8 peak, {peak / 1e9:.0f} G MAC/s on {torch.get_num_threads()} threads)")
    print("| M | " + " | ".join(g.split(".")[-1] for g in GROUPS) + " | total |")
    print("|---" * (len(GROUPS) + 2) + "|")
    for M in rows:
        secs = {g: statistics.median(times[(g, M)][2:]) for g in GROUPS}
        cells = [M * macs[g] / secs[g] if macs[g] else None for g in GROUPS]
        cells.append(M * sum(macs.values()) / sum(secs.values()))
        print(f"| {M} | " + " | ".join("-" if c is None else f"{c / 1e9:.0f} ({100 * c / peak:.0f}%)" for c in cells) + " |")


def main(argv=None) -> int:
    ap = Parser(prog="python -m verispec.bench.native_matmul", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_TARGET)
    ap.add_argument("--rows", default="1,2,4,5,8,9,16", help="comma-separated row counts M")
    ap.add_argument("--repeats", type=int, default=9)

    def body(args):
        try:
            rows = [int(r) for r in args.rows.split(",")]
        except ValueError:
            raise VerispecError(f"--rows must be comma-separated integers, got {args.rows!r}") from None
        if args.repeats < 1 or not rows or min(rows) < 1:
            raise VerispecError("--repeats and every --rows value must be >= 1")
        run(args, rows)

    return run_tool(ap, argv, body)


if __name__ == "__main__":
    sys.exit(main())
