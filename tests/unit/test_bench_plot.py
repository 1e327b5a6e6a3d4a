"""plot_report writes a PNG for full, AR-only and peer-less benchmark reports."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("matplotlib")

from verispec.bench.plot import plot_report  # noqa: E402

CATEGORIES = ["code", "chat"]


def _stats(speedup: float, tau: float, cond: list[float] | None) -> dict:
    out = {"speedup": speedup, "tau": tau, "alpha": None, "tokens_per_s": 20.0 * speedup}
    if cond is not None:
        joint, run = [], 1.0
        for a in cond:
            run *= a or 0.0
            joint.append(run)
        out.update(speedup_spread=[speedup * 0.85, speedup * 1.1], alpha=0.7,
                   per_position_acceptance=cond, per_position_joint=joint)
    return out


def synthetic_report(labels=("ar", "draft:K=2", "draft:K=4"), peers=None, prompts_per_category=12) -> dict:
    rng = random.Random(0)
    curves = {"draft:K=2": [0.9, 0.75], "draft:K=4": [0.8, 0.65, 0.55, None]}
    runs, by_category = [], {}
    for ci, cat in enumerate(CATEGORIES):
        by_category[cat] = {}
        for lab in labels:
            K = None if lab == "ar" else int(lab.split("=")[1])
            taus = [1.0 if K is None else 1 + rng.uniform(0.5, K * 0.8) for _ in range(prompts_per_category)]
            for p, tau in enumerate(taus):
                run = {"label": lab, "method": "ar" if K is None else "draft", "num_draft_tokens": K,
                       "category": cat, "prompt_id": f"{cat}-{p}", "mean_accepted_length": tau}
                if K is not None:
                    run["speedup"] = tau / (1 + 0.1 * K)
                runs.append(run)
            speed = 1.0 if K is None else 1.4 + 0.3 * ci + 0.1 * K
            by_category[cat][lab] = _stats(speed, sum(taus) / len(taus), None if K is None else curves[lab])
    speedups = {"ar": 1.0, "draft:K=2": 1.75, "draft:K=4": 2.05}
    overall = {lab: _stats(speedups[lab], 2.0, curves.get(lab)) for lab in labels}
    report = {"target": "tiny-target-1B", "draft": None if labels == ("ar",) else "tiny-draft-100M",
              "temperature": 0.0, "runs": runs, "summary": {"overall": overall, "by_category": by_category}}
    if peers is not None:
        report["peers"] = peers
    return report


PEERS = {"hf-assisted": {"speedup": 1.5, "tokens_per_s": 30.0,
                         "by_category": {"code": {"speedup": 1.7, "tokens_per_s": 34.0},
                                         "chat": {"speedup": 1.3, "tokens_per_s": 26.0}}},
         "vllm-ngram": {"speedup": 1.2, "tokens_per_s": 24.0}}


def _check_png(path) -> None:
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG")
    assert len(data) > 10_000


def test_full_report_with_peers(tmp_path):
    path = tmp_path / "bench.png"
    plot_report(synthetic_report(peers=PEERS), path)
    _check_png(path)


def test_ar_only_report(tmp_path):
    path = tmp_path / "ar.png"
    plot_report(synthetic_report(labels=("ar",), peers={}), path)
    _check_png(path)


def test_report_without_peers_key(tmp_path):
    report = synthetic_report()
    assert "peers" not in report
    path = tmp_path / "nopeers.png"
    plot_report(report, str(path))
    _check_png(path)


def test_single_category_many_methods(tmp_path):
    labels = ("ar",) + tuple(f"draft:K={k}" for k in (2, 4)) + tuple(f"draft:K={k}x" for k in range(10))
    report = synthetic_report(labels=("ar", "draft:K=2", "draft:K=4"))
    report["summary"]["by_category"] = {"code": report["summary"]["by_category"]["code"]}
    for i, lab in enumerate(labels[3:]):  # more than 10 methods -> continuous colormap
        report["summary"]["overall"][lab] = _stats(1.1 + 0.05 * i, 1.5, [0.5 + 0.04 * i])
    path = tmp_path / "many.png"
    plot_report(report, path)
    _check_png(path)
