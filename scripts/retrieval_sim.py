#!/usr/bin/env python3
"""Would retrieval drafting (REST: He et al. 2023, arXiv:2311.08252) pay here? A replay, not a drafter.

    python3 scripts/retrieval_sim.py --corpus /usr/lib/python3.11 [--corpus-chars 40000000] [--categories coding,math]

Tokenizes the .py files under --corpus with the target's tokenizer into one datastore (files in a fixed
shuffled order, up to --corpus-chars characters), sorts its positions by the D = 12 tokens that follow them,
and generates the target's greedy answers (256 new tokens, chat template) to the built-in suite's prompts of
--categories. Then it replays rounds of K drafts against those answers, for each rule:
- ng: n-gram lookup in prompt + answer so far (the ngram drafter, n = 4..1);
- ds: the datastore: the longest suffix of the context (n = 8..2) found at least twice, continued token by
  token with the most frequent next token while that continuation was seen at least twice;
- ng_then_ds: ng when its match has n >= 2, else ds; best: whichever of the two the answer accepts more of.
A round accepts the drafts' longest prefix that matches the answer, plus one token; tau = tokens per round.
"""

from __future__ import annotations

import bisect
import random
import sys

D = 12  # tokens that order the datastore's positions: a match of n continues for at most D - n tokens


def build(tok, files: list, max_chars: int):
    """``files`` in a fixed shuffled order, up to ``max_chars`` characters, as one token array (-1 after each
    file) -> (tokens padded with D + 1 x -1, positions sorted by their next D tokens, characters read)."""
    import numpy as np

    from verispec.errors import VerispecError

    files = list(files)
    random.Random(0).shuffle(files)
    texts, n = [], 0
    for f in files:
        if n >= max_chars:
            break
        try:
            s = f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        texts.append(s)
        n += len(s)
    if not texts:
        raise VerispecError("--corpus: no readable UTF-8 .py files")
    tokens = np.concatenate([np.array(ids + [-1], dtype=np.int32) for ids in tok(texts).input_ids])
    pad = np.concatenate([tokens, np.full(D + 1, -1, np.int32)])
    order = np.lexsort([pad[i:i + len(tokens)] for i in range(D - 1, -1, -1)])  # positions by their next D tokens
    return pad, order, n


class Datastore:
    def __init__(self, pad, order):
        self.pad, self.order = pad, order

    def _range(self, key: tuple, lo: int, hi: int) -> tuple[int, int]:
        """The positions in order[lo:hi] whose next len(key) tokens are key: [first, last + 1)."""
        n = len(key)
        at = lambda p: tuple(self.pad[p:p + n].tolist())  # noqa: E731
        return (bisect.bisect_left(self.order, key, lo, hi, key=at),
                bisect.bisect_right(self.order, key, lo, hi, key=at))

    def draft(self, ctx: list[int], K: int, n_max: int = 8, n_min: int = 2, support: int = 2) -> list[int]:
        import numpy as np

        for n in range(min(n_max, len(ctx)), n_min - 1, -1):
            key = tuple(ctx[-n:])
            lo, hi = self._range(key, 0, len(self.order))
            if hi - lo < support:
                continue
            out = []
            for j in range(n, min(n + K, D)):
                idx = np.arange(lo, hi) if hi - lo <= 20000 else np.linspace(lo, hi - 1, 20000).astype(np.int64)
                vals, counts = np.unique(self.pad[self.order[idx] + j], return_counts=True)
                t = int(vals[np.argmax(counts)])
                if t < 0:
                    break
                lo2, hi2 = self._range(key + tuple(out) + (t,), lo, hi)
                if hi2 - lo2 < support:
                    break
                out.append(t)
                lo, hi = lo2, hi2
            return out
        return []


def accepted(draft: list[int], answer: list[int]) -> int:
    a = 0
    for x, y in zip(draft, answer):
        if x != y:
            break
        a += 1
    return a


def main(argv=None) -> int:
    from verispec.cli import _Parser, run_tool

    ap = _Parser(prog="python3 scripts/retrieval_sim.py", description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", nargs="+", required=True, metavar="DIR")
    ap.add_argument("--corpus-chars", type=int, default=40_000_000)
    ap.add_argument("--categories", default="coding,math")
    ap.add_argument("-K", type=int, default=4)
    return run_tool(ap, argv, replay)


def replay(args) -> None:
    from verispec import LLM, SamplingParams
    from verispec.bench.prompts import builtin_suite
    from verispec.draft_vocab import corpus_files
    from verispec.drafters.ngram import NgramIndex
    from verispec.errors import VerispecError

    if args.corpus_chars < 1 or args.K < 1:
        raise VerispecError("--corpus-chars and -K must be >= 1")
    files = [f for f in corpus_files(args.corpus) if f.suffix == ".py"]  # draft_vocab's walk, .py only
    if not files:
        raise VerispecError(f"--corpus: no .py files under {' '.join(args.corpus)}")
    cats = args.categories.split(",")
    prompts = [p for p in builtin_suite() if p.category in cats]
    if not prompts:
        raise VerispecError(f"--categories {args.categories}: no such category in the built-in suite")
    llm = LLM(progress=False)
    pad, order, chars = build(llm.codec.tok, files, args.corpus_chars)
    store = Datastore(pad, order)
    print(f"datastore: {len(order):,} tokens from {chars:,} characters")
    rules = ("ng", "ds", "ng_then_ds", "best")
    print("| prompt | " + " | ".join(f"{r} tau" for r in rules) + " |")
    print("|---|" + "---|" * len(rules))
    for p in prompts:
        prompt = llm.codec.encode(p.text, chat=True)
        answer = llm.generate(p.text, SamplingParams(max_new_tokens=256), method="ar", chat=True).token_ids
        taus = []
        for rule in rules:
            i, rounds, index = 0, 0, NgramIndex(1, 4)
            while i < len(answer):
                ctx, ref = prompt + answer[:i], answer[i:i + args.K]
                index.extend(ctx)
                ng, n = index.lookup(args.K)
                ds = store.draft(ctx, args.K) if rule != "ng" else []
                draft = {"ng": ng, "ds": ds, "ng_then_ds": ng if n >= 2 else ds,
                         "best": max(ng, ds, key=lambda d: accepted(d, ref))}[rule]
                i += accepted(draft, ref) + 1
                rounds += 1
            taus.append(len(answer) / rounds)
        print(f"| {p.id} | " + " | ".join(f"{t:.2f}" for t in taus) + " |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
