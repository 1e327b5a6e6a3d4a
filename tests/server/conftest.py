"""A live server for the tests: uvicorn on 127.0.0.1 (a free port) in a background thread, serving a tiny random
float32 model with n-gram speculation."""

from __future__ import annotations

import re
import socket
import threading
import time
from contextlib import contextmanager

import pytest
import uvicorn

from tiny import make_hf_dir
from verispec import LLM
from verispec.server import create_app

API_KEY = "test-key"
MODEL = "tiny"


@contextmanager
def live(app):
    """Serve ``app`` until the block ends; yields the base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


@pytest.fixture(scope="session")
def llm(tmp_path_factory):
    path = make_hf_dir(tmp_path_factory.mktemp("serve") / "tiny", "qwen2", seed=3)
    return LLM(target=str(path), dtype="float32", progress=False)


@pytest.fixture(scope="session")
def app(llm):
    return create_app(llm, MODEL, method="ngram", num_draft_tokens=4, max_num_seqs=8, kv_cache_tokens=4096,
                      api_key=API_KEY)


@pytest.fixture(scope="session")
def base_url(app):
    with live(app) as url:
        yield url


@pytest.fixture
def fixed_k(app, monkeypatch):
    """Every request drafts its full K each step, greedy ones too: which drafts are accepted is then the same every
    run (the cost model may otherwise give a greedy request K = 0 on a slow machine)."""
    engine = app.state.runner.engine
    add = engine.add
    monkeypatch.setattr(engine, "add", lambda *args, **kw: add(*args, **{**kw, "fixed_k": True}))


@pytest.fixture
def client(base_url):
    from openai import OpenAI

    return OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0, timeout=30)


def metric(text: str, name: str, **labels) -> float:
    """One sample's value from a Prometheus text page."""
    want = {"model_name": MODEL, **labels}
    for line in text.splitlines():
        m = re.fullmatch(r"([^{\s]+)(?:\{(.*)\})? (\S+)", line)
        if m and m[1] == name and dict(re.findall(r'(\w+)="([^"]*)"', m[2] or "")) == want:
            return float(m[3])
    raise KeyError(f"{name}{labels} not on the page")


@contextmanager
def slow_server(llm, seats: int, waiting: int):
    """A server of ``seats`` running and ``waiting`` queued requests whose engine steps take 50 ms; yields (url,
    runner, aborted request ids)."""
    app = create_app(llm, MODEL, method="ar", max_num_seqs=seats, kv_cache_tokens=1024, max_waiting=waiting)
    runner, aborted = app.state.runner, []
    step, abort = runner.engine.step, runner.engine.abort
    runner.engine.step = lambda: (time.sleep(0.05), step())[1]
    runner.engine.abort = lambda rid: (aborted.append(rid), abort(rid))[1]
    with live(app) as url:
        yield url, runner, aborted
