"""Time one draft-model forward (a draft step, T=1, and a catch-up, T=2) per weight format, interleaved.

    python -m verispec.bench.draft_step [--model NAME_OR_PATH] [--context 200] [--repeats 31]

Rows: bf16 (oneDNN), int8 and 4-bit with the per-op PyTorch layer, int8 and 4-bit with the fused C++ layer.
Medians of `--repeats` timed forwards at a `--context`-token cache, rounds interleaved across the formats so
that the VM's bandwidth swings hit them alike. A micro-benchmark for kernel work; `verispec bench` measures
what users get.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ..models import loader
from ..models.kv_cache import KVCache
from ..models.registry import DEFAULT_DRAFT, DEFAULT_TARGET


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_DRAFT[DEFAULT_TARGET])
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=31)
    args = ap.parse_args(argv)
    variants = {}  # name -> (model, fused?)
    for name, bits, fused in (("bf16", None, False), ("int8 per-op", 8, False), ("int8 fused", 8, True),
                              ("int4 per-op", 4, False), ("int4 fused", 4, True)):
        model = loader.load(args.model).model
        if bits and not model.quantize_weights(bits):
            continue
        model.fused_quantized = fused
        cache = KVCache.for_model(model.config, 1, args.context + 8, model.dtype)
        vocab = min(1000, model.config.vocab_size)
        model(torch.randint(0, vocab, (1, args.context)), torch.arange(args.context)[None], cache, num_logits=1)
        variants[name] = (model, cache)
    times = {(name, T): [] for name in variants for T in (1, 2)}
    for _ in range(args.repeats + 3):
        for name, (model, cache) in variants.items():
            for T in (1, 2):
                cache.truncate(args.context)
                ids, pos = torch.randint(0, vocab, (1, T)), torch.arange(args.context, args.context + T)[None]
                t0 = time.perf_counter()
                model(ids, pos, cache, num_logits=1)
                times[(name, T)].append(time.perf_counter() - t0)
    print(f"{args.model}, context {args.context}, {torch.get_num_threads()} threads; median ms per forward")
    print("| weights | T=1 (draft step) | T=2 (catch-up) |\n|---|---|---|")
    for name in variants:
        t1, t2 = (statistics.median(times[(name, T)][3:]) * 1e3 for T in (1, 2))
        print(f"| {name} | {t1:.1f} | {t2:.1f} |")


if __name__ == "__main__":
    main()
