"""A request fuzzer: the real server with `verispec serve`'s defaults (method auto, K = 4) on a tiny random model with
a near draft model, a few hundred seeded random bodies: valid values across every field's range, invalid ones (wrong
types, out of range, unknown fields, huge values, malformed JSON), several at a time, some clients leaving mid-stream
or before the answer. No answer may be a 5xx, none may hang, every valid body gets its 200, every invalid one a 4xx
in OpenAI's error shape, everything is freed afterwards, and a neighbour's greedy output stays what it was alone."""

from __future__ import annotations

import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import MODEL, live
from tiny import VOCAB, make_hf_dir
from verispec import LLM
from verispec.server import create_app

SEED = 44
REQUESTS = 300
WORKERS = 6  # requests in flight at once (the server runs 8)
TIMEOUT = 30.0  # seconds: a request that takes longer is a hang
NEIGHBOUR = {"model": MODEL, "prompt": "The neighbour asks the same thing", "max_tokens": 24, "temperature": 0}
CHARS = "abcxyz ABC\n.,:;{}()'\"\\\t\x00\x7f0123456789éß€中😀"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    target = make_hf_dir(root / "target", "qwen2", seed=3)
    near = make_hf_dir(root / "near", "qwen2", seed=3, noise=0.02)  # its drafts get accepted: long runs, K used up
    llm = LLM(target=str(target), draft=str(near), dtype="float32", draft_quant="none", progress=False)
    app = create_app(llm, MODEL, method="auto", num_draft_tokens=4, max_num_seqs=8, kv_cache_tokens=4096)
    with live(app) as url:
        yield url, app.state.runner


# -- bodies --

def text(rng: random.Random, most: int) -> str:
    """1..most characters (some of several UTF-8 bytes), never blank."""
    return rng.choice("abcxyzT") + "".join(rng.choice(CHARS) for _ in range(rng.randint(0, most - 1)))


def stop(rng: random.Random):
    if rng.random() < 0.3:
        return text(rng, 4)
    return [text(rng, rng.choice([1, 2, 3, 8, 256])) for _ in range(rng.randint(0, 4))]  # OpenAI's limits


def valid(rng: random.Random) -> tuple[str, dict]:
    """A body the server must answer with a 200: values across each field's range, prompts that fit the context."""
    chat = rng.random() < 0.5
    if chat:
        turns = [{"role": rng.choice(["system", "developer", "user", "assistant"]), "content": text(rng, 12)}
                 for _ in range(rng.randint(0, 1))]
        last = text(rng, 16)
        turns.append({"role": "user", "content": last if rng.random() < 0.7 else [{"type": "text", "text": last}]})
        body = {"messages": turns}
    elif rng.random() < 0.7:
        body = {"prompt": text(rng, 30)}
    else:
        body = {"prompt": [rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))]}
    options = {
        "model": lambda: MODEL,
        "max_tokens": lambda: rng.choice([1, 2, 5, 16, 32, 48]),
        "temperature": lambda: rng.choice([0, 0.0, 1e-40, 1e-30, 1e-8, 0.01, 0.5, 1, 1.5, 2, rng.uniform(0, 2)]),
        "top_p": lambda: rng.choice([1e-9, 0.1, 0.9, 1, rng.uniform(1e-6, 1)]),
        "top_k": lambda: rng.choice([-1, 0, 1, 2, 40, VOCAB - 1, VOCAB, 10**9]),
        "seed": lambda: rng.choice([0, 1, -(2**63), 2**64 - 1, rng.randrange(2**32)]),
        "stop": lambda: stop(rng),
        "stream": lambda: rng.random() < 0.5,
        "n": lambda: rng.choice([1, 1, 2, 3]),  # each choice takes a seat: WORKERS x 3 + the neighbour fit
        "ignore_eos": lambda: rng.random() < 0.5,
        "num_speculative_tokens": lambda: rng.randint(0, 16),
        "user": lambda: "fuzz", "metadata": lambda: {"k": "v"}, "store": lambda: False,
        "frequency_penalty": lambda: rng.choice([0, -2, -0.5, 0.7, 2]), "presence_penalty": lambda: rng.uniform(-2, 2),
        "logit_bias": lambda: {str(rng.randrange(VOCAB)): rng.choice([-100, -3.5, 0, 2, 100]) for _ in range(3)},
        "repetition_penalty": lambda: rng.choice([0.5, 1, 1.3, 2]), "min_p": lambda: rng.choice([0, 0.05, 0.5, 1]),
    }
    for key, value in options.items():
        if rng.random() < 0.5:
            body[key] = value()
    if chat and "max_tokens" not in body and rng.random() < 0.8:
        body["max_completion_tokens"] = rng.choice([1, 8, 32])  # else: all the room the context leaves
    if chat and rng.random() < 0.2:
        body.update(logprobs=False, response_format={"type": "text"}, tools=[], tool_choice="none")
    if rng.random() < 0.3:  # log-probabilities: chat's flag and 0..20 alternatives, the completions API's 0..5
        body.update({"logprobs": True, "top_logprobs": rng.randint(0, 20)} if chat else
                    {"logprobs": rng.randint(0, 5)})
    if body.get("stream") and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": rng.random() < 0.5}
    return ("chat/completions" if chat else "completions"), body


