"""PNG summary of a ``verispec bench`` report: speedups, per-position acceptance, tau histogram.

matplotlib is an optional dependency (the ``bench`` extra); it is imported only when plotting.
"""

from __future__ import annotations

from pathlib import Path

from verispec.errors import VerispecError


def _colors(plt, n: int) -> list:
    if n <= 20:
        return [plt.get_cmap("tab10" if n <= 10 else "tab20")(i) for i in range(n)]
    return [plt.get_cmap("viridis")(i / (n - 1)) for i in range(n)]


def _no_method(ax, title: str | None = None) -> None:
    if title:
        ax.set_title(title)
        ax.set_xticks([])
        ax.set_yticks([])
    ax.text(0.5, 0.5, "no speculative method", ha="center", va="center", transform=ax.transAxes, color="gray",
            bbox={"facecolor": "white", "edgecolor": "none"})


def _speedup_panel(ax, report: dict, methods: list[str], color: dict) -> None:
    summary = report.get("summary", {})
    by_cat, overall = summary.get("by_category", {}), summary.get("overall", {})
    peers = report.get("peers") or {}
    groups = [(cat, by_cat[cat]) for cat in by_cat] + [("overall", overall)]
    # one slot per method and per peer; a peer without by_category leaves its category slots empty
    series = [(m, False) for m in methods] + [(p, True) for p in peers]
    width = 0.8 / max(len(series), 1)
    drawn = False
    for j, (name, is_peer) in enumerate(series):
        xs, ys, err = [], [], [[], []]
        for g, (gname, stats) in enumerate(groups):
            if is_peer:
                s = peers[name] if gname == "overall" else (peers[name].get("by_category") or {}).get(gname)
            else:
                s = stats.get(name)
            if s and not s.get("prompts") and s.get("failed"):  # a peer that failed on every prompt here
                ax.text(g - 0.4 + width * (j + 0.5), 0.02, "failed", rotation=90, ha="center", va="bottom",
                        fontsize=7, color="firebrick", transform=ax.get_xaxis_transform())
            if not s or s.get("speedup") is None:
                continue
            y = s["speedup"]
            lo, hi = s.get("speedup_spread") or (y, y)
            xs.append(g - 0.4 + width * (j + 0.5))
            ys.append(y)
            err[0].append(max(y - lo, 0.0))
            err[1].append(max(hi - y, 0.0))
        if not xs and not (is_peer and peers[name].get("failed")):
            continue
        drawn = drawn or bool(xs)
        ax.bar(xs, ys, width, color=color[name], edgecolor="black", linewidth=0.5,
               hatch="//" if is_peer else None, yerr=err if not is_peer else None,
               error_kw={"elinewidth": 1 if len(series) <= 6 else 0.6, "capsize": 2 if len(series) <= 6 else 0},
               label=(f"{name} (peer{_failed(peers[name])})" if is_peer else name))
    if not drawn:
        _no_method(ax)
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label="AR = 1")
    ax.set_xticks(range(len(groups)))
    ax.set_xlim(-0.5, len(groups) - 0.5)
    ax.set_xticklabels([g for g, _ in groups], rotation=30, ha="right")
    ax.set_ylabel("speedup over AR (median, bars = min..max)")
    ax.set_title("(a) speedup per category")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.05)
    if len(groups) > 1:
        ax.axvline(len(groups) - 1.5, color="gray", linestyle=":", linewidth=1)
    ax.legend(loc="upper center", ncol=min(len(series) + 1, 3), fontsize=8, frameon=False)


def _failed(peer: dict) -> str:
    """", failed on N prompts" for a peer mode that failed somewhere (its bars are the prompts it ran)."""
    n = peer.get("failed") or 0
    return f", failed on {n} prompt{'s' * (n != 1)}" if n else ""


