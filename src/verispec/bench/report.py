"""Benchmark summaries (medians per category and overall, predicted beside measured) and the Markdown report."""

from __future__ import annotations

import statistics

from ..spec.costs import joint as joint_rates, predicted_speedup

# transformers' mode -> our method doing the same thing (compared at its best K)
PEER_COUNTERPART = {"hf": "ar", "hf-assistant": "draft", "hf-lookup": "ngram", "llamacpp": "ar", "llamacpp-lookup": "ngram"}


def peer_plain(mode: str) -> str:
    """A peer mode's plain generation, its own baseline: hf-lookup -> hf, llamacpp-lookup -> llamacpp."""
    return mode.split("-")[0]


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _spread(values: list[float]) -> list[float]:
    return [min(values), max(values)]


def _method_stats(rs: list[dict], ar_by_prompt: dict[str, dict], curve_ratio: dict[int, float]) -> dict:
    """Aggregate the runs of one method (one K) over some prompts."""
    med = lambda key: statistics.median(r[key] for r in rs)  # noqa: E731
    out = {"prompts": len(rs), "tokens_per_s": med("tokens_per_s"), "tau": med("mean_accepted_length"),
           "identical_to_ar": sum(r["identical_to_ar"] for r in rs)}
    if rs[0]["method"] == "ar":
        return {**out, "speedup": 1.0, "decode_speedup": 1.0, "alpha": None}
    speedups = [r["speedup"] for r in rs]
    # the same without the target's prefill, which every method pays alike: AR decode ms/token / the method's
    # (a drafter's catch-up on the prompt is in its decode time), same prompt
    decode_speedups = [ar_by_prompt[r["prompt_id"]]["decode_ms_per_token"] / r["decode_ms_per_token"] for r in rs]
    drafted = sum(r["drafted_tokens"] for r in rs)
    K = max(len(r["per_position_reached"]) for r in rs)
    reached, accepted = [0] * K, [0] * K
    for r in rs:
        for i, (rate, n) in enumerate(zip(r["per_position_acceptance"], r["per_position_reached"])):
            reached[i] += n
            accepted[i] += round((rate or 0.0) * n)
    # c: draft cost per drafted token / target cost per AR token, same prompt
    costs = [(r["draft_s"] / r["drafted_tokens"]) / (ar_by_prompt[r["prompt_id"]]["decode_ms_per_token"] / 1e3)
             for r in rs if r["drafted_tokens"]]
    per_position = [a / n if n else None for a, n in zip(accepted, reached)]
    joint = joint_rates(per_position)
    c = statistics.median(costs) if costs else 0.0  # no draft time at all: a free drafter
    return {**out, "speedup": statistics.median(speedups), "speedup_spread": _spread(speedups),
            "decode_speedup": statistics.median(decode_speedups),
            "alpha": sum(r["accepted_tokens"] for r in rs) / drafted if drafted else 0.0,
            # below K: early stops, short n-gram matches
            "drafts_per_round": drafted / reached[0] if K and reached[0] else 0.0,
            "per_position_acceptance": per_position,
            "per_position_joint": joint,  # P(all of the first i+1 drafts accepted)
            "cost_ratio_c": c,  # the model assumes K drafts every round: no prediction when K varies
            "predicted_speedup": None if rs[0].get("adaptive") or rs[0].get("early_stop")
            else predicted_speedup(per_position, c, curve_ratio)}


