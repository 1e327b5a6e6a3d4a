"""`verispec bench`: autoregressive decode speed against the memory-bandwidth floor and transformers.

For each prompt (methods interleaved, one warm-up each): our greedy AR decode and, with
``--peers hf``, transformers' ``generate`` on the same checkpoint and dtype. Decode ms/token excludes
the prefill: (wall(N tokens) - wall(prefill + first token)) / (N - 1) for both.
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

    b = sub.add_parser("bench", help="measure decode speed (ms/token) vs the bandwidth floor and transformers")
    _add_model_args(b)
    b.add_argument("--max-new-tokens", type=int, default=64)
    b.add_argument("--limit", type=int, default=None, help="number of built-in prompts (default: all)")
    b.add_argument("--peers", default="hf", choices=["hf", "none"], help="also time transformers (default: hf)")
    b.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    b.add_argument("--json", dest="json_out", default=None, help="write the full report to this JSON file")
    b.add_argument("--quick", action="store_true", help="2 prompts x 32 tokens")


def _decode_ms(wall_s: float, prefill_s: float, n: int) -> float:
    return 1e3 * (wall_s - prefill_s) / max(n - 1, 1)


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


def run_bench(args) -> int:
    from tqdm import tqdm

    from .. import LLM, SamplingParams
    from .hardware import environment, read_bandwidth_gbs
    from .peers import HFPeer
    from .prompts import DECODE_PROMPTS

    n_new = 32 if args.quick else args.max_new_tokens
    if n_new < 2:
        raise VerispecError("--max-new-tokens must be >= 2 for a decode benchmark")
    prompts = DECODE_PROMPTS[: (2 if args.quick else args.limit or len(DECODE_PROMPTS))]
    if not prompts:
        raise VerispecError("--limit must be >= 1")
    llm = LLM(target=args.target, dtype=args.dtype, device=args.device, threads=args.threads)
    peer = HFPeer(args.target, llm.dtype, llm.device) if args.peers == "hf" else None
    params = SamplingParams(max_new_tokens=n_new, ignore_eos=True)
    chat = not args.no_chat and llm.codec.has_tokenizer and bool(getattr(llm.codec.tok, "chat_template", None))
    if not llm.codec.has_tokenizer:
        raise VerispecError("the decode benchmark needs a model with a tokenizer")

    bandwidths = [read_bandwidth_gbs(device=llm.device)]  # measured again at the end: the best is the floor
    weight_bytes = llm.target.config.weight_bytes(llm.dtype.itemsize)

    encoded = [llm.codec.encode(p.text, chat=chat) for p in prompts]
    llm.generate(encoded[0], SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm-up
    if peer:
        peer.greedy(encoded[0], 4)
    runs = []
    for p, ids in tqdm(list(zip(prompts, encoded)), desc="bench", unit="prompt", file=sys.stderr):
        out = llm.generate(ids, params)
        s = out.stats
        run = {"prompt_id": p.id, "category": p.category, "prompt_tokens": len(ids), "new_tokens": s["new_tokens"],
               "ours_ms_per_token": _decode_ms(s["wall_s"], s["prefill_s"], s["new_tokens"]),
               "ours_tokens_per_s": s["tokens_per_s"], "ours_prefill_s": s["prefill_s"]}
        if peer:
            _, prefill = peer.greedy(ids, 1)
            hf_ids, wall = peer.greedy(ids, n_new)
            same = next((i for i, (a, b) in enumerate(zip(out.token_ids, hf_ids)) if a != b), len(hf_ids))
            run.update(hf_ms_per_token=_decode_ms(wall, prefill, n_new), hf_tokens_per_s=n_new / wall,
                       hf_prefill_s=prefill, identical_prefix_tokens=same)
        runs.append(run)

    curve = verify_cost_curve(llm)
    bandwidths.append(read_bandwidth_gbs(device=llm.device))
    bw = max(bandwidths)
    floor_ms = weight_bytes / (bw * 1e9) * 1e3
    med = lambda key: statistics.median(r[key] for r in runs)  # noqa: E731
    ours_ms = med("ours_ms_per_token")
    summary = {"ours_ms_per_token": ours_ms, "floor_ms_per_token": floor_ms, "ratio_to_floor": ours_ms / floor_ms,
               "read_bandwidth_gbs": bw, "read_bandwidth_samples_gbs": bandwidths, "weight_bytes": weight_bytes,
               "ours_spread_ms": [min(r["ours_ms_per_token"] for r in runs),
                                  max(r["ours_ms_per_token"] for r in runs)]}
    if peer:
        hf_ms = med("hf_ms_per_token")
        summary.update(hf_ms_per_token=hf_ms, speedup_vs_hf=hf_ms / ours_ms,
                       hf_spread_ms=[min(r["hf_ms_per_token"] for r in runs), max(r["hf_ms_per_token"] for r in runs)],
                       outputs_identical=sum(r["identical_prefix_tokens"] == n_new for r in runs))
    summary["verify_cost_ms"] = curve
    summary["verify_cost_ratio"] = {T: ms / curve[1] for T, ms in curve.items()}
    report = {"command": "verispec " + " ".join(sys.argv[1:]) if sys.argv[0].endswith("verispec") else None,
              "target": args.target, "dtype": args.dtype, "device": llm.device, "max_new_tokens": n_new,
              "chat": chat, "environment": environment(), "summary": summary, "runs": runs,
              "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    print(_markdown(report))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))
    return 0


def _markdown(r: dict) -> str:
    s, env = r["summary"], r["environment"]
    lines = [f"AR decode, {r['target']} ({r['dtype']}, {r['device']}, {env['torch_threads']} threads, "
             f"{env['cpu'] or env['cuda']}), {r['max_new_tokens']} new tokens, greedy, chat={r['chat']}", "",
             f"command: `{r['command']}`" if r.get("command") else "", "",
             "| prompt | tokens in | ours ms/token | hf ms/token | ours vs hf | same tokens as hf |",
             "|---|---|---|---|---|---|"]
    for run in r["runs"]:
        hf = run.get("hf_ms_per_token")
        lines.append(f"| {run['prompt_id']} | {run['prompt_tokens']} | {run['ours_ms_per_token']:.1f} | "
                     + (f"{hf:.1f} | {hf / run['ours_ms_per_token']:.2f}x | "
                        f"{run['identical_prefix_tokens']}/{run['new_tokens']} |" if hf else "- | - | - |"))
    lines += ["", f"- weights read per token: {s['weight_bytes'] / 1e9:.2f} GB; measured read bandwidth "
                  f"{s['read_bandwidth_gbs']:.1f} GB/s (best of "
                  f"{', '.join(f'{b:.1f}' for b in s['read_bandwidth_samples_gbs'])}, before and after) "
                  f"-> floor {s['floor_ms_per_token']:.1f} ms/token",
              f"- ours: median {s['ours_ms_per_token']:.1f} ms/token (spread {s['ours_spread_ms'][0]:.1f}-"
              f"{s['ours_spread_ms'][1]:.1f}) = {s['ratio_to_floor']:.2f}x the floor"]
    lines.append("- one target forward over T new tokens (warm cache): " + ", ".join(
        f"T={T}: {ms:.1f} ms ({s['verify_cost_ratio'][T]:.2f}x)" for T, ms in s["verify_cost_ms"].items()))
    if "hf_ms_per_token" in s:
        lines.append(f"- transformers: median {s['hf_ms_per_token']:.1f} ms/token (spread {s['hf_spread_ms'][0]:.1f}-"
                     f"{s['hf_spread_ms'][1]:.1f}); ours is {s['speedup_vs_hf']:.2f}x faster; "
                     f"identical outputs on {s['outputs_identical']}/{len(r['runs'])} prompts")
    return "\n".join(lines)
