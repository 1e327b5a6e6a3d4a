"""Bad requests get the right 4xx in OpenAI's error shape and the server keeps serving; a full queue is a 429; a
client that goes away mid-request frees its request."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from conftest import API_KEY, MODEL, live, metric
from conftest import slow_server as slow_server_of
from verispec.server import create_app

AUTH = {"Authorization": f"Bearer {API_KEY}"}
OK = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "temperature": 0}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

CASES = [  # (id, path, body: dict or raw bytes, headers, status, param)
    ("malformed-json", "completions", b'{"prompt": "hi",', AUTH, 400, None),
    ("not-an-object", "completions", b"[1, 2]", AUTH, 400, None),
    ("empty-body", "chat/completions", b"", AUTH, 400, None),
    ("string-max-tokens", "completions", {**OK, "max_tokens": "2"}, AUTH, 400, "max_tokens"),
    ("float-max-tokens", "completions", {**OK, "max_tokens": 2.5}, AUTH, 400, "max_tokens"),
    ("string-temperature", "completions", {**OK, "temperature": "hot"}, AUTH, 400, "temperature"),
    ("string-stream", "completions", {**OK, "stream": "yes"}, AUTH, 400, "stream"),
    ("mixed-list-of-prompts", "completions", {**OK, "prompt": ["a", 1]}, AUTH, 400, "prompt"),
    ("messages-not-a-list", "chat/completions", {**CHAT, "messages": "hi"}, AUTH, 400, "messages"),
    ("content-not-text", "chat/completions", {**CHAT, "messages": [{"role": "user", "content": 5}]}, AUTH, 400,
     "messages"),
    ("unknown-role", "chat/completions", {**CHAT, "messages": [{"role": "robot", "content": "hi"}]}, AUTH, 400,
     "messages"),
    ("negative-max-tokens", "completions", {**OK, "max_tokens": -1}, AUTH, 400, "max_tokens"),
    ("zero-max-tokens", "chat/completions", {**CHAT, "max_tokens": 0}, AUTH, 400, "max_tokens"),
    ("huge-max-tokens", "completions", {**OK, "max_tokens": 10**20}, AUTH, 400, None),
    ("max-tokens-past-context", "chat/completions", {**CHAT, "max_completion_tokens": 300}, AUTH, 400, None),
    ("huge-seed", "completions", {**OK, "seed": 2**70}, AUTH, 400, "seed"),
    ("temperature-too-high", "completions", {**OK, "temperature": 5}, AUTH, 400, "temperature"),
    ("top-p-zero", "completions", {**OK, "top_p": 0}, AUTH, 400, "top_p"),
    ("empty-stop", "completions", {**OK, "stop": [""]}, AUTH, 400, "stop"),
    ("five-stops", "completions", {**OK, "stop": list("abcde")}, AUTH, 400, "stop"),  # OpenAI's limit: 4
    ("5000-stops", "chat/completions", {**CHAT, "stop": [f"s{i}" for i in range(5000)]}, AUTH, 400, "stop"),
    ("long-stop", "completions", {**OK, "stop": "x" * 257}, AUTH, 400, "stop"),
    ("stop-not-a-string", "completions", {**OK, "stop": [1]}, AUTH, 400, "stop"),
    ("empty-messages", "chat/completions", {**CHAT, "messages": []}, AUTH, 400, "messages"),
    ("ends-with-assistant", "chat/completions", {**CHAT, "messages": [{"role": "assistant", "content": "hi"}]},
     AUTH, 400, None),
    ("empty-prompt", "completions", {**OK, "prompt": ""}, AUTH, 400, None),
    ("empty-token-list", "completions", {**OK, "prompt": []}, AUTH, 400, None),
    ("token-outside-vocab", "completions", {**OK, "prompt": [1, 99999]}, AUTH, 400, None),
    ("prompt-past-context", "completions", {**OK, "prompt": "x" * 300}, AUTH, 400, None),
    ("n-17", "completions", {**OK, "n": 17}, AUTH, 400, "n"),  # 1..16
    ("n-0", "chat/completions", {**CHAT, "n": 0}, AUTH, 400, "n"),
    ("unknown-field", "chat/completions", {**CHAT, "foo": 1}, AUTH, 400, "foo"),
    ("penalty-out-of-range", "completions", {**OK, "frequency_penalty": 2.5}, AUTH, 400, "frequency_penalty"),
    ("bias-out-of-range", "completions", {**OK, "logit_bias": {"5": 101}}, AUTH, 400, "logit_bias"),
    ("bias-not-a-token", "completions", {**OK, "logit_bias": {"abc": 1}}, AUTH, 400, "logit_bias"),
    ("bias-outside-vocab", "completions", {**OK, "logit_bias": {"999999": 1}}, AUTH, 400, "logit_bias"),
    ("min-p-out-of-range", "chat/completions", {**CHAT, "min_p": 1.5}, AUTH, 400, "min_p"),
    ("top-logprobs-21", "chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, AUTH, 400, "top_logprobs"),
    ("top-logprobs-alone", "chat/completions", {**CHAT, "top_logprobs": 3}, AUTH, 400, "top_logprobs"),
    ("completion-logprobs-6", "completions", {**OK, "logprobs": 6}, AUTH, 400, "logprobs"),
    ("tool-choice-not-in-tools", "chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
                                                      "tool_choice": {"type": "function", "function": {"name": "g"}}},
     AUTH, 400, "tool_choice"),
    ("unknown-model", "completions", {**OK, "model": "gpt-9"}, AUTH, 404, "model"),
    ("missing-key", "completions", OK, {}, 401, None),
    ("wrong-key", "chat/completions", CHAT, {"Authorization": "Bearer nope"}, 401, None),
    ("wrong-scheme", "completions", OK, {"Authorization": f"Basic {API_KEY}"}, 401, None),
    ("oversized-body", "completions", {**OK, "prompt": "x" * (1 << 20)}, AUTH, 413, None),
]


def post(base_url, path, body, headers=AUTH, **kw):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{base_url}/v1/{path}", content=content,
                      headers={"Content-Type": "application/json", **headers}, timeout=30, **kw)


def assert_error(response, status, param=None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error.keys() == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param


@pytest.mark.parametrize("path,body,headers,status,param", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_request(base_url, path, body, headers, status, param):
    assert_error(post(base_url, path, body, headers), status, param)


def test_fields_the_official_client_may_send_at_their_defaults_are_accepted(base_url):
    neutral = dict(frequency_penalty=0, presence_penalty=0.0, logit_bias={}, logprobs=None, user="u1", n=1,
                   store=False, metadata={"k": "v"}, stream=False, stream_options=None, stop=None, seed=None)
    assert post(base_url, "completions", {**OK, **neutral, "echo": False, "best_of": 1}).status_code == 200
    chat = {**CHAT, **neutral, "logprobs": False, "tool_choice": "none", "response_format": {"type": "text"},
            "messages": [{"role": "developer", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "text", "text": "hi"}], "name": "me"}]}
    assert post(base_url, "chat/completions", chat).status_code == 200


def test_other_routes_answer_in_the_error_shape(base_url):
    assert_error(httpx.get(f"{base_url}/v1/nothing-here", headers=AUTH), 404)
    assert_error(httpx.get(f"{base_url}/v1/completions", headers=AUTH), 405)
    assert httpx.get(f"{base_url}/health").status_code == 200


def test_still_serving_after_the_bad_requests(base_url):
    for _, path, body, headers, _, _ in CASES:
        post(base_url, path, body, headers)
    out = post(base_url, "completions", OK)
    assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 2
    page = httpx.get(f"{base_url}/metrics").text
    assert metric(page, "verispec:num_requests_running") == 0 and metric(page, "verispec:kv_cache_usage_perc") == 0


def test_the_cache_bounds_a_request(llm):
    """A 32-token cache: a longer request is a 400; chat's default max_tokens is the room the cache leaves."""
    with live(create_app(llm, MODEL, method="ar", kv_cache_tokens=32)) as url:
        assert_error(post(url, "completions", {**OK, "prompt": "x" * 40}, {}), 400)
        assert_error(post(url, "completions", {**OK, "prompt": "x" * 20, "max_tokens": 14}, {}), 400)
        out = post(url, "chat/completions", {**CHAT, "max_tokens": None, "ignore_eos": True}, {}).json()
        assert out["usage"]["total_tokens"] == 33 and out["choices"][0]["finish_reason"] == "length"


