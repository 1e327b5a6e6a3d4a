"""`verispec bench` on tiny models: report schema, the transformers peer, speculative rows (no timings asserted)."""

import json

from verispec.cli import main


def test_bench_reports_floor_and_peer(tiny_dirs, tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = main(["bench", "--target", str(tiny_dirs["qwen2"]), "--dtype", "float32", "--quick", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    d = report["summary"]["decode"]
    for key in ("ours_ms_per_token", "hf_ms_per_token", "floor_ms_per_token", "ratio_to_floor",
                "read_bandwidth_gbs", "weight_bytes", "speedup_vs_hf", "outputs_identical", "verify_cost_ms"):
        assert key in d, key
    assert d["read_bandwidth_gbs"] > 0 and d["floor_ms_per_token"] > 0
    assert set(d["verify_cost_ms"]) == {"1", "2", "4", "8", "16"}
    assert len(report["runs"]) == 2 and all(r["new_tokens"] == 32 for r in report["runs"])
    # float32 tiny model, greedy, same padding rows suppressed: ours and transformers produce the same tokens
    assert d["outputs_identical"] == 2
    assert report["environment"]["torch"] and report["chat"] is True
    assert set(report["summary"]["overall"]) == {"ar"}
    text = capsys.readouterr().out
    assert "floor" in text and "| code-lru |" in text


def test_bench_speculative_rows(tiny_dirs, tmp_path, capsys):
    out = tmp_path / "bench.json"
    t = str(tiny_dirs["qwen2"])
    rc = main(["bench", "--target", t, "--draft", t, "--draft-quant", "none", "--dtype", "float32", "--quick",
               "--peers", "none", "--methods", "ar,draft", "--num-draft-tokens", "2,3", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    overall = report["summary"]["overall"]
    assert set(overall) == {"ar", "draft:K=2", "draft:K=3"}
    for lb in ("draft:K=2", "draft:K=3"):
        m = overall[lb]
        # the draft is the target itself: every draft accepted, output identical to AR, tau = K+1 (bar the end)
        assert m["alpha"] == 1.0 and m["identical_to_ar"] == 2
        assert m["tau"] > 2.0 and m["cost_ratio_c"] > 0
        assert m["per_position_acceptance"] == [1.0] * int(lb[-1])
    assert set(report["summary"]["by_category"]) == {"coding", "writing"}
    assert "best in overall" in capsys.readouterr().out


def test_bench_bad_input(tiny_dirs, capsys):
    t = str(tiny_dirs["qwen2"])
    for argv in (["--max-new-tokens", "1"], ["--methods", "draft"], ["--methods", "ar,nope"],
                 ["--methods", "ar,draft", "--num-draft-tokens", "0"], ["--num-draft-tokens", "x"]):
        rc = main(["bench", "--target", t, "--peers", "none", *argv])
        assert rc == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("verispec: error:"), (argv, err)
