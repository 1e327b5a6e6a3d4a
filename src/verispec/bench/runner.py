"""One benchmark prompt: every method and peer on it, interleaved, as JSON-ready run records."""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time

from ..config import SamplingParams, SpecConfig
from ..models.kv_cache import common_prefix


def run_prompt(llm, prompt, ids: list[int], params: SamplingParams, spec_runs: list[tuple[str, SpecConfig, object]],
               peers=(), shared: int = 0) -> tuple[list[dict], list[dict]]:
    """Our AR (the baseline), each peer's modes, then every speculative method/K on one prompt.

    ``spec_runs``: (label, SpecConfig, the LLM that runs it: ``llm`` or one sharing its target with another
    draft format).
    ``shared``: tokens this prompt shares with the one run before it. Each speculative run's draft model may
    start from that much of its last KV cache (llm.draft_prefixes), as a server's would after serving the other
    prompt, never from this prompt's own earlier runs.
    Returns (our run records, peer run records). Speedup = our AR wall / method wall, same prompt. A peer mode that
    fails on the prompt (an exception, its timeout, a context too small) is a record with its ``error`` instead of
    timings, and the run goes on.
    """
    ar = llm.generate(ids, params)
    runs = [_record(prompt, ids, "ar", "ar", None, ar.stats, True)]
    peer_runs = []
    n_new = params.max_new_tokens
    for peer in peers:
        for mode in peer.modes:
            where = {"peer": mode, "category": prompt.category, "prompt_id": prompt.id}
            try:
                if mode == "hf" and params.greedy:  # decode-only time of transformers' plain generate (decode table)
                    _, prefill = peer.generate(ids, 1, "hf", params)
                tokens, wall = peer.generate(ids, n_new, mode, params)
                if len(tokens) != n_new:
                    raise RuntimeError(f"{len(tokens)} tokens, asked for {n_new}")
            except Exception as e:  # a peer failing on one prompt is its result there; the run goes on
                peer_runs.append({**where, "error": peer_error(e)})
                print(f"verispec: peer {mode} failed on {prompt.id}: {peer_runs[-1]['error']}", file=sys.stderr)
                continue
            peer_runs.append({**where, "new_tokens": len(tokens), "wall_s": wall, "tokens_per_s": len(tokens) / wall,
                              "identical_to_ar": tokens == ar.token_ids if params.greedy else None})
            if mode == "hf" and params.greedy:
                runs[0].update(hf_ms_per_token=1e3 * (wall - prefill) / (n_new - 1), hf_tokens_per_s=n_new / wall,
                               hf_prefill_s=prefill, hf_identical_prefix_tokens=common_prefix(ar.token_ids, tokens))
    for name, spec, owner in spec_runs:
        owner.draft_prefixes.limit(shared)
        out = owner.generate(ids, params, **dataclasses.asdict(spec))
        rec = _record(prompt, ids, name, spec.method, spec.num_draft_tokens, out.stats, out.token_ids == ar.token_ids)
        rec["speedup"] = ar.stats["wall_s"] / out.stats["wall_s"]
        rec["adaptive"] = spec.adaptive
        rec["early_stop"] = spec.early_stop
        runs.append(rec)
    return runs, peer_runs


def peer_error(e: BaseException) -> str:
    """A peer's failure in one line: its type and the first line of its message, at most 300 characters."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:300] if lines else '(no message)'}"


def _record(prompt, ids, name: str, method: str, k: int | None, stats: dict, identical: bool) -> dict:
    keys = ("new_tokens", "wall_s", "tokens_per_s", "prefill_s", "target_s", "target_forwards",
            "mean_accepted_length", "decode_ms_per_token", "draft_s", "drafted_tokens", "accepted_tokens",
            "acceptance_rate", "per_position_acceptance", "per_position_reached", "drafter_rounds",
            "drafter_tokens")
    return {"label": name, "method": method, "num_draft_tokens": k, "category": prompt.category,
            "prompt_id": prompt.id, "prompt_tokens": len(ids), "acceptance_rate": None, "per_position_acceptance": [],
            **{key: stats[key] for key in keys if key in stats}, "identical_to_ar": identical}


def verify_cost_curve(llm, sizes=tuple(range(1, 17)), context: int = 128, repeats: int = 8) -> dict[int, float]:
    """ms of one target forward over T new tokens (warm cache of ``context`` tokens), for each T: the median
    of ``repeats`` rounds that each time every size once, after two rounds of warm-up. Sizes one after the
    other (all of T = 1 first) let a slow spell land on one size (seen right after the bandwidth probe:
    docs/BENCHMARKS.md, "Verify cost curve v(T)")."""
    import torch

    from ..models.kv_cache import KVCache

    model, cfg = llm.target.model, llm.target.config
    cache = KVCache.for_model(cfg, 1, context + max(sizes), llm.dtype, llm.device)
    ids = torch.randint(0, cfg.vocab_size, (1, context + max(sizes)), generator=torch.Generator().manual_seed(0))
    ids = ids.to(llm.device)
    model(ids[:, :context], torch.arange(context, device=llm.device)[None], cache, num_logits=1)
    times = {T: [] for T in sizes}
    for _ in range(repeats + 2):
        for T in sizes:
            pos = torch.arange(context, context + T, device=llm.device)[None]
            cache.truncate(context)
            t0 = time.perf_counter()
            model(ids[:, context:context + T], pos, cache)
            if llm.device.startswith("cuda"):
                torch.cuda.synchronize()
            times[T].append(time.perf_counter() - t0)
    return {T: 1e3 * statistics.median(ts[2:]) for T, ts in times.items()}
