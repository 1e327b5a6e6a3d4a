"""`verispec bench` on tiny models: report schema, peers, speculative rows, prompts, plot, interrupts (no timings asserted)."""

import json

import pytest

from verispec.cli import main

PROMPTS = [  # short: the tiny models' byte tokenizer and 256-token context
    {"id": "c1", "category": "coding", "prompt": "def add(a, b):"},
    {"id": "w1", "category": "writing", "prompt": "Once upon a time"},
    {"id": "c2", "category": "coding", "prompt": "for i in range(10):"},
    {"id": "w2", "category": "writing", "prompt": "Dear friend,"},
]


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n")
    return str(path)


def bench(tmp_path, *argv):
    out = tmp_path / "bench.json"
    rc = main(["bench", "--dtype", "float32", "--json", str(out), *argv])
    return rc, (json.loads(out.read_text()) if out.exists() else None)


def test_bench_schema_peers_and_floor(tiny_dirs, tmp_path, prompt_file, capsys):
    t = str(tiny_dirs["qwen2"])
    rc, report = bench(tmp_path, "--target", t, "--draft", t, "--draft-quant", "none", "--prompts", prompt_file,
                       "--max-new-tokens", "12", "--methods", "ar,draft", "--num-draft-tokens", "2")
    assert rc == 0 and report["complete"] is True
    for run in report["runs"]:  # the fields the issue promises, on every run
        for key in ("method", "category", "prompt_id", "new_tokens", "wall_s", "tokens_per_s", "acceptance_rate",
                    "mean_accepted_length", "per_position_acceptance", "label"):
            assert key in run, key
    assert [r["prompt_id"] for r in report["runs"] if r["method"] == "ar"] == ["c1", "w1", "c2", "w2"]
    s = report["summary"]
    for table in [s["overall"], *s["by_category"].values()]:
        for lb in ("ar", "draft:K=2"):
            assert {"speedup", "tau", "alpha", "tokens_per_s"} <= set(table[lb])
    assert set(s["by_category"]) == {"coding", "writing"}
    d = report["summary"]["decode"]
    for key in ("ours_ms_per_token", "hf_ms_per_token", "floor_ms_per_token", "ratio_to_floor",
                "read_bandwidth_gbs", "weight_bytes", "speedup_vs_hf", "outputs_identical", "verify_cost_ms"):
        assert key in d, key
    assert set(d["verify_cost_ms"]) == {str(T) for T in range(1, 17)}  # v(T) for every T a round can verify
    # float32 tiny model, greedy, same padding rows suppressed: transformers (every mode) gives our AR's tokens
    assert set(report["peers"]) == {"hf", "hf-assistant", "hf-lookup"}
    for name, peer in report["peers"].items():
        assert {"speedup", "tokens_per_s", "ours_vs_theirs", "by_category"} <= set(peer), name
        assert peer["identical_to_ar"] == 4, name
    assert report["peers"]["hf"]["counterpart"] == "ar"
    assert report["peers"]["hf-assistant"]["counterpart"] == "draft:K=2"
    assert report["peers"]["hf-lookup"]["ours_vs_theirs"] is None  # no n-gram method yet
    assert report["environment"]["torch"] and report["chat"] is True
    text = capsys.readouterr().out
    assert "| hf-assistant | overall |" in text and "floor" in text and "predicted" in text


