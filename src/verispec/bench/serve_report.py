"""The results of `verispec bench-serve` (serve.py): per level and mode throughput, latency percentiles,
acceptance, the /metrics diff and the garbled-text check; a markdown table, the JSON report and a PNG.

Garbled: greedy requests (and seeded samples) are deterministic, so every completed response must equal the first
text of the same prompt in the same mode (lowest concurrency first) and, when greedy, the first mode's text of that
prompt too (speculation changes no greedy token). A mismatch is counted and described, never raised.
"""

from __future__ import annotations

import sys
from collections import Counter

METRIC_PREFIXES = ("verispec:", "vllm:")  # counters and histograms the diff keeps
SNIPPET = 40


def check_identity(records: list[dict], modes: list[str], cross_modes: bool) -> list[dict]:
    """Set ``garbled`` on every record; return one description per completed response whose text differs from its
    references: the same prompt's first text in its mode and, with ``cross_modes``, in any mode (the first mode's)."""
    for r in records:
        r["garbled"] = False
    done = sorted((r for r in records if r["ok"]), key=lambda r: (r["concurrency"], modes.index(r["mode"]), r["index"]))
    in_mode, any_mode, mismatches = {}, {}, []
    for r in done:
        refs = [in_mode.setdefault((r["mode"], r["prompt_id"]), r)]
        if cross_modes:
            refs.append(any_mode.setdefault(r["prompt_id"], r))
        for ref in refs:
            if ref is not r and ref["text"] != r["text"]:
                r["garbled"] = True
                mismatches.append(_describe(r, ref))
                break
    return mismatches


def _describe(r: dict, ref: dict) -> dict:
    a, b = r["text"], ref["text"]
    at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    lo = max(at - SNIPPET // 2, 0)
    return {"mode": r["mode"], "concurrency": r["concurrency"], "index": r["index"], "prompt_id": r["prompt_id"],
            "reference": f"{ref['mode']} c={ref['concurrency']} #{ref['index']}", "at_char": at,
            "got": a[lo:at + SNIPPET], "want": b[lo:at + SNIPPET]}


def metric_values(text: str | None) -> dict[str, float] | None:
    """Counter and histogram samples (no buckets) of a Prometheus page: {name{labels but model_name}: value}."""
    if text is None:
        return None
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    try:
        for fam in text_string_to_metric_families(text):
            if fam.type not in ("counter", "histogram") or not fam.name.startswith(METRIC_PREFIXES):
                continue
            for s in fam.samples:
                if s.name.endswith(("_bucket", "_created")):
                    continue
                extra = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()) if k != "model_name")
                out[f"{s.name}{{{extra}}}" if extra else s.name] = s.value
    except ValueError:  # not a Prometheus page
        return None
    return out


def metrics_diff(before: str | None, after: str | None) -> dict[str, float] | None:
    b, a = metric_values(before), metric_values(after)
    if a is None or b is None:
        return None
    return {k: round(v - b.get(k, 0.0), 6) for k, v in a.items()}


def dist(values: list[float]) -> dict | None:
    """mean, p50, p90, p99 (linear interpolation) in the values' unit; None for no values."""
    import numpy as np

    if not values:
        return None
    v = np.asarray(values, dtype=float)
    return {"mean": round(float(v.mean()), 3),
            **{f"p{q}": round(float(np.percentile(v, q)), 3) for q in (50, 90, 99)}}


