"""`verispec bench` on a tiny model: report schema and the transformers peer (no timings asserted)."""

import json

from verispec.cli import main


def test_bench_reports_floor_and_peer(tiny_dirs, tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = main(["bench", "--target", str(tiny_dirs["qwen2"]), "--dtype", "float32", "--quick", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    s = report["summary"]
    for key in ("ours_ms_per_token", "hf_ms_per_token", "floor_ms_per_token", "ratio_to_floor",
                "read_bandwidth_gbs", "weight_bytes", "speedup_vs_hf", "outputs_identical", "verify_cost_ms"):
        assert key in s, key
    assert s["read_bandwidth_gbs"] > 0 and s["floor_ms_per_token"] > 0
    assert set(s["verify_cost_ms"]) == {"1", "2", "4", "8", "16"}
    assert len(report["runs"]) == 2 and all(r["new_tokens"] == 32 for r in report["runs"])
    # float32 tiny model, greedy: ours and transformers produce the same tokens
    assert s["outputs_identical"] == 2
    assert report["environment"]["torch"] and report["chat"] is True
    text = capsys.readouterr().out
    assert "floor" in text and "| code-lru |" in text


def test_bench_bad_input(tiny_dirs, capsys):
    rc = main(["bench", "--target", str(tiny_dirs["qwen2"]), "--max-new-tokens", "1", "--peers", "none"])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("verispec: error:")