WRONG_TYPES = {"temperature": "hot", "max_tokens": 2.5, "top_p": "1", "top_k": 1.5, "seed": 1.5, "stream": "yes",
               "stop": 5, "n": "1", "ignore_eos": 1, "num_speculative_tokens": "4", "model": 5, "user": 5,
               "stream_options": {"include_usage": "yes"}, "metadata": {"k": 1}, "logit_bias": "none"}
OUT_OF_RANGE = {"temperature": [-1, 2.0001, 1e308], "top_p": [0, -0.1, 1.5], "top_k": [-2], "max_tokens": [0, -5],
                "seed": [2**64, -(2**63) - 1], "num_speculative_tokens": [-1, 17, 10**9], "n": [0, -1, 17, 10**6],
                "frequency_penalty": [2.5, -3], "logit_bias": [{"1": 101}, {"x": 1}, {"99999999": 1}],
                "model": ["gpt-9"], "top_logprobs": [21, -1], "min_p": [-0.1, 2], "repetition_penalty": [0, -1]}


def invalid(rng: random.Random) -> tuple[str, dict | bytes]:
    """A body the server must refuse with a 4xx."""
    path, body = valid(rng)
    body.pop("stream", None)  # the refusal comes before any stream
    kind = rng.randrange(8)
    if kind == 0:
        key = rng.choice(list(WRONG_TYPES))
        body[key] = WRONG_TYPES[key]
    elif kind == 1:
        key = rng.choice(list(OUT_OF_RANGE))
        body[key] = rng.choice(OUT_OF_RANGE[key])
    elif kind == 2:
        body[rng.choice(["foo", "Temperature", "max_new_tokens", "messages" if path == "completions" else "prompt"])] = 1
    elif kind == 3:  # huge: past the context, past the cache, a body over 1 MiB, thousands of stop strings
        body.pop("max_completion_tokens", None)  # (it would take the place of max_tokens)
        body.update(rng.choice([{"max_tokens": 10**20}, {"max_tokens": 10**6}, {"stop": ["s"] * 5000},
                                {"stop": "x" * 257}, {"stop": ["a", "b", "c", "d", "e"]}]))
        if rng.random() < 0.3:
            body["prompt" if path == "completions" else "messages"] = (
                "x" * rng.choice([300, 1 << 20]) if path == "completions"
                else [{"role": "user", "content": "x" * 300}])
    elif kind == 4:  # prompts that cannot run
        if path == "completions":
            body["prompt"] = rng.choice(["", "   ", [], [VOCAB], [-1], [2**40], [1.5], ["a", 1], {"a": 1}, None])
        else:
            body["messages"] = rng.choice([[], "hi", [{"role": "user"}], [{"role": "robot", "content": "hi"}],
                                           [{"role": "assistant", "content": "hi"}], [{"role": "user", "content": 5}],
                                           [{"role": "user", "content": " "}]])
    elif kind == 5:  # not finite: Python's json writes NaN and Infinity
        body[rng.choice(["temperature", "top_p"])] = rng.choice([float("nan"), float("inf"), -float("inf")])
    elif kind == 6:  # not JSON, or JSON that is not an object
        return path, rng.choice([b'{"prompt": "hi",', b"", b"null", b"[]", b"123", b'"text"', b"{" * 5000,
                                 b'{"prompt": "\xff\xfe"}', json.dumps(body).encode()[:-1],
                                 b'{"prompt": "hi", "metadata": ' + b"[" * 20000 + b"]" * 20000 + b"}"])
    else:  # not text: a lone surrogate (as a \\u escape, or raw: then the body is not UTF-8)
        lone = rng.choice(["\ud800abc", "ab\udfff"])
        body["prompt" if path == "completions" else "messages"] = (
            lone if path == "completions" else [{"role": "user", "content": lone}])
    return path, body


# -- sending them --