def test_bench_speculative_rows(tiny_dirs, tmp_path, prompt_file, capsys):
    t = str(tiny_dirs["qwen2"])
    plot = tmp_path / "bench.png"
    rc, report = bench(tmp_path, "--target", t, "--draft", t, "--draft-quant", "none", "--quick", "--prompts",
                       prompt_file, "--peers", "none", "--methods", "ar,draft", "--num-draft-tokens", "2,3",
                       "--early-stop", "both", "--plot", str(plot))
    assert rc == 0
    assert len({r["prompt_id"] for r in report["runs"]}) == 2  # --quick: one prompt per category
    overall = report["summary"]["overall"]
    assert set(overall) == {"ar", "draft:K=2", "draft:K=3", "draft:K=2:full", "draft:K=3:full"}
    for lb in ("draft:K=2", "draft:K=3"):  # rounds may end early (a flat random draft: after one token)
        m = overall[lb]
        assert m["alpha"] == 1.0 and m["identical_to_ar"] == 2 and m["predicted_speedup"] is None
        assert 1.0 <= m["drafts_per_round"] <= int(lb[-1])
    for K, lb in ((2, "draft:K=2:full"), (3, "draft:K=3:full")):
        m = overall[lb]
        assert K - 0.5 < m["drafts_per_round"] <= K  # K every round (the last may be cut by the budget)
        # the draft is the target itself: every draft accepted, output identical to AR, tau = K+1 (bar the end)
        assert m["alpha"] == 1.0 and m["identical_to_ar"] == 2
        assert m["tau"] > 2.0 and m["cost_ratio_c"] > 0 and m["predicted_speedup"] > 0
        assert m["per_position_acceptance"] == [1.0] * K
        assert m["per_position_joint"] == [1.0] * K
    assert report.get("peers") == {}
    assert plot.read_bytes()[:4] == b"\x89PNG"
    assert "best in overall" in capsys.readouterr().out


def test_bench_default_methods_ngram_auto_adaptive(tiny_dirs, tmp_path, prompt_file):
    t = str(tiny_dirs["qwen2"])
    rc, report = bench(tmp_path, "--target", t, "--draft", t, "--prompts", prompt_file, "--peers", "none",
                       "--max-new-tokens", "16", "--num-draft-tokens", "2,3", "--adaptive", "--ngram-min", "2")
    assert rc == 0
    # every available method (ar, draft, ngram, auto); fixed K per value, adaptive up to the largest
    assert set(report["summary"]["overall"]) == {"ar", "draft:K=2", "draft:K=3", "draft:K<=3", "ngram:K=2",
                                                 "ngram:K=3", "ngram:K<=3", "auto:K<=3"}
    auto = [r for r in report["runs"] if r["label"] == "auto:K<=3"]
    # every record names auto's delegates (0 rounds for one it never drafted with: plain steps may win all along)
    assert all(set(r["drafter_rounds"]) == {"ngram", "draft"} for r in auto)
    assert all(r["identical_to_ar"] for r in report["runs"] if r["method"] == "ngram")  # float32, greedy


def test_bench_compares_draft_formats_in_one_run(tiny_dirs, tmp_path, prompt_file):
    t = str(tiny_dirs["qwen2"])
    rc, report = bench(tmp_path, "--target", t, "--draft", t, "--draft-quant", "none,int8", "--prompts", prompt_file,
                       "--peers", "none", "--max-new-tokens", "10", "--methods", "ar,draft,ngram",
                       "--num-draft-tokens", "2", "--limit", "2")
    assert rc == 0
    # every draft-model method once per format (interleaved per prompt); n-gram lookup once, untagged
    assert set(report["summary"]["overall"]) == {"ar", "draft@none:K=2", "draft@int8:K=2", "ngram:K=2"}
    labels = [r["label"] for r in report["runs"] if r["prompt_id"] == "c1"]
    assert labels == ["ar", "draft@none:K=2", "draft@int8:K=2", "ngram:K=2"]
    overall = report["summary"]["overall"]
    assert overall["draft@none:K=2"]["alpha"] == 1.0  # the float draft is the target itself
    assert overall["draft@none:K=2"]["identical_to_ar"] == overall["draft@int8:K=2"]["identical_to_ar"] == 2
    assert report["draft_quant"] == "none,int8"


def test_bench_builtin_suite_skips_prompts_too_long_for_the_context(tiny_dirs, tmp_path, capsys):
    rc, report = bench(tmp_path, "--target", str(tiny_dirs["qwen2"]), "--quick", "--peers", "none",
                       "--categories", "coding,rag", "--max-new-tokens", "8")
    assert rc == 0
    assert {r["category"] for r in report["runs"]} == {"coding"}  # the RAG prompt (~1.4k bytes) does not fit
    assert "skipping 1 prompt(s) longer than the context" in capsys.readouterr().err