def summarize(runs: list[dict], peer_runs: list[dict], weight_bytes: int, bandwidths: list[float],
              curve: dict[int, float], greedy: bool) -> tuple[dict, dict]:
    """-> (summary {decode, overall, by_category, greedy}, peers {PEER: {...}})."""
    ar = [r for r in runs if r["method"] == "ar"]
    ar_by_prompt = {r["prompt_id"]: r for r in ar}
    ours_ms = statistics.median(r["decode_ms_per_token"] for r in ar)
    bw = max(bandwidths)
    floor_ms = weight_bytes / (bw * 1e9) * 1e3
    decode = {"ours_ms_per_token": ours_ms, "ours_spread_ms": _spread([r["decode_ms_per_token"] for r in ar]),
              "floor_ms_per_token": floor_ms, "ratio_to_floor": ours_ms / floor_ms, "read_bandwidth_gbs": bw,
              "read_bandwidth_samples_gbs": bandwidths, "weight_bytes": weight_bytes,
              "verify_cost_ms": curve, "verify_cost_ratio": {T: ms / curve[1] for T, ms in curve.items()},
              # the target's prefill: its median share of an AR run's wall time, and ms per prompt token
              "prefill_share": statistics.median(r["prefill_s"] / r["wall_s"] for r in ar),
              "prefill_ms_per_prompt_token": statistics.median(1e3 * r["prefill_s"] / r["prompt_tokens"] for r in ar)}
    hf = [r for r in ar if "hf_ms_per_token" in r]  # the prompts where transformers' plain run did not fail
    if hf:
        hf_ms = [r["hf_ms_per_token"] for r in hf]
        decode.update(hf_ms_per_token=statistics.median(hf_ms), hf_spread_ms=_spread(hf_ms),
                      speedup_vs_hf=statistics.median(hf_ms) / ours_ms, hf_prompts=len(hf),
                      outputs_identical=sum(r["hf_identical_prefix_tokens"] == r["new_tokens"] for r in hf))
    ratio = decode["verify_cost_ratio"]
    labels = list(dict.fromkeys(r["label"] for r in runs))
    categories = list(dict.fromkeys(r["category"] for r in runs))
    overall = {lb: _method_stats([r for r in runs if r["label"] == lb], ar_by_prompt, ratio) for lb in labels}
    by_category = {c: {lb: _method_stats([r for r in runs if r["label"] == lb and r["category"] == c], ar_by_prompt,
                                         ratio) for lb in labels} for c in categories}
    summary = {"decode": decode, "overall": overall, "by_category": by_category, "greedy": greedy}
    return summary, _peer_stats(runs, peer_runs, overall, categories)


def _peer_stats(runs: list[dict], peer_runs: list[dict], overall: dict, categories: list[str]) -> dict:
    """Each peer mode: tokens/s; its speedup over the same peer's plain generation (same prompt); ours/theirs =
    tokens/s of our counterpart method (its best K overall) / theirs, same prompt; best/theirs = the same for our
    fastest method overall (AR included). A mode's failures (records with an ``error``) are listed, not measured:
    ``failures`` [{prompt_id, category, error}], and ``failed`` counts them per category."""
    ours = {(r["label"], r["prompt_id"]): r for r in runs}
    measured = [r for r in peer_runs if "error" not in r]
    plain = {(r["peer"], r["prompt_id"]): r for r in measured}
    best = max(overall, key=lambda lb: overall[lb]["speedup"])  # AR's is 1.0

    def versus(rs: list[dict], mine: str | None) -> float | None:
        pairs = [(ours[mine, r["prompt_id"]], r) for r in rs if (mine, r["prompt_id"]) in ours]
        return statistics.median(o["tokens_per_s"] / t["tokens_per_s"] for o, t in pairs) if pairs else None

    def stats(rs: list[dict], failed: list[dict], mine: str | None) -> dict:
        speedups = [plain[peer_plain(r["peer"]), r["prompt_id"]]["wall_s"] / r["wall_s"] for r in rs
                    if (peer_plain(r["peer"]), r["prompt_id"]) in plain]  # its plain run may have failed there
        out = {"prompts": len(rs), "failed": len(failed),
               "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs) if rs else None,
               "speedup": statistics.median(speedups) if speedups else None,
               "counterpart": mine, "ours_vs_theirs": versus(rs, mine), "best": best, "best_vs_theirs": versus(rs, best)}
        if rs and rs[0]["identical_to_ar"] is not None:
            out["identical_to_ar"] = sum(r["identical_to_ar"] for r in rs)
        return out

    peers = {}
    for mode in dict.fromkeys(r["peer"] for r in peer_runs):
        method = PEER_COUNTERPART.get(mode)
        candidates = [lb for lb in overall if overall[lb].get("prompts") and runs_method(runs, lb) == method]
        mine = max(candidates, key=lambda lb: overall[lb]["speedup"]) if candidates else None
        rs = [r for r in measured if r["peer"] == mode]
        failed = [{"prompt_id": r["prompt_id"], "category": r["category"], "error": r["error"]} for r in peer_runs
                  if r["peer"] == mode and "error" in r]
        peers[mode] = {**stats(rs, failed, mine), "failures": failed, "by_category": {
            c: stats([r for r in rs if r["category"] == c], [f for f in failed if f["category"] == c], mine)
            for c in categories if any(r["category"] == c for r in rs + failed)}}
    return peers


