#!/usr/bin/env python3
"""Interleaved A/B of two layouts for the 4-bit draft on the default pair: verispec's linear_q4 (the default:
4-bit, fp16 scale and min per group of 32, one int8 scale per activation row) against GGUF Q4_0 blocks made
from the same float weights and run as native GGUF matrices on linear_gguf (one fp16 scale per 32, int8
activations per block of 512). Tried in the sixteenth session, not kept (docs/BENCHMARKS.md).

    python3 scripts/draft_quant_ab.py [--rounds 2] [--prompts 4] [--categories coding] [--no-early-stop]

Loads the default target and the default 4-bit draft, adds a Q4_0 copy of each draft matrix (calls of up to 16
rows run on it, longer ones keep the float path, as linear_q4's do), then prints (1) each draft's forward
time over T = 1, 2, 4, 8 and 58 new tokens after 200 cached ones (the two taking turns), and (2) greedy
speculative generation (method draft, K 4, early stops unless --no-early-stop, 64 new tokens, chat template;
without early stops every number but the time is deterministic) on the first --prompts
prompts of each category of the built-in suite, the two drafts taking turns prompt by prompt, --rounds times:
median ms per token, acceptance, draft seconds, target forwards, and whether every output equals AR's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def main(argv=None) -> int:
    from verispec.cli import _Parser, run_tool

    ap = _Parser(prog="python3 scripts/draft_quant_ab.py", description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=4, help="prompts per category (default 4)")
    ap.add_argument("--categories", default="coding", help="comma-separated suite categories (default coding)")
    ap.add_argument("--early-stop", action=argparse.BooleanOptionalAction, default=True)
    return run_tool(ap, argv, run)  # bad input: one line, exit 2


def forward_ms(swap, names: dict, T: int, reps: int) -> dict:
    """{name: median ms of a forward over T new tokens after 200 cached ones}, the layouts taking turns."""
    import torch

    from verispec.models.kv_cache import KVCache

    model = swap.model
    ids = torch.randint(0, 1000, (1, 200 + T), generator=torch.Generator().manual_seed(T))
    cache = KVCache.for_model(model.config, 1, 200 + T, model.dtype)
    model(ids[:, :200], torch.arange(200)[None], cache, num_logits=1)  # the float path: the same cache for both
    times = {name: [] for name in names}
    for _ in range(reps):
        for name, q4_0 in names.items():
            swap.use(q4_0)
            cache.truncate(200)
            t0 = time.perf_counter()
            model(ids[:, 200:], torch.arange(200, 200 + T)[None], cache, num_logits=1)
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) * 1e3 for name, ts in times.items()}


def quantize_q4_0(w):
    """[N, K] float weight -> GGUF Q4_0 as gguf_native.decode gives it: (q [N, K] uint8 in 0..15, scales
    [N, K/32, 2] uint8, each group's fp16 d). llama.cpp's rule per group of 32: d = (the value of largest
    magnitude, the positive one on a tie) / -8, q = trunc(w / d + 8.5) clamped to 0..15, w ~ d (q - 8); q is
    chosen against d rounded to fp16, the d the kernel uses."""
    import torch

    N, K = w.shape
    q, scales = torch.empty(N, K, dtype=torch.uint8), torch.empty(N, K // 32, 2, dtype=torch.uint8)
    for r in range(0, N, 1024):  # in slices: small temporaries
        g = w[r:r + 1024].detach().to(torch.float32, copy=True).reshape(-1, K // 32, 32)  # [R, G, 32]
        hi, lo = g.amax(-1, keepdim=True), g.amin(-1, keepdim=True)  # [R, G, 1]
        d = (torch.where(hi >= -lo, hi, lo) / -8).half()
        inv = torch.where(d == 0, 0.0, 1.0 / d.float())
        q[r:r + 1024] = g.mul_(inv).add_(8.5).trunc_().clamp_(0, 15).reshape(-1, K)
        scales[r:r + 1024] = d.view(torch.uint8)
    return q.numpy(), scales.numpy()


class Swap:
    """The draft's matrices switched between their linear_q4 copy and a Q4_0 one (the fused layer is rebuilt)."""

    def __init__(self, model):
        from verispec.errors import VerispecError
        from verispec.models import gguf_native, hugepages
        from verispec.models.linear import Linear

        self.model, self.mats = model, {}
        for m in model.modules():
            if isinstance(m, Linear) and m.qop is not None:
                if not gguf_native.supported("Q4_0", m.in_features):
                    raise VerispecError(f"a draft matrix with K = {m.in_features}: no Q4_0 kernel")
                part = gguf_native.NativePart("Q4_0", *quantize_q4_0(m.dense_weight()))
                self.mats[m] = ((m.qweights, m.qop), (gguf_native.NativeWeight.from_parts([part]).tensors,
                                                        linear_gguf_as_qop))
        self.use(True)  # the Q4_0 tensors into 2 MB pages too, as quantize_weights placed linear_q4's
        for m in self.mats:
            m.in_huge_pages = False
        hugepages.place_model(model)
        self.mats = {m: (pair[0], (m.qweights, m.qop)) for m, pair in self.mats.items()}

    def use(self, q4_0: bool) -> None:
        for m, pair in self.mats.items():
            m.qweights, m.qop = pair[q4_0]
        for layer in self.model.layers:
            layer._fused = None


def linear_gguf_as_qop(x, q, s, meta, bias, n):
    """linear_gguf behind linear_q4's signature (x, *weights, bias, N), as Linear.forward calls a qop."""
    import torch

    return torch.ops.verispec.linear_gguf(x, q, s, meta, bias)


def run(args) -> None:
    import torch

    from verispec import LLM, SamplingParams
    from verispec.bench.prompts import builtin_suite, select
    from verispec.errors import VerispecError

    if args.rounds < 1 or args.prompts < 1:
        raise VerispecError("--rounds and --prompts must be >= 1")
    suite = select(builtin_suite(), args.categories.split(","), args.prompts)  # unknown category: one-line error
    torch.set_num_threads(2)
    llm = LLM(progress=False)
    draft = llm.draft_model()
    swap = Swap(draft.model)
    names = {"linear_q4": False, "Q4_0 (linear_gguf)": True}

    print("draft forward, ms (median of 25, 5 for T = 58, the layouts taking turns), after 200 cached tokens")
    print("| T | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
    for T in (1, 2, 4, 8, 58):
        ms = forward_ms(swap, names, T, 25 if T <= 16 else 5)
        print(f"| {T} | " + " | ".join(f"{v:.1f}" for v in ms.values()) + " |", flush=True)

    params = SamplingParams(max_new_tokens=64)
    ar = {p.id: llm.generate(p.text, params, chat=True).token_ids for p in suite}
    rows = []  # (layout, category, stats, identical to AR)
    for _ in range(args.rounds):
        for p in suite:
            for name, q4_0 in names.items():
                swap.use(q4_0)
                out = llm.generate(p.text, params, method="draft", num_draft_tokens=4, chat=True,
                                   early_stop=args.early_stop)
                rows.append((name, p.category, out.stats, out.token_ids == ar[p.id]))
    print(f"\ngreedy, method draft K=4, early stops {'on' if args.early_stop else 'off'}, 64 new tokens, "
          f"{len(suite)} prompts x {args.rounds} rounds")
    print("| draft | prompts | ms/token (median) | alpha | draft s (sum) | target forwards (sum) | identical to AR |")
    print("|---|---|---|---|---|---|---|")
    categories = list(dict.fromkeys(c for _, c, _, _ in rows))
    for name in names:
        for cat in categories + (["all"] if len(categories) > 1 else []):
            rs = [(st, same) for n, c, st, same in rows if n == name and cat in (c, "all")]
            st = [s for s, _ in rs]
            alpha = sum(s["accepted_tokens"] for s in st) / max(1, sum(s["drafted_tokens"] for s in st))
            print(f"| {name} | {cat} | {statistics.median(s['decode_ms_per_token'] for s in st):.1f} | {alpha:.3f} | "
                  f"{sum(s['draft_s'] for s in st):.2f} | {sum(s['target_forwards'] for s in st)} | "
                  f"{sum(same for _, same in rs)}/{len(rs)} |")

if __name__ == "__main__":
    sys.exit(main())