@pytest.fixture
def slow_server(llm):
    """A server with one seat and no queue whose engine steps take 50 ms; yields (url, runner, aborted ids)."""
    with slow_server_of(llm, 1, 0) as server:
        yield server


def wait_until_idle(url, runner, seconds=10.0):
    """Poll until nothing runs, in the engine and on /metrics; then every block is free."""
    deadline = time.monotonic() + seconds
    while True:
        page = httpx.get(f"{url}/metrics").text
        if not (runner.engine.has_work or runner.in_flight or metric(page, "verispec:num_requests_running")
                or metric(page, "verispec:kv_cache_usage_perc")):
            break
        assert time.monotonic() < deadline, "the request was not freed"
        time.sleep(0.01)
    assert runner.engine.blocks.num_free == runner.engine.blocks.num_blocks and not runner.engine.requests


def test_a_full_queue_is_a_429_with_retry_after(slow_server):
    url, runner, _ = slow_server
    first = {}
    thread = threading.Thread(target=lambda: first.update(r=post(url, "completions", {**OK, "max_tokens": 8}, {})))
    thread.start()
    deadline = time.monotonic() + 10
    while not runner.in_flight:
        assert time.monotonic() < deadline, "the first request never arrived"
        time.sleep(0.005)
    busy = post(url, "completions", OK, {})
    assert_error(busy, 429)
    assert busy.headers["retry-after"] == "1"
    thread.join()
    assert first["r"].status_code == 200
    assert post(url, "completions", OK, {}).status_code == 200  # the seat is free again