def runs_method(runs: list[dict], lb: str) -> str:
    return next(r["method"] for r in runs if r["label"] == lb)


def _matrix(r: dict) -> list[str]:
    """At a glance: median speedup per category (rows) and method (columns); a peer's speculative modes relative
    to the same peer's plain generation; tau in parentheses."""
    s, peers = r["summary"], r.get("peers") or {}
    spec = [lb for lb in s["overall"] if lb != "ar"]
    modes = [m for m in peers if m != peer_plain(m)]
    if not spec and not modes:
        return []
    head = [*spec, *(f"{m} (vs {peer_plain(m)})" for m in modes)]
    lines = ["Speedup over AR, median per category (tau):", "", "| category | prompts | " + " | ".join(head) + " |",
             "|---|---|" + "---|" * len(head)]
    for cat, table in [*s["by_category"].items(), ("**overall**", s["overall"])]:
        cells = [f"{table[lb]['speedup']:.2f}x ({table[lb]['tau']:.2f})" for lb in spec]
        for m in modes:
            stats = peers[m] if cat == "**overall**" else peers[m]["by_category"].get(cat)
            cells.append(_peer_cell(stats))
        lines.append(f"| {cat} | {table['ar']['prompts']} | " + " | ".join(cells) + " |")
    return lines + [""]


def _peer_cell(stats: dict | None) -> str:
    """A peer mode's speedup in one category; "failed" where it failed on every prompt there."""
    if stats and not stats["prompts"] and stats.get("failed"):
        return "failed"
    return _x(stats["speedup"]) if stats else "-"


