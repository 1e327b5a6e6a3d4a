#!/usr/bin/env python3
"""Where a first native load of a default model spends its time (no native cache): parsing the GGUF header with
the gguf package's GGUFReader against verispec's GGUFIndex, then the whole load with the tokenizer built from the
GGUF metadata and read from the pulled model's directory. One process, back to back.

    python3 scripts/first_load.py [NAME]      # default: the default target
"""

from __future__ import annotations

import argparse
import os
import time


def main() -> None:
    from verispec.models.registry import DEFAULT_TARGET, REGISTRY

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("name", nargs="?", default=DEFAULT_TARGET, choices=list(REGISTRY))
    args = ap.parse_args()
    os.environ["VERISPEC_NATIVE_CACHE"] = "0"

    import torch
    from gguf import GGUFReader

    from verispec.errors import VerispecError
    from verispec.models import registry
    from verispec.models.gguf_reader import GGUFIndex
    from verispec.models.loader import load_gguf

    try:
        path = registry.gguf_path(args.name)
        pulled = registry.pull(args.name)
    except VerispecError as e:
        raise SystemExit(f"error: {e}") from None
    for label, read in (("GGUFReader", GGUFReader), ("GGUFIndex", GGUFIndex)):
        t = time.perf_counter()
        read(str(path))
        print(f"{args.name}: header with {label}: {time.perf_counter() - t:.2f} s", flush=True)
    for label, tokenizer_dir in (("from the GGUF metadata", None), ("from the pulled directory", pulled)):
        t = time.perf_counter()
        lm = load_gguf(path, torch.bfloat16, "cpu", native=True, name=args.name, tokenizer_dir=tokenizer_dir)
        print(f"{args.name}: native load, tokenizer {label}: {time.perf_counter() - t:.1f} s", flush=True)
        del lm


if __name__ == "__main__":
    main()
