"""`verispec serve`: bad flags are one line and exit 2 (before any model loads); good ones build the app and hand it
to uvicorn; `verispec generate` does not import the server's packages."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
import uvicorn

from conftest import live
from verispec.cli import main

MISSING = "/nonexistent/model-dir"  # never reached: each flag is refused before a model loads


@pytest.mark.parametrize("flags,words", [
    (["--port", "0"], "--port"),
    (["--port", "70000"], "--port"),
    (["--max-num-seqs", "0"], "--max-num-seqs"),
    (["--kv-cache-tokens", "8"], "--kv-cache-tokens"),
    (["--method", "beam"], "unknown method 'beam'"),
    (["--num-draft-tokens", "0"], "num_draft_tokens"),
    (["--api-key", " "], "--api-key"),
    (["--port", "eighty"], "invalid int value"),
    (["--bogus"], "unrecognized arguments"),
])
def test_bad_flags_are_one_line_and_exit_2(capsys, flags, words):
    assert main(["serve", "--target", MISSING, *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("verispec: error: ") and err.count("\n") == 1 and words in err


def test_serve_hands_the_app_to_uvicorn(monkeypatch, llm):
    seen = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.update(app=app, **kw))
    assert main(["serve", "--target", str(llm.target.source), "--dtype", "float32", "--method", "ar", "--port",
                 "8123", "--kv-cache-tokens", "512", "--served-model-name", "mine"]) == 0
    assert (seen["host"], seen["port"]) == ("127.0.0.1", 8123)
    with live(seen["app"]) as url:
        assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == ["mine"]
        out = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 3, "temperature": 0})
        assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 3


def test_generate_does_not_import_the_server():
    code = "import sys, verispec.cli as c; c.build_parser(); print(sorted({'fastapi', 'uvicorn'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr
