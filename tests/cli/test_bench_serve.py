"""`verispec bench-serve` on a tiny random model: the JSON report, the /metrics diff, --url against a live server,
the TTFT phase (ours alone, and interleaved with a stand-in llama.cpp peer), bad flags (one line, exit 2), and a
garbled-text check that can fail. No timings asserted."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from verispec import LLM
from verispec.bench import peer_llamacpp, serve_ttft
from verispec.bench.serve import serving
from verispec.bench.serve_report import check_identity, metrics_diff
from verispec.cli import main

SMALL = ["--concurrency", "1,2", "--requests-per-level", "2", "--max-tokens", "8", "--categories", "qa"]
TTFT = ["--ttft-prompt-tokens", "96"]  # the tiny model's context is 256 tokens (the default 800 is skipped, a note)


def read(out) -> dict:
    return json.loads((out / "results.json").read_text())


def test_in_process_sweep(tiny_dirs, tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["bench-serve", "--target", str(tiny_dirs["qwen2"]), "--dtype", "float32", "--methods", "ar,ngram",
               *SMALL, *TTFT, "--ttft-repeats", "2", "--out", str(out)])
    assert rc == 0
    r = read(out)
    t = r["ttft"]  # before the sweep, through the first mode's server; its requests are in no level's diff
    assert t["mode"] == "ar" and t["target_prompt_tokens"] == 96 and 90 <= t["prompt_tokens"] <= 96
    assert [(x["side"], x["set"]) for x in t["trials"]] == [("verispec", 1), ("verispec", 2)]
    assert t["verispec"]["runs"] == 2 and t["verispec"]["median_ms"] >= t["verispec"]["min_ms"] > 0
    assert t["verispec"]["server_median_ms"] > 0 and t["llamacpp"] is None and t["ratio_median"] is None
    assert r["complete"] and r["modes"] == ["ar", "ngram"] and r["concurrency"] == [1, 2]
    assert r["environment"]["torch"] and r["environment"]["httpx"] and r["garbled"] == []
    assert [(lv["concurrency"], lv["mode"]) for lv in r["levels"]] == [(1, "ar"), (1, "ngram"), (2, "ar"), (2, "ngram")]
    for lv in r["levels"]:
        assert (lv["requests"], lv["completed"], lv["failed"], lv["garbled"]) == (2, 2, 0, 0)
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            assert set(lv[key]) == {"mean", "p50", "p90", "p99"}, key
        assert lv["output_tokens_per_s"] > 0 and lv["request_throughput"] > 0
        diff, spec = lv["metrics_diff"], lv["spec_decode"]
        # the server's counters moved by exactly what this level's responses report
        assert diff["verispec:generation_tokens_total"] == lv["total_output_tokens"] > 0
        assert diff["verispec:prompt_tokens_total"] == lv["total_prompt_tokens"] > 0
        assert diff["verispec:e2e_request_latency_seconds_count"] == 2
        assert diff["verispec:spec_decode_num_draft_tokens_total"] == spec["num_draft_tokens"]
        assert diff["verispec:spec_decode_num_drafts_total"] == spec["num_drafts"]
        assert lv["mode"] == "ngram" or spec["num_drafts"] == 0  # ngram may draft nothing: the cost model decides
        assert (lv["speedup_vs_ar"] is None) == (lv["mode"] == "ar")
    reqs = r["requests"]
    assert len(reqs) == 8 and all(q["ok"] and q["completion_tokens"] >= 1 for q in reqs)
    assert (out / "bench-serve.png").stat().st_size > 10_000
    table = capsys.readouterr().out
    assert "| concurrency | mode | req/s | output tok/s |" in table and "| 2 | ngram |" in table
    assert "Time to first token, a " in table and "| verispec (ar) |" in table and "llama.cpp |" not in table


def test_ttft_interleaves_with_a_llamacpp_peer(tiny_dirs, tmp_path, monkeypatch, capsys):
    """A stand-in peer (fixed 0.5 s) on the same ids: ours, peer, ours, peer ...; the ratio is ours / 500 ms."""
    events = []

    class FakePeer:
        def __init__(self, source, threads, context=4096):
            events.append(("load", source, context))

        def generate(self, ids, n, mode="llamacpp"):
            events.append(("llamacpp", len(ids), n))
            return [0] * n, 0.5

    request = serve_ttft.one_request

    async def logged(client, url, body, timeout):
        events.append(("verispec", body["max_tokens"]))
        return await request(client, url, body, timeout)

    monkeypatch.setitem(sys.modules, "llama_cpp", types.ModuleType("llama_cpp"))
    monkeypatch.setattr(peer_llamacpp, "LlamaCppPeer", FakePeer)
    monkeypatch.setattr(peer_llamacpp, "gguf_file", Path)
    monkeypatch.setattr(serve_ttft, "one_request", logged)
    out, target = tmp_path / "out", str(tiny_dirs["qwen2"])
    assert main(["bench-serve", "--target", target, "--dtype", "float32", "--methods", "ar", "--concurrency", "1",
                 "--requests-per-level", "1", "--max-tokens", "2", "--categories", "qa", "--warmup", "0", *TTFT,
                 "--ttft-repeats", "2", "--peers", "llamacpp", "--out", str(out)]) == 0
    t = read(out)["ttft"]
    p = t["prompt_tokens"]
    assert events == [("load", target, 512)] + [("verispec", 1), ("llamacpp", p, 1)] * 3  # set 0 warms up
    assert [x["side"] for x in t["trials"]] == ["verispec", "llamacpp"] * 2
    assert all(x["prompt_tokens"] == p for x in t["trials"])  # the server counted what the peer got
    assert t["llamacpp"] == {"runs": 2, "median_ms": 500.0, "min_ms": 500.0, "ms_per_prompt_token": round(500 / p, 4)}
    assert t["ratio_median"] == round(t["verispec"]["median_ms"] / 500, 4)
    assert t["ratio_min"] == round(t["verispec"]["min_ms"] / 500, 4)
    table = capsys.readouterr().out
    assert "| llama.cpp | 500.0 | 500.0 |" in table and f"verispec / llama.cpp: {t['ratio_median']:.2f}x" in table


def test_url_against_a_live_server(tiny_dirs, tmp_path, capsys):
    from verispec.server import create_app

    llm = LLM(target=str(tiny_dirs["qwen2"]), dtype="float32", progress=False)
    target = str(tiny_dirs["qwen2"])  # served under its path, as `verispec serve --target DIR` names it
    app = create_app(llm, target, method="ngram", max_num_seqs=4, kv_cache_tokens=2048, api_key="k")
    out = tmp_path / "out"
    with serving(app) as url:
        assert main(["bench-serve", "--url", url, "--api-key", "wrong", *SMALL]) == 2  # 401 on /v1/models
        assert main(["bench-serve", "--url", url, "--api-key", "k", "--concurrency", "1", "--requests-per-level",
                     "1", "--max-tokens", "2", "--categories", "qa"]) == 0
        assert "no TTFT phase: the server serves" in capsys.readouterr().err  # --target is not the served model
        assert main(["bench-serve", "--url", url, "--api-key", "k", "--target", target, *SMALL, *TTFT,
                     "--ttft-repeats", "1", "--out", str(out)]) == 0
    r = read(out)
    assert r["modes"] == ["url"] and r["model"] == target and r["url"] == url
    assert r["ttft"]["mode"] == "url" and 90 <= r["ttft"]["prompt_tokens"] <= 96 and len(r["ttft"]["trials"]) == 1
    assert [lv["failed"] + lv["garbled"] for lv in r["levels"]] == [0, 0]
    assert all(lv["metrics_diff"]["verispec:generation_tokens_total"] == lv["total_output_tokens"]
               for lv in r["levels"])


MISSING = "/nonexistent/model-dir"  # never reached: each flag is refused before a model loads


@pytest.mark.parametrize("flags,words", [
    (["--concurrency", "1,x"], "--concurrency takes comma-separated integers"),
    (["--concurrency", "0,1"], "integers >= 1"),
    (["--concurrency", "2,2"], "distinct"),
    (["--requests-per-level", "0"], "--requests-per-level must be >= 1"),
    (["--max-tokens", "0"], "--max-tokens"),
    (["--timeout", "0"], "--timeout"),
    (["--methods", "ar,beam"], "unknown method 'beam'"),
    (["--methods", "ar,ar"], "distinct"),
    (["--concurrency", "64", "--max-num-seqs", "4"], "5 x --max-num-seqs"),
    (["--categories", "nosuch"], "unknown category"),
    (["--url", "http://127.0.0.1:9"], "cannot reach"),
    (["--url", "localhost:8000"], "--url takes http://"),
    (["--url", "http://127.0.0.1:9", "--methods", "ar"], "--methods"),
    (["--bogus"], "unrecognized arguments"),
    (["--ttft-prompt-tokens", "-1"], "--ttft-prompt-tokens must be >= 0"),
    (["--ttft-repeats", "0"], "--ttft-repeats must be >= 1"),
    (["--peers", "hf"], "invalid choice: 'hf'"),
    (["--peers", "llamacpp", "--ttft-prompt-tokens", "0"], "--ttft-prompt-tokens 0 turns that off"),
])
def test_bad_flags_are_one_line_and_exit_2(capsys, flags, words):
    assert main(["bench-serve", "--target", MISSING, *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("verispec: error: ") and err.count("\n") == 1 and words in err, err


@pytest.mark.parametrize("llama_cpp,words", [
    (None, "--peers llamacpp needs llama-cpp-python: pip install llama-cpp-python"),
    (types.ModuleType("llama_cpp"), f"--peers llamacpp needs a GGUF target (a .gguf file or a registry name), got "
                                    f"{MISSING}"),
])
def test_llamacpp_peer_that_cannot_run_is_refused_before_loading(monkeypatch, capsys, llama_cpp, words):
    monkeypatch.setitem(sys.modules, "llama_cpp", llama_cpp)  # None: `import llama_cpp` raises ImportError
    assert main(["bench-serve", "--target", MISSING, "--peers", "llamacpp"]) == 2
    err = capsys.readouterr().err
    assert err == f"verispec: error: {words}\n"


def rec(mode, c, i, text, ok=True, prompt="p"):
    return {"mode": mode, "concurrency": c, "index": i, "prompt_id": prompt, "ok": ok, "text": text}


def test_garbled_check_catches_a_changed_text():
    recs = [rec("ar", 1, 0, "hello world"), rec("ar", 2, 0, "hello world"), rec("ar", 2, 1, "hello wOrld"),
            rec("auto", 1, 0, "hello world"), rec("auto", 2, 0, "hello there"), rec("auto", 2, 1, "x", ok=False),
            rec("ar", 1, 1, "other", prompt="q"), rec("auto", 1, 1, "other", prompt="q")]
    bad = check_identity(recs, ["ar", "auto"], cross_modes=True)
    where = [(m["mode"], m["concurrency"], m["index"], m["at_char"]) for m in bad]
    assert where == [("ar", 2, 1, 7), ("auto", 2, 0, 6)]
    assert bad[0]["reference"] == "ar c=1 #0" and bad[0]["got"].endswith("wOrld")
    assert [r["garbled"] for r in recs] == [False, False, True, False, True, False, False, False]


def test_garbled_check_across_modes_only_when_asked():
    recs = [rec("ar", 1, 0, "greedy"), rec("auto", 1, 0, "other"), rec("auto", 2, 0, "other")]
    assert [m["reference"] for m in check_identity(recs, ["ar", "auto"], cross_modes=True)] == ["ar c=1 #0"] * 2
    assert check_identity(recs, ["ar", "auto"], cross_modes=False) == []


def test_metrics_diff():
    page = ('# TYPE verispec:generation_tokens_total counter\nverispec:generation_tokens_total{model_name="m"} %d\n'
            '# TYPE verispec:e2e_request_latency_seconds histogram\n'
            'verispec:e2e_request_latency_seconds_bucket{le="1.0",model_name="m"} %d\n'
            'verispec:e2e_request_latency_seconds_bucket{le="+Inf",model_name="m"} %d\n'
            'verispec:e2e_request_latency_seconds_count{model_name="m"} %d\n'
            'verispec:e2e_request_latency_seconds_sum{model_name="m"} %g\n')
    d = metrics_diff(page % (10, 1, 1, 1, 0.5), page % (42, 2, 3, 3, 2.0))
    assert d == {"verispec:generation_tokens_total": 32, "verispec:e2e_request_latency_seconds_count": 2,
                 "verispec:e2e_request_latency_seconds_sum": 1.5}
    assert metrics_diff(None, page % (1, 1, 1, 1, 1)) is None