def encode(body: dict | bytes, ascii_only: bool) -> bytes:
    """JSON text with non-ASCII characters as \\u escapes or as raw UTF-8 (a lone surrogate: as invalid UTF-8)."""
    if isinstance(body, bytes):
        return body
    return json.dumps(body, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


def send(url: str, path: str, content: bytes, leave: str | None) -> tuple[int | None, str]:
    """(status, what came back); status None when this client left on purpose."""
    headers = {"Content-Type": "application/json"}
    if leave == "mid-stream":
        with httpx.stream("POST", f"{url}/v1/{path}", content=content, headers=headers, timeout=TIMEOUT) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    break  # the first chunk, then hang up
            return r.status_code, ""
    if leave == "before-the-answer":
        try:
            r = httpx.post(f"{url}/v1/{path}", content=content, headers=headers, timeout=0.05)
        except httpx.TimeoutException:
            return None, ""
        return r.status_code, r.text
    r = httpx.post(f"{url}/v1/{path}", content=content, headers=headers, timeout=TIMEOUT)
    return r.status_code, r.text


def check(case: tuple, status: int | None, reply: str) -> str | None:
    """What is wrong with the answer to one case, or None."""
    kind, path, body, _, leave = case
    if status is None:
        return None
    if status >= 500:
        return f"{status}: {reply[:300]}"
    if kind == "invalid":
        if not 400 <= status < 500:
            return f"an invalid body answered {status}"
        error = json.loads(reply).get("error", {})
        return None if set(error) == {"message", "type", "param", "code"} and error["message"] else f"shape: {reply}"
    if status != 200:
        return f"a valid body answered {status}: {reply[:300]}"
    if leave is None and isinstance(body, dict) and body.get("stream"):
        if '"error"' in reply or not reply.rstrip().endswith("data: [DONE]"):
            return f"the stream failed: {reply[-300:]}"
    return None


def test_no_request_crashes_the_server(server):
    url, runner = server
    rng = random.Random(SEED)
    cases = []
    for _ in range(REQUESTS):
        kind = "valid" if rng.random() < 0.55 else "invalid"
        path, body = valid(rng) if kind == "valid" else invalid(rng)
        leave = None
        if kind == "valid" and body.get("stream") and rng.random() < 0.3:
            leave = "mid-stream"
        elif kind == "valid" and rng.random() < 0.05:
            leave = "before-the-answer"
        cases.append((kind, path, body, encode(body, rng.random() < 0.5), leave))

    def neighbour() -> str:
        r = httpx.post(f"{url}/v1/completions", json=NEIGHBOUR, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    alone = neighbour()
    during, flooding = [], threading.Event()
    flooding.set()

    def keep_asking():
        while flooding.is_set():
            during.append(neighbour())

    watcher = threading.Thread(target=keep_asking)
    watcher.start()
    problems = []
    t0 = time.monotonic()
    try:
        with ThreadPoolExecutor(WORKERS) as pool:
            for case, outcome in zip(cases, pool.map(lambda c: run_case(url, c), cases)):
                if outcome:
                    problems.append(f"{case[0]} {case[1]} {short(case[3])} (leave: {case[4]}): {outcome}")
    finally:
        flooding.clear()
        watcher.join(timeout=2 * TIMEOUT)
    elapsed = time.monotonic() - t0
    assert not problems, f"{len(problems)} of {len(cases)} requests went wrong:\n" + "\n".join(problems[:25])
    assert during and set(during) == {alone}, "the neighbour's greedy output changed under the flood"
    wait_until_idle(runner)
    assert elapsed < 10 * TIMEOUT


def run_case(url: str, case: tuple) -> str | None:
    try:
        status, reply = send(url, case[1], case[3], case[4])
    except httpx.TimeoutException:
        return f"no answer in {TIMEOUT} s (a hang)"
    except Exception as e:  # noqa: BLE001 -- a connection the server dropped, or anything else: reported
        return f"{type(e).__name__}: {e}"
    return check(case, status, reply)


def short(content: bytes) -> str:
    text = content.decode("utf-8", "replace")
    return text if len(text) <= 160 else text[:120] + f"... ({len(text)} chars)"


def wait_until_idle(runner, seconds: float = 20.0) -> None:
    """Every request finished or aborted, every seat and every KV block free (clients that left included)."""
    deadline = time.monotonic() + seconds
    while runner.in_flight or runner.engine.has_work:
        assert time.monotonic() < deadline, "requests were not freed"
        time.sleep(0.02)
    blocks = runner.engine.blocks
    assert blocks.num_free == blocks.num_blocks and not runner.engine.requests
