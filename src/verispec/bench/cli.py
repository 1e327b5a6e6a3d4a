"""`verispec bench`: decode speed against the bandwidth floor and transformers, and speculative methods
against our own AR in the same run.

Per prompt, interleaved: our AR (the baseline), transformers' ``generate`` on the same checkpoint and
dtype (``--peers hf``), then every speculative method at every K. One warm-up each first. Speedup =
AR wall time / method wall time for the same prompt, prefill included; medians per category.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

from ..errors import VerispecError


def add_bench_parser(sub) -> None:
    from ..cli import _add_model_args

    b = sub.add_parser("bench", help="decode speed vs the bandwidth floor and transformers; speculative speedups")
    _add_model_args(b)
    b.add_argument("--methods", default="ar", help="comma-separated: ar plus speculative methods, e.g. ar,draft")
    b.add_argument("--num-draft-tokens", default="4", help="K for speculative methods: one value or a list, e.g. 2,4,6,8")
    b.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    b.add_argument("--seed", type=int, default=0, help="sampling seed (temperature > 0)")
    b.add_argument("--max-new-tokens", type=int, default=64)
    b.add_argument("--limit", type=int, default=None, help="number of built-in prompts (default: all)")
    b.add_argument("--peers", default="hf", choices=["hf", "none"], help="also time transformers (default: hf)")
    b.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    b.add_argument("--json", dest="json_out", default=None, help="write the full report to this JSON file")
    b.add_argument("--quick", action="store_true", help="2 prompts x 32 tokens")


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise VerispecError(f"{flag} takes integers, e.g. 2,4,6,8; got {text!r}") from None
    if not values or min(values) < 1:
        raise VerispecError(f"{flag} values must be >= 1, got {text!r}")
    return values


def run_bench(args) -> int:
    from tqdm import tqdm

    from .. import LLM, SamplingParams, drafters
    from ..config import SpecConfig
    from .hardware import environment, read_bandwidth_gbs
    from .peers import HFPeer
    from .prompts import DECODE_PROMPTS
    from .report import markdown, summarize

    n_new = 32 if args.quick else args.max_new_tokens
    if n_new < 2:
        raise VerispecError("--max-new-tokens must be >= 2 for a decode benchmark")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m != "ar" and m not in drafters.METHODS]
    if unknown or "ar" not in methods:
        raise VerispecError(f"--methods must include ar and may add {', '.join(drafters.METHODS)}; got {args.methods!r}")
    ks = _int_list(args.num_draft_tokens, "--num-draft-tokens")
    spec_runs = [SpecConfig(m, k) for m in methods if m != "ar" for k in ks]
    prompts = DECODE_PROMPTS[: (2 if args.quick else args.limit or len(DECODE_PROMPTS))]
    if not prompts:
        raise VerispecError("--limit must be >= 1")
    llm = LLM(target=args.target, draft=args.draft, dtype=args.dtype, device=args.device, threads=args.threads,
              draft_quant=args.draft_quant)
    if not llm.codec.has_tokenizer:
        raise VerispecError("the benchmark needs a model with a tokenizer")
    if spec_runs:  # build one drafter now so the draft model loads here, not inside a timed run
        drafters.METHODS[spec_runs[0].method](llm)
    params = SamplingParams(max_new_tokens=n_new, ignore_eos=True, temperature=args.temperature, seed=args.seed)
    masked = [] if llm.logit_mask is None else llm.logit_mask.nonzero().flatten().tolist()
    peer = HFPeer(args.target, llm.dtype, llm.device, masked) if args.peers == "hf" else None
    chat = not args.no_chat and bool(getattr(llm.codec.tok, "chat_template", None))

    bandwidths = [read_bandwidth_gbs(device=llm.device)]  # measured again at the end: the best is the floor
    encoded = [llm.codec.encode(p.text, chat=chat) for p in prompts]
    warm = SamplingParams(max_new_tokens=4, ignore_eos=True)
    llm.generate(encoded[0], warm)
    for spec in spec_runs:
        llm.generate(encoded[0], warm, method=spec.method, num_draft_tokens=spec.num_draft_tokens)
    if peer:
        peer.greedy(encoded[0], 4)

    runs = []
    for p, ids in tqdm(list(zip(prompts, encoded)), desc="bench", unit="prompt", file=sys.stderr):
        ar = llm.generate(ids, params)
        runs.append(_run_record(p, ids, "ar", None, ar.stats, ar.token_ids, ar.token_ids))
        if peer:
            _, prefill = peer.greedy(ids, 1)
            hf_ids, wall = peer.greedy(ids, n_new)
            runs[-1].update(hf_ms_per_token=1e3 * (wall - prefill) / (n_new - 1), hf_tokens_per_s=n_new / wall,
                            hf_prefill_s=prefill, hf_identical_prefix_tokens=_common_prefix(ar.token_ids, hf_ids))
        for spec in spec_runs:
            out = llm.generate(ids, params, method=spec.method, num_draft_tokens=spec.num_draft_tokens)
            rec = _run_record(p, ids, spec.method, spec.num_draft_tokens, out.stats, out.token_ids, ar.token_ids)
            rec["speedup"] = ar.stats["wall_s"] / out.stats["wall_s"]
            runs.append(rec)
    curve = verify_cost_curve(llm)
    bandwidths.append(read_bandwidth_gbs(device=llm.device))
    weight_bytes = llm.target.config.weight_bytes(llm.dtype.itemsize)
    report = {
        "command": "verispec " + " ".join(sys.argv[1:]) if Path(sys.argv[0]).name == "verispec" else None,
        "target": args.target, "draft": llm.draft.source if llm.draft else None, "dtype": args.dtype,
        "draft_quant": args.draft_quant,
        "device": llm.device, "max_new_tokens": n_new, "temperature": args.temperature, "chat": chat,
        "environment": environment(), "time": time.strftime("%Y-%m-%d %H:%M:%S"), "runs": runs,
        "summary": summarize(runs, weight_bytes, bandwidths, curve, greedy=params.greedy),
    }
    print(markdown(report))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))
    return 0


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _run_record(prompt, ids, method, k, stats: dict, tokens: list[int], ar_tokens: list[int]) -> dict:
    keys = ("new_tokens", "wall_s", "tokens_per_s", "prefill_s", "target_s", "target_forwards",
            "mean_accepted_length", "decode_ms_per_token", "draft_s", "drafted_tokens", "accepted_tokens",
            "acceptance_rate", "per_position_acceptance", "per_position_reached")
    rec = {"method": method, "num_draft_tokens": k, "category": prompt.category, "prompt_id": prompt.id,
           "prompt_tokens": len(ids), **{key: stats[key] for key in keys if key in stats}}
    rec["identical_to_ar"] = tokens == ar_tokens
    return rec


def verify_cost_curve(llm, sizes=(1, 2, 4, 8, 16), context: int = 128, repeats: int = 8) -> dict[int, float]:
    """ms of one target forward over T new tokens (warm cache of ``context`` tokens), for each T."""
    import torch

    from ..models.kv_cache import KVCache

    model, cfg = llm.target.model, llm.target.config
    cache = KVCache.for_model(cfg, 1, context + max(sizes), llm.dtype, llm.device)
    ids = torch.randint(0, cfg.vocab_size, (1, context + max(sizes)), generator=torch.Generator().manual_seed(0))
    ids = ids.to(llm.device)
    model(ids[:, :context], torch.arange(context, device=llm.device)[None], cache, num_logits=1)
    out = {}
    for T in sizes:
        pos = torch.arange(context, context + T, device=llm.device)[None]
        times = []
        for _ in range(repeats + 2):
            cache.truncate(context)
            t0 = time.perf_counter()
            model(ids[:, context:context + T], pos, cache)
            if llm.device.startswith("cuda"):
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        out[T] = 1e3 * statistics.median(times[2:])
    return out