def markdown(r: dict) -> str:
    s, env = r["summary"], r["environment"]
    d = s["decode"]
    lines = [f"{r['target']} ({r['dtype']}{', native GGUF weights' if r.get('weights') == 'native' else ''}, {r['device']}, {env['torch_threads']} threads, {env['cpu'] or env['cuda']}), "
             f"{r['max_new_tokens']} new tokens, temperature {r['temperature']}, chat={r['chat']}"
             + (f", draft {r['draft']} (weights: {r.get('draft_quant')}, LM head: "
                f"{r.get('draft_vocab') or 'full'} tokens)" if r.get("draft") else ""), ""]
    if r.get("command"):
        lines += [f"command: `{r['command']}`", ""]
    lines += _matrix(r)
    lines += ["AR decode (ms/token, prefill excluded):", "",
              "| prompt | tokens in | ours | transformers | ours vs transformers | same tokens as transformers |",
              "|---|---|---|---|---|---|"]
    for run in (x for x in r["runs"] if x["method"] == "ar"):
        hf = run.get("hf_ms_per_token")
        lines.append(f"| {run['prompt_id']} | {run['prompt_tokens']} | {run['decode_ms_per_token']:.1f} | "
                     + (f"{hf:.1f} | {hf / run['decode_ms_per_token']:.2f}x | "
                        f"{run['hf_identical_prefix_tokens']}/{run['new_tokens']} |" if hf else "- | - | - |"))
    lines += ["", f"- weights read per token: {d['weight_bytes'] / 1e9:.2f} GB; measured read bandwidth "
                  f"{d['read_bandwidth_gbs']:.1f} GB/s (best of "
                  f"{', '.join(f'{b:.1f}' for b in d['read_bandwidth_samples_gbs'])}, before and after) "
                  f"-> floor {d['floor_ms_per_token']:.1f} ms/token",
              f"- ours: median {d['ours_ms_per_token']:.1f} ms/token (spread {d['ours_spread_ms'][0]:.1f}-"
              f"{d['ours_spread_ms'][1]:.1f}) = {d['ratio_to_floor']:.2f}x the floor",
              "- one target forward over T new tokens (warm cache): " + ", ".join(
                  f"T={T}: {ms:.1f} ms ({d['verify_cost_ratio'][T]:.2f}x)" for T, ms in d["verify_cost_ms"].items())]
    if "prefill_share" in d:  # JSON written before it was reported has none
        lines.append(f"- the target's prefill: {d['prefill_ms_per_prompt_token']:.1f} ms a prompt token, "
                     f"{100 * d['prefill_share']:.0f}% of an AR run's wall time (median); every method pays it")
    if "hf_ms_per_token" in d:
        lines.append(f"- transformers: median {d['hf_ms_per_token']:.1f} ms/token (spread {d['hf_spread_ms'][0]:.1f}-"
                     f"{d['hf_spread_ms'][1]:.1f}); ours is {d['speedup_vs_hf']:.2f}x faster; "
                     f"identical outputs on {d['outputs_identical']}/"
                     f"{d.get('hf_prompts', sum(x['method'] == 'ar' for x in r['runs']))} prompts")
    spec = [lb for lb in s["overall"] if lb != "ar"]
    if spec:
        lines += ["", "Speculative methods (speedup = our AR wall time / method wall time, same prompt, same run; "
                      "decode = the same without the target's prefill (AR decode ms/token / the method's); "
                      "medians; predicted = from the measured per-position acceptance, c and verify-cost curve; "
                      "c = draft cost per drafted token / AR target cost per token; acceptance: conditional "
                      "per position, then joint P(first i accepted)):", "",
                  "| category | method | speedup (spread) | decode | predicted | tau | alpha | drafts/round | "
                  "per-position acceptance | joint | c | tok/s | "
                  + ("identical to AR |" if s["greedy"] else "prompts |"),
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        rates = lambda xs: " ".join("-" if a is None else f"{a:.2f}" for a in xs)  # noqa: E731
        for cat, table in [*s["by_category"].items(), ("overall", s["overall"])]:
            for lb in spec:
                m = table[lb]
                last = f"{m['identical_to_ar']}/{m['prompts']}" if s["greedy"] else str(m["prompts"])
                lines.append(f"| {cat} | {lb} | {m['speedup']:.2f}x ({m['speedup_spread'][0]:.2f}-"
                             f"{m['speedup_spread'][1]:.2f}) | {_x(m.get('decode_speedup'))} | "
                             f"{_x(m['predicted_speedup'])} | {m['tau']:.2f} | "
                             f"{m['alpha']:.2f} | {m['drafts_per_round']:.2f} | "
                             f"{rates(m['per_position_acceptance'])} | "
                             f"{rates(m['per_position_joint'])} | {m['cost_ratio_c']:.2f} | "
                             f"{m['tokens_per_s']:.1f} | {last} |")
        for cat, table in [*s["by_category"].items(), ("overall", s["overall"])]:
            best = max(spec, key=lambda lb: table[lb]["speedup"])
            lines.append(f"- best in {cat}: {best} at {table[best]['speedup']:.2f}x")
    if r.get("peers"):
        lines += ["", "Peers on the same prompts (hf: transformers generate() on the same checkpoints and dtype; "
                      "llamacpp: llama.cpp on the same GGUF file). speedup = the peer's own plain generation wall "
                      "time / this mode's, same prompt; ours/theirs = tokens/s of our counterpart method at its "
                      "best K / theirs; best/theirs = the same for our fastest method overall; medians:", "",
                  "| peer | category | tok/s | speedup | ours | ours/theirs | best/theirs | identical to our AR | "
                  "failed |", "|---|---|---|---|---|---|---|---|---|"]
        for name, peer in r["peers"].items():
            for cat, m in [*peer["by_category"].items(), ("overall", peer)]:
                same = f"{m['identical_to_ar']}/{m['prompts']}" if "identical_to_ar" in m else "-"
                best = f"{_x(m.get('best_vs_theirs'))} ({m['best']})" if m.get("best") else "-"
                tps = "-" if m["tokens_per_s"] is None else f"{m['tokens_per_s']:.1f}"
                lines.append(f"| {name} | {cat} | {tps} | {_x(m['speedup'])} | {m['counterpart'] or '-'} | "
                             f"{_x(m['ours_vs_theirs'])} | {best} | {same} | {m.get('failed', 0)} |")
        failures = [(name, f) for name, peer in r["peers"].items() for f in peer.get("failures", [])]
        if failures:
            lines += ["", "Peer failures (measured as nothing; the run went on):"]
            lines += [f"- {name} on {f['prompt_id']} ({f['category']}): {f['error']}" for name, f in failures]
    return "\n".join(lines)