def _acceptance_panel(ax, overall: dict, methods: list[str], color: dict) -> None:
    from matplotlib.lines import Line2D

    if not methods:
        return _no_method(ax, "(b) per-position acceptance (overall)")
    k_max = 1
    for m in methods:
        cond, joint = overall[m].get("per_position_acceptance") or [], overall[m].get("per_position_joint") or []
        pts = [(i, a) for i, a in enumerate(cond, 1) if a is not None]
        if pts:
            ax.plot(*zip(*pts), "-o", color=color[m], markersize=4, label=m)
        if joint:
            ax.plot(range(1, len(joint) + 1), joint, "--", color=color[m])
        k_max = max(k_max, len(cond), len(joint))
    styles = [Line2D([], [], color="gray", marker="o", markersize=4, label="conditional"),
              Line2D([], [], color="gray", linestyle="--", label="joint (first i accepted)")]
    handles = ax.get_legend_handles_labels()[0] + styles
    ax.legend(handles=handles, loc="upper center", ncol=3, fontsize=8, frameon=False)
    ax.set_xticks(range(1, k_max + 1))
    ax.set_xlim(0.5, k_max + 0.5)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_title("(b) per-position acceptance (overall)")
    ax.grid(alpha=0.3)


def _tau_panel(ax, runs: list[dict], methods: list[str], color: dict) -> None:
    import numpy as np

    values = {m: [r["mean_accepted_length"] for r in runs if r.get("label") == m] for m in methods}
    values = {m: v for m, v in values.items() if v}
    if not values:
        return _no_method(ax, "(c) tau distribution over prompts")
    flat = [x for v in values.values() for x in v]
    lo, hi = min(flat), max(flat)
    bins = np.linspace(lo - 0.5, hi + 0.5, 3) if hi - lo < 1e-9 else np.linspace(lo, hi, 16)
    for m, v in values.items():
        ax.hist(v, bins=bins, color=color[m], alpha=0.35, label=m)
        ax.hist(v, bins=bins, color=color[m], histtype="step", linewidth=1.5)
    ax.set_xlabel("mean accepted length per prompt (tau)")
    ax.set_ylabel("prompts")
    ax.set_title("(c) tau distribution over prompts")
    ax.legend(loc="upper center", ncol=3, fontsize=8, frameon=False)


def _legends_below(fig, axes) -> None:
    """Move each panel's legend just below its x-axis labels (measured, so long labels never overlap)."""
    from matplotlib.transforms import ScaledTranslation

    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in axes:
        legend = ax.get_legend()
        if legend is not None:
            drop = (ax.bbox.y0 - ax.xaxis.get_tightbbox(renderer).y0) / fig.dpi + 0.05  # inches
            legend.set_bbox_to_anchor((0.5, 0.0), transform=ax.transAxes + ScaledTranslation(
                0, -drop, fig.dpi_scale_trans))


def plot_report(report: dict, path) -> None:
    """Write a 3-panel PNG summary of a benchmark ``report`` (the JSON the bench writes) to ``path``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise VerispecError("--plot needs matplotlib: pip install 'verispec[bench]'") from None

    overall = report.get("summary", {}).get("overall", {})
    runs = report.get("runs", [])
    methods = [m for m in overall if m != "ar"]
    for cat_stats in report.get("summary", {}).get("by_category", {}).values():
        methods += [m for m in cat_stats if m != "ar" and m not in methods]
    peers = list(report.get("peers") or {})
    palette = _colors(plt, len(methods) + len(peers))
    color = dict(zip(methods + peers, palette))

    legend_rows = -(-(len(methods) + len(peers) + 1) // 3)  # panel (a) legend, 3 columns
    fig, axes = plt.subplots(1, 3, figsize=(16, 5.5 + 0.18 * max(legend_rows - 2, 0)), dpi=120)
    try:
        _speedup_panel(axes[0], report, methods, color)
        _acceptance_panel(axes[1], overall, [m for m in methods if m in overall], color)
        _tau_panel(axes[2], runs, methods, color)
        title = f"target: {report.get('target', '?')}   draft: {report.get('draft') or 'none'}"
        if report.get("temperature") is not None:
            title += f"   temperature: {report['temperature']}"
        fig.suptitle(title)
        _legends_below(fig, axes)
        fig.tight_layout()
        fig.savefig(Path(path))
    finally:
        plt.close(fig)