def test_bench_interrupt_keeps_partial_results(tiny_dirs, tmp_path, prompt_file, monkeypatch):
    from verispec.bench import runner

    real, calls = runner.run_prompt, []

    def flaky(*args, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kw)

    monkeypatch.setattr(runner, "run_prompt", flaky)
    rc, report = bench(tmp_path, "--target", str(tiny_dirs["qwen2"]), "--prompts", prompt_file, "--peers", "none",
                       "--max-new-tokens", "4")
    assert rc == 130 and report["complete"] is False
    assert [r["prompt_id"] for r in report["runs"] if r["method"] == "ar"] == ["c1", "w1"]
    assert set(report["summary"]["by_category"]) == {"coding", "writing"}


def test_bench_bad_input(tiny_dirs, tmp_path, capsys):
    t = str(tiny_dirs["qwen2"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "hello"}\n')
    for argv in (["--max-new-tokens", "1"], ["--methods", "draft"], ["--methods", "ar,nope"],
                 ["--methods", "ar,draft", "--num-draft-tokens", "0"], ["--num-draft-tokens", "x"],
                 ["--prompts", str(tmp_path / "missing.jsonl")], ["--prompts", str(bad)],
                 ["--categories", "nope"], ["--limit-per-category", "0"], ["--methods", "ar,draft"],
                 ["--draft-quant", "int8,int3"], ["--draft-quant", "int8,int8"], ["--draft-quant", ","],
                 ["--peers", "vllm"], ["--peers", "hf,nope"], ["--peers", ","]):
        rc = main(["bench", "--target", t, "--peers", "none", *argv])
        assert rc == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("verispec: error:"), (argv, err)


def test_draft_step_microbenchmark_runs(tiny_dirs, capsys):
    from verispec.bench.draft_step import main as draft_step

    assert draft_step(["--model", str(tiny_dirs["qwen2"]), "--context", "8", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    for row in ("| bf16 |", "| int8 per-op |", "| int8 fused |", "| int4 per-op |", "| int4 fused |"):
        assert row in out, out
    for bad in (["--model", "/no/such/model"], ["--repeats", "0"], ["--context", "x"]):
        assert draft_step(bad) == 2, bad
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("verispec: error:"), err


def test_bench_llamacpp_peer(tiny_dirs, tmp_path, prompt_file, capsys, monkeypatch):
    """--peers llamacpp: a one-line error when llama-cpp-python is missing; its two modes in the report beside
    ours (a fake peer: CI does not build llama.cpp; tests/unit/test_peer_llamacpp.py tests the peer itself)."""
    import sys

    from verispec.bench import peer_llamacpp

    t = str(tiny_dirs["qwen2"])
    argv = ["--target", t, "--draft", t, "--prompts", prompt_file, "--max-new-tokens", "6", "--methods", "ar,ngram",
            "--num-draft-tokens", "2"]
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    assert main(["bench", "--peers", "llamacpp", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install llama-cpp-python" in err[0], err

    class FakePeer:
        modes = ["llamacpp", "llamacpp-lookup"]

        def __init__(self, source, threads, context, timeout=None):
            assert source == t and threads >= 1 and context >= 512 and timeout == 600

        def generate(self, ids, n, mode="llamacpp", params=None):
            return [0] * n, 0.5 if mode == "llamacpp" else 0.25

    monkeypatch.setattr(peer_llamacpp, "LlamaCppPeer", FakePeer)
    rc, report = bench(tmp_path, "--peers", "llamacpp", *argv)
    assert rc == 0 and set(report["peers"]) == {"llamacpp", "llamacpp-lookup"}
    assert report["peers"]["llamacpp-lookup"]["speedup"] == 2.0  # against llama.cpp's own plain run
    assert report["peers"]["llamacpp"]["counterpart"] == "ar"
    assert report["peers"]["llamacpp-lookup"]["counterpart"] == "ngram:K=2"
    assert "hf_ms_per_token" not in report["runs"][0]
    assert "| llamacpp | overall |" in capsys.readouterr().out


def test_a_peer_failing_on_a_prompt_is_recorded_and_the_run_goes_on(tiny_dirs, tmp_path, prompt_file, capsys,
                                                                    monkeypatch):
    """A peer that fails on purpose: its plain mode with an exception on one prompt, its lookup mode past its timeout
    on all but one (every writing prompt). Each failure is in the JSON (for that prompt and mode, with its message),
    the table and the plot; the other prompts are measured."""
    from verispec.bench import peer_llamacpp

    pytest.importorskip("matplotlib")

    def text(ids):
        return bytes(i for i in ids if i < 256)

    class FailingPeer:
        modes = ["llamacpp", "llamacpp-lookup"]

        def __init__(self, source, threads, context, timeout=None):
            self.timeout = timeout

        def generate(self, ids, n, mode="llamacpp", params=None):
            if b"Once upon" in text(ids) and mode == "llamacpp" and n > 4:
                raise ValueError("could not broadcast input array from shape (77791232,) into shape (0,)\ndetails")
            if mode == "llamacpp-lookup" and (b"range" in text(ids) or n > 4 and b"def" not in text(ids)):
                raise TimeoutError(f"{mode}: 3 of {n} tokens in {self.timeout:g} s")
            return [0] * n, 0.5 if mode == "llamacpp" else 0.25

    monkeypatch.setattr(peer_llamacpp, "LlamaCppPeer", FailingPeer)
    order = tmp_path / "order.jsonl"  # the prompt the lookup mode fails on first: its warm-up fails too
    order.write_text("".join(line for line in open(prompt_file) if "range" in line)
                     + "".join(line for line in open(prompt_file) if "range" not in line))
    plot = tmp_path / "bench.png"
    rc, report = bench(tmp_path, "--target", str(tiny_dirs["qwen2"]), "--prompts", str(order), "--max-new-tokens",
                       "6", "--methods", "ar,ngram", "--num-draft-tokens", "2", "--peers", "llamacpp",
                       "--peer-timeout", "30", "--plot", str(plot))
    assert rc == 0 and report["complete"] is True
    failed = {(r["peer"], r["prompt_id"]): r["error"] for r in report["peer_runs"] if "error" in r}
    assert failed == {("llamacpp", "w1"): "ValueError: could not broadcast input array from shape (77791232,) into "
                                          "shape (0,)",
                      **{("llamacpp-lookup", p): "TimeoutError: llamacpp-lookup: 3 of 6 tokens in 30 s"
                         for p in ("c2", "w1", "w2")}}
    assert len(report["peer_runs"]) == 8 and sum("wall_s" in r for r in report["peer_runs"]) == 4
    plain, lookup = report["peers"]["llamacpp"], report["peers"]["llamacpp-lookup"]
    assert (plain["prompts"], plain["failed"], lookup["prompts"], lookup["failed"]) == (3, 1, 1, 3)
    assert plain["failures"] == [{"prompt_id": "w1", "category": "writing", "error": failed["llamacpp", "w1"]}]
    assert lookup["speedup"] == 2.0  # on the prompts both modes ran
    assert plain["by_category"]["writing"]["failed"] == 1 and plain["by_category"]["coding"]["failed"] == 0
    assert lookup["by_category"]["writing"] == {**lookup["by_category"]["writing"], "prompts": 0, "failed": 2,
                                                "speedup": None, "tokens_per_s": None}
    out, err = capsys.readouterr()
    assert any(line.startswith("| writing | 2 |") and line.endswith("| failed |") for line in out.splitlines())
    assert "- llamacpp on w1 (writing): ValueError: could not broadcast" in out
    assert "- llamacpp-lookup on c2 (coding): TimeoutError" in out
    assert "peer llamacpp-lookup failed its warm-up" in err and "peer llamacpp failed on w1" in err
    assert plot.stat().st_size > 0

