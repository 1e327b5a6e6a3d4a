#!/usr/bin/env python3
"""Interleaved A/B of C++ kernel source trees on whole forwards of the default models.

    python3 scripts/kernel_ab.py NAME=DIR NAME=DIR [...] [--sizes 1,5,8] [--rounds 6] [--draft]

Each DIR is a copy of src/verispec/csrc (e.g. `git worktree` of another commit, or an edited copy). Each is
built as its own extension (its ops registered under NAME instead of verispec) and swapped, in turn, into one
loaded model: the default 1.5B native target, or with --draft the 4-bit 0.5B draft. The forwards run with a
128-token cache (200 for the draft). A round times 5 forwards of each size per tree. The report gives the
median over rounds of each round's median, and says whether each tree's logits are bitwise those of the first.
Rounds interleave the trees, so the VM's bandwidth swings hit them alike; between separate processes they
would not. A tree whose module reads an older GGUF layout (its gguf_layout(), 1 where it has none) runs on a
second copy of the target loaded in that layout.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from pathlib import Path


def build(name: str, src: Path, work: Path):
    """SRC's .cpp files built as extension NAME (module.cpp's op namespace renamed), cached under WORK."""
    from torch.utils.cpp_extension import load

    from verispec.errors import VerispecError

    files = sorted(src.glob("*.cpp"))
    if not (src / "module.cpp").is_file() or not (src / "kernels.h").is_file():
        raise VerispecError(f"{src} is not a copy of src/verispec/csrc (no module.cpp / kernels.h)")
    gen, out = work / f"src_{name}", work / f"build_{name}"
    gen.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    for f in [*files, src / "kernels.h"]:
        text = f.read_text()
        if f.name == "module.cpp":
            text = text.replace("TORCH_LIBRARY(verispec, m)", f"TORCH_LIBRARY({name}, m)")
            text = text.replace("TORCH_LIBRARY_IMPL(verispec, CPU, m)", f"TORCH_LIBRARY_IMPL({name}, CPU, m)")
        target = gen / f.name
        if not target.exists() or target.read_text() != text:  # unchanged sources: ninja rebuilds nothing
            target.write_text(text)
    return load(name, [str(gen / f.name) for f in files], extra_cflags=["-O3", "-fopenmp", "-fno-trapping-math"],
                extra_ldflags=["-fopenmp"], build_directory=str(out), verbose=False)


def parse(specs: list[str], flag: str, counts: str) -> tuple[list[tuple[str, Path]], list[int]]:
    """NAME=DIR arguments -> [(name, dir)], and a comma-separated list of counts (FLAG's value) -> ints."""
    from verispec.errors import VerispecError

    trees = []
    for spec in specs:
        name, _, path = spec.partition("=")
        if not name.isidentifier() or not path or name == "verispec":
            raise VerispecError(f"expected NAME=DIR with NAME a new identifier, got {spec!r}")
        trees.append((name, Path(path)))
    try:
        values = [int(v) for v in counts.split(",")]
    except ValueError:
        raise VerispecError(f"{flag}: integers separated by commas, got {counts!r}") from None
    return trees, values


@contextlib.contextmanager
def packing(layout: int):
    """models/gguf_native.py packs in an older GGUF layout meanwhile, for trees from before a layout change:
    1 (Q6_K a byte per q, as the kernels read it before the 6-bit layout) or 2 (Q4_K and Q6_K in the 4-row
    tiles of the other types, before csrc/linear_kquant.cpp); the current layout packs as it is."""
    from verispec.models import gguf_native as gn

    kinds, tiled = gn.KINDS, gn.TILED
    if layout <= 2:
        gn.TILED = ()
    if layout == 1:
        gn.KINDS = {**kinds, "Q6_K": (5, 210, 256, 8)}
    try:
        yield
    finally:
        gn.KINDS, gn.TILED = kinds, tiled


def old_layout_target(llm, capacity: int, layout: int):
    """The default target loaded again in an older GGUF layout (not from the native cache), and an empty cache."""
    import os

    from verispec.models.kv_cache import KVCache
    from verispec.models.loader import load

    cache_flag = os.environ.get("VERISPEC_NATIVE_CACHE")
    os.environ["VERISPEC_NATIVE_CACHE"] = "0"
    try:
        with packing(layout):
            model = load(llm.target.source, llm.dtype, "cpu", progress=False, weights="native").model
    finally:
        if cache_flag is None:
            os.environ.pop("VERISPEC_NATIVE_CACHE")
        else:
            os.environ["VERISPEC_NATIVE_CACHE"] = cache_flag
    return model, KVCache.for_model(model.config, 1, capacity, model.dtype)


def main(argv=None) -> int:
    from verispec.flags import Parser, run_tool

    ap = Parser(prog="python3 scripts/kernel_ab.py", description=__doc__.split("\n")[0])
    ap.add_argument("trees", nargs="+", metavar="NAME=DIR", help="source trees to compare (the first is the baseline)")
    ap.add_argument("--sizes", default="1,5,8", help="new tokens per forward, comma-separated (1-16)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--draft", action="store_true", help="time the 4-bit draft model instead of the native target")
    ap.add_argument("--work", default="kernel_ab_builds", help="where the builds go")
    return run_tool(ap, argv, report)  # bad input: one line, exit 2


def report(args) -> None:
    import torch

    from verispec import LLM, kernels
    from verispec.errors import VerispecError
    from verispec.models.kv_cache import KVCache
    from verispec.models.linear import Linear

    trees, sizes = parse(args.trees, "--sizes", args.sizes)
    if not all(1 <= T <= kernels.MAX_ROWS for T in sizes) or args.rounds < 1:
        raise VerispecError(f"--sizes must lie in 1..{kernels.MAX_ROWS} and --rounds be >= 1")
    mods = {name: build(name, path, Path(args.work)) for name, path in trees}

    torch.set_num_threads(2)
    llm = LLM(progress=False)
    model = llm.draft_model().model if args.draft else llm.target.model
    ctx = 200 if args.draft else 128
    cache = KVCache.for_model(model.config, 1, ctx + max(sizes), model.dtype)
    ids = torch.randint(0, model.config.vocab_size, (1, ctx + max(sizes)), generator=torch.Generator().manual_seed(0))
    model(ids[:, :ctx], torch.arange(ctx)[None], cache, num_logits=1)
    models = {kernels.GGUF_LAYOUT: (model, cache)}  # GGUF layout -> the model in it, its cache
    layouts = {name: getattr(mod, "gguf_layout", lambda: 1)() for name, mod in mods.items()}
    for layout in set(layouts.values()) - {kernels.GGUF_LAYOUT}:
        if not args.draft:
            models[layout] = old_layout_target(llm, ctx + max(sizes), layout)
    quantized = [m for m in model.modules() if isinstance(m, Linear) and m.qop is not None]
    times = {(n, T): [] for n in mods for T in sizes}
    logits = {}
    for _ in range(args.rounds):
        for name, mod in mods.items():
            kernels._C, kernels.ops = mod, getattr(torch.ops, name)
            for lin in quantized:  # ops bound at quantize time (the draft's LM head)
                lin.qop = getattr(kernels.ops, lin.qop._qualified_op_name.split("::")[1])
            model, cache = models[layouts[name]]
            if cache.length < ctx:  # that model's first tree: its cache filled by a kernel that reads its layout
                model(ids[:, :ctx], torch.arange(ctx)[None], cache, num_logits=1)
            for T in sizes:
                pos, ts = torch.arange(ctx, ctx + T)[None], []
                for _ in range(5):
                    cache.truncate(ctx)
                    t0 = time.perf_counter()
                    logits[name, T] = model(ids[:, ctx:ctx + T], pos, cache)[0]
                    ts.append(time.perf_counter() - t0)
                times[name, T].append(statistics.median(ts))
    first = trees[0][0]
    print(f"{'draft step' if args.draft else 'target forward'}, ms (median of {args.rounds} interleaved rounds)")
    print("| tree | " + " | ".join(f"T={T}" for T in sizes) + " | logits as the first tree's |")
    print("|---|" + "---|" * (len(sizes) + 1))
    for name in mods:
        ms = [statistics.median(times[name, T]) * 1e3 for T in sizes]
        same = all(torch.equal(logits[name, T], logits[first, T]) for T in sizes)
        print(f"| {name} | " + " | ".join(f"{v:.2f}" for v in ms) + f" | {'bitwise' if same else 'DIFFERENT'} |")


if __name__ == "__main__":
    sys.exit(main())
