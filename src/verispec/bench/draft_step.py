"""Time one draft-model forward (a draft step, T=1, and a catch-up, T=2) per weight format, interleaved.

    python -m verispec.bench.draft_step [--model NAME_OR_PATH] [--context 200] [--repeats 31]

Rows: bf16 (oneDNN), int8 and 4-bit with the per-op PyTorch layer, int8 and 4-bit with the fused C++ layer
(one loaded model per weight format; the fused layer is switched on and off).
Medians of `--repeats` timed forwards at a `--context`-token cache, rounds interleaved across the formats so
that the VM's bandwidth swings hit them alike. A micro-benchmark for kernel work; `verispec bench` measures
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
from ..models.kv_cache import KVCache
from ..models.registry import DEFAULT_DRAFT, DEFAULT_TARGET


VARIANTS = (("bf16", None, False), ("int8 per-op", 8, False), ("int8 fused", 8, True),
            ("int4 per-op", 4, False), ("int4 fused", 4, True))  # (row, bits, fused C++ layer)


def run(args) -> None:
    models = {}  # bits -> (model, cache): one load per weight format; fused or not is a switch
    for _, bits, _ in VARIANTS:
        if bits in models:
            continue
        model = loader.load(args.model).model
        if bits and not model.quantize_weights(bits):
            continue
        cache = KVCache.for_model(model.config, 1, args.context + 8, model.dtype)
        vocab = min(1000, model.config.vocab_size)
        model(torch.randint(0, vocab, (1, args.context)), torch.arange(args.context)[None], cache, num_logits=1)
        models[bits] = model, cache
    rows = [(name, bits, fused) for name, bits, fused in VARIANTS if bits in models]
    times = {(name, T): [] for name, _, _ in rows for T in (1, 2)}
    for _ in range(args.repeats + 3):
        for name, bits, fused in rows:
            model, cache = models[bits]
            model.fused_quantized = fused
            for T in (1, 2):
                cache.truncate(args.context)
                ids, pos = torch.randint(0, vocab, (1, T)), torch.arange(args.context, args.context + T)[None]
                t0 = time.perf_counter()
                model(ids, pos, cache, num_logits=1)
                times[(name, T)].append(time.perf_counter() - t0)
    print(f"{args.model}, context {args.context}, {torch.get_num_threads()} threads; median ms per forward")
    print("| weights | T=1 (draft step) | T=2 (catch-up) |\n|---|---|---|")
    for name, _, _ in rows:
        t1, t2 = (statistics.median(times[(name, T)][3:]) * 1e3 for T in (1, 2))
        print(f"| {name} | {t1:.1f} | {t2:.1f} |")


def main(argv=None) -> int:
    ap = Parser(prog="python -m verispec.bench.draft_step", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_DRAFT[DEFAULT_TARGET])
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=31)

    def body(args):
        if args.context < 1 or args.repeats < 1:
            raise VerispecError("--context and --repeats must be >= 1")
        run(args)

    return run_tool(ap, argv, body)


if __name__ == "__main__":
    sys.exit(main())
