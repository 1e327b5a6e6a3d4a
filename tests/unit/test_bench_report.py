"""The bench summary's decode-only speedup and prefill share, on hand-made runs."""

import pytest

from verispec.bench.report import markdown, summarize


def run(label, method, pid, prefill_s, decode_ms, **kw):
    new = 65  # 64 decode steps after the prefill's token
    wall = prefill_s + 64 * decode_ms / 1e3
    out = {"label": label, "method": method, "category": "coding", "prompt_id": pid, "prompt_tokens": 50,
           "new_tokens": new, "wall_s": wall, "tokens_per_s": new / wall, "prefill_s": prefill_s,
           "decode_ms_per_token": decode_ms, "mean_accepted_length": 1.0, "acceptance_rate": None,
           "per_position_acceptance": [], "per_position_reached": [], "identical_to_ar": True, "speedup": None}
    return {**out, **kw}


def spec(pid, prefill_s, decode_ms, ar_wall):
    wall = prefill_s + 64 * decode_ms / 1e3
    return run("draft:K=4", "draft", pid, prefill_s, decode_ms, speedup=ar_wall / wall, mean_accepted_length=2.5,
               per_position_acceptance=[0.8], per_position_reached=[20], drafted_tokens=20, accepted_tokens=16,
               draft_s=0.5, early_stop=True)


def test_decode_speedup_leaves_out_the_prefill_every_method_pays():
    runs = []
    for pid, (prefill, ar_ms, sp_ms) in {"a": (1.0, 100.0, 50.0), "b": (3.0, 100.0, 80.0), "c": (2.0, 90.0, 60.0)}.items():
        ar = run("ar", "ar", pid, prefill, ar_ms)
        runs += [ar, spec(pid, prefill, sp_ms, ar["wall_s"])]
    summary, _ = summarize(runs, [], 10**9, [10.0], {1: 100.0, 5: 130.0}, greedy=True)
    m = summary["overall"]["draft:K=4"]
    assert m["decode_speedup"] == pytest.approx(1.5)  # median of 100 / 50, 100 / 80, 90 / 60
    # end to end the prefill dilutes it: (1 + 6.4) / (1 + 3.2), (3 + 6.4) / (3 + 5.12), (2 + 5.76) / (2 + 3.84)
    assert m["speedup"] == pytest.approx((2 + 5.76) / (2 + 3.84))
    assert m["speedup"] < m["decode_speedup"]
    assert summary["overall"]["ar"]["decode_speedup"] == 1.0
    d = summary["decode"]
    assert d["prefill_share"] == pytest.approx(2.0 / 7.76)  # median of 1/7.4, 3/9.4, 2/7.76
    assert d["prefill_ms_per_prompt_token"] == pytest.approx(40.0)  # 2 s / 50 tokens
    text = markdown({"runs": runs, "summary": summary, "peers": {}, "command": "verispec bench", "target": "t",
                     "draft": "d", "dtype": "bfloat16", "weights": "native", "device": "cpu", "max_new_tokens": 65,
                     "temperature": 0.0, "chat": True, "environment": {"torch_threads": 2, "cpu": "x", "cuda": None}})
    assert "| coding | draft:K=4 | 1.33x (1.16-1.76) | 1.50x |" in text
    assert "40.0 ms a prompt token, 26% of an AR run's wall time" in text