def test_a_client_gone_mid_stream_frees_its_request(slow_server):
    url, runner, aborted = slow_server
    body = {**OK, "max_tokens": 16, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        next(response.iter_lines())  # the first step's chunk, then hang up
    wait_until_idle(url, runner)
    assert len(aborted) == 1


def test_a_client_gone_before_the_answer_frees_its_request(slow_server):
    url, runner, aborted = slow_server
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json={**OK, "max_tokens": 16}, timeout=0.2)
    wait_until_idle(url, runner)
    assert len(aborted) == 1


def test_an_engine_failure_is_a_500_and_the_server_goes_on(llm):
    app = create_app(llm, MODEL, method="ar", kv_cache_tokens=512)
    engine, failures = app.state.runner.engine, [RuntimeError("boom")]
    step = engine.step

    def failing_step():
        if failures:
            raise failures.pop()
        return step()

    engine.step = failing_step
    with live(app) as url:
        failed = post(url, "completions", OK, {})
        assert_error(failed, 500)
        assert failed.json()["error"]["type"] == "server_error"
        assert post(url, "completions", OK, {}).status_code == 200
        wait_until_idle(url, app.state.runner)


def test_a_request_that_fails_fails_alone(llm, monkeypatch):
    """A request whose text cannot be made (a bug in its detokenising, here one made on purpose) is a 500 in the error
    shape, streamed or not; the request running beside it in the same steps gets its whole answer."""
    from verispec.server import runner as runner_module

    app = create_app(llm, MODEL, method="ar", max_num_seqs=4, kv_cache_tokens=1024)
    runner = app.state.runner
    step, feed = runner.engine.step, runner_module.feed
    runner.engine.step = lambda: (time.sleep(0.01), step())[1]  # the neighbour is still running when it fails

    def failing_feed(stopper, tokens, num_draft=0):
        if "boom" in stopper.params.stop:
            raise ValueError("broken on purpose")
        return feed(stopper, tokens, num_draft)

    monkeypatch.setattr(runner_module, "feed", failing_feed)
    neighbour = {**OK, "max_tokens": 24, "ignore_eos": True}
    with live(app) as url:
        alone = post(url, "completions", neighbour, {}).json()["choices"][0]["text"]
        for stream in (False, True):
            result = {}
            thread = threading.Thread(target=lambda: result.update(r=post(url, "completions", neighbour, {})))
            thread.start()
            while not runner.in_flight:
                time.sleep(0.002)
            failed = post(url, "completions", {**OK, "stop": ["boom"], "stream": stream}, {})
            thread.join()
            if stream:  # the 200 was sent before the failure: the stream ends with an error event
                assert failed.status_code == 200
                events = [json.loads(line[6:]) for line in failed.text.splitlines()
                          if line.startswith("data: {")]
                error = events[-1]["error"]
            else:
                assert_error(failed, 500)
                error = failed.json()["error"]
            assert error["type"] == "server_error" and "broken on purpose" in error["message"]
            assert result["r"].status_code == 200 and result["r"].json()["choices"][0]["text"] == alone
        wait_until_idle(url, runner)