def summarize_level(run: dict, recs: list[dict]) -> dict:
    ok = [r for r in recs if r["ok"]]
    wall, tokens = run["wall_s"], sum(r["completion_tokens"] for r in ok)
    spec = [r["spec"] for r in ok if r["spec"]]
    drafts, drafted, accepted = (sum(s.get(k, 0) for s in spec)
                                 for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"))
    return {
        "mode": run["mode"], "concurrency": run["concurrency"], "requests": len(recs), "completed": len(ok),
        "failed": len(recs) - len(ok), "garbled": sum(r["garbled"] for r in recs), "wall_s": round(wall, 3),
        "request_throughput": round(len(ok) / wall, 4), "output_tokens_per_s": round(tokens / wall, 3),
        "total_output_tokens": tokens, "total_prompt_tokens": sum(r["prompt_tokens"] or 0 for r in ok),
        "ttft_ms": dist([r["ttft_ms"] for r in ok if r["ttft_ms"] is not None]),
        "tpot_ms": dist([r["tpot_ms"] for r in ok if r["tpot_ms"] is not None]),
        "itl_ms": dist([x for r in ok for x in r["itl_ms"]]),
        "e2e_ms": dist([r["e2e_ms"] for r in ok]),
        "spec_decode": {"num_drafts": drafts, "num_draft_tokens": drafted, "num_accepted_tokens": accepted,
                        "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
                        "mean_acceptance_length": round(1 + accepted / drafts, 4) if drafts else None},
        "errors": dict(Counter(r["error"] for r in recs if not r["ok"]).most_common(5)),
        "metrics_diff": metrics_diff(run["metrics_before"], run["metrics_after"]),
    }


def finish_report(report: dict, records: list[dict], level_runs: list[dict]) -> None:
    """Fill ``report`` from what ran so far: levels (with ratios), garbled texts, requests."""
    greedy = report["temperature"] == 0
    report["garbled"] = check_identity(records, report["modes"], cross_modes=greedy)
    report["garbled_check"] = ("every text against the same prompt's first in its mode and in the first mode"
                               if greedy else "seeded samples: every text against the same prompt's first in its mode")
    levels = [summarize_level(run, [r for r in records if (r["mode"], r["concurrency"]) == (run["mode"],
                                                                                         run["concurrency"])])
              for run in level_runs]
    tps = {(lv["mode"], lv["concurrency"]): lv["output_tokens_per_s"] for lv in levels}
    lowest = min(report["concurrency"])
    for lv in levels:
        ar, base = tps.get(("ar", lv["concurrency"])), tps.get((lv["mode"], lowest))
        lv["speedup_vs_ar"] = round(lv["output_tokens_per_s"] / ar, 3) if ar and lv["mode"] != "ar" else None
        lv["vs_lowest_concurrency"] = round(lv["output_tokens_per_s"] / base, 3) if base else None
    report["levels"], report["requests"] = levels, records


def _ms(d: dict | None, q: str) -> str:
    return "-" if not d else f"{d[q]:.0f}" if d[q] >= 10 else f"{d[q]:.1f}"


def table(report: dict) -> str:
    env, lowest = report["environment"], min(report["concurrency"])
    what = report.get("target") or report.get("url")
    weights = ", native GGUF weights" if report.get("weights") == "native" else ""
    draft = f", draft {report['draft']}" if report.get("draft") else ""
    lines = [f"{what} ({report.get('dtype', 'served')}{weights}, {env['torch_threads']} threads, "
             f"{env['cpu'] or env['cuda']}){draft}, {report['max_tokens']} max tokens, temperature "
             f"{report['temperature']}, prompts from {report['num_prompts']} (categories interleaved)", ""]
    if report.get("command"):
        lines += [f"command: `{report['command']}`", ""]
    lines += [f"| concurrency | mode | req/s | output tok/s | vs ar | vs c={lowest} | TTFT p50 / p99 ms | TPOT p50 ms "
              "| ITL p50 ms | alpha | tau | failed | garbled |", "|" + "---|" * 13]
    for lv in sorted(report["levels"], key=lambda lv: (lv["concurrency"], report["modes"].index(lv["mode"]))):
        s = lv["spec_decode"]
        lines.append(
            f"| {lv['concurrency']} | {lv['mode']} | {lv['request_throughput']:.2f} | "
            f"{lv['output_tokens_per_s']:.1f} | " + (f"{lv['speedup_vs_ar']:.2f}x" if lv["speedup_vs_ar"] else "-") + " | "
            + (f"{lv['vs_lowest_concurrency']:.2f}x" if lv["vs_lowest_concurrency"] else "-")
            + f" | {_ms(lv['ttft_ms'], 'p50')} / {_ms(lv['ttft_ms'], 'p99')} | {_ms(lv['tpot_ms'], 'p50')} | "
            f"{_ms(lv['itl_ms'], 'p50')} | "
            + (f"{s['acceptance_rate']:.2f} | {s['mean_acceptance_length']:.2f}" if s["num_drafts"] else "- | -")
            + f" | {lv['failed']}/{lv['requests']} | {lv['garbled']} |")
    for lv in report["levels"]:
        for error, n in lv["errors"].items():
            lines.append(f"- {lv['mode']} c={lv['concurrency']}: {n} failed: {error}")
    for m in report["garbled"][:5]:
        lines.append(f"- garbled: {m['mode']} c={m['concurrency']} #{m['index']} ({m['prompt_id']}) differs from "
                     f"{m['reference']} at char {m['at_char']}: {m['got']!r} vs {m['want']!r}")
    if len(report["garbled"]) > 5:
        lines.append(f"- ... {len(report['garbled']) - 5} more garbled responses in the JSON report")
    return "\n".join(lines)


def print_table(report: dict) -> None:
    if report["levels"]:
        print(table(report))


def plot_or_note(report: dict, path) -> None:
    """The PNG, or a one-line note on stderr when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("verispec: no plot: matplotlib is missing (pip install 'verispec[bench]')", file=sys.stderr)
        return
    levels = report["levels"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8), dpi=120)
    try:
        panels = [(axes[0], "output_tokens_per_s", None, "output tokens/s (all requests together)", "(a) throughput"),
                  (axes[1], "ttft_ms", "p50", "ms", "(b) time to first token: p50, p99 dashed"),
                  (axes[2], "tpot_ms", "p50", "ms", "(c) time per output token: p50, p99 dashed")]
        for i, mode in enumerate(report["modes"]):
            rows = sorted((lv for lv in levels if lv["mode"] == mode), key=lambda lv: lv["concurrency"])
            xs = [lv["concurrency"] for lv in rows]
            for ax, key, q, _, _ in panels:
                ys = [(lv[key][q] if lv[key] else float("nan")) if q else lv[key] for lv in rows]
                ax.plot(xs, ys, marker="o", color=f"C{i}", label=mode)
                if q is not None:
                    ax.plot(xs, [lv[key]["p99"] if lv[key] else float("nan") for lv in rows], linestyle="--",
                            alpha=0.5, color=f"C{i}")
                elif len(report["modes"]) <= 2:  # values: the first mode's above, the second's below
                    for x, y in zip(xs, ys):
                        ax.annotate(f"{y:.1f}", (x, y), textcoords="offset points", ha="center", fontsize=8,
                                    xytext=(0, 7 if i % 2 == 0 else -13), color=f"C{i}")
        for ax, _, _, ylabel, title in panels:
            ax.set_xscale("log", base=2)
            ax.set_xticks(report["concurrency"], [str(c) for c in report["concurrency"]])
            ax.minorticks_off()
            ax.set_xlabel("concurrency (requests in flight)")
            ax.set_ylabel(ylabel)
            ax.set_title(title)
            top = max((y for line in ax.get_lines() for y in line.get_ydata() if y == y), default=1.0)
            ax.set_ylim(0, 1.15 * top or 1.0)  # from 0, with room for the value labels
            ax.grid(alpha=0.3)
            ax.legend(fontsize=9)
        env = report["environment"]
        draft = f", draft {report['draft']}" if report.get("draft") else ""
        fig.suptitle(f"{report.get('target') or report.get('url')}{draft}: {report['max_tokens']} max tokens, "
                     f"temperature {report['temperature']}, {env['cpu'] or env['cuda']}, {env['torch_threads']} "
                     "threads", fontsize=10)
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)
