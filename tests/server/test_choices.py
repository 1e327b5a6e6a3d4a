"""Several choices in one request: ``n`` samples of each prompt, /v1/completions' prompt lists (strings or token-id
lists), whole and streamed, with the official client and over raw HTTP; their seeds, usage sums, errors, and that
every choice is freed however the request ends."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from conftest import API_KEY, MODEL, live, metric
from conftest import slow_server as slow_server_of
from verispec import SamplingParams
from verispec.server import create_app

AUTH = {"Authorization": f"Bearer {API_KEY}"}
SAMPLED = dict(model=MODEL, max_tokens=12, temperature=1.0, seed=7)
GREEDY = dict(model=MODEL, max_tokens=12, temperature=0)
CHAT = [{"role": "user", "content": "Name three colours."}]


def post(url: str, path: str, body: dict, headers=AUTH, **kw) -> httpx.Response:
    return httpx.post(f"{url}/v1/{path}", json=body, headers=headers, timeout=30, **kw)


def sse(response: httpx.Response) -> list:
    """The ``data:`` payloads of a stream, [DONE] as the string."""
    lines = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    return [line if line == "[DONE]" else json.loads(line) for line in lines]


def assert_error(response: httpx.Response, status: int, param: str | None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error.keys() == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param


def wait_until_idle(runner, seconds: float = 10.0) -> None:
    """Every choice closed and every request out of the engine, every KV block free."""
    deadline = time.monotonic() + seconds
    while runner.in_flight or runner.engine.has_work or runner.engine.requests:
        assert time.monotonic() < deadline, "choices were not freed"
        time.sleep(0.01)
    assert runner.engine.blocks.num_free == runner.engine.blocks.num_blocks


def test_n_seeded_samples_are_reproducible_and_those_of_the_derived_seeds(client, llm):
    """Choice i draws with seed + i: what LLM.generate gives with that seed and the server's drafter (n-gram, K = 4:
    a seeded request always drafts its full K)."""
    out = client.completions.create(prompt="Sample me", n=3, **SAMPLED)
    assert [c.index for c in out.choices] == [0, 1, 2]
    texts = [c.text for c in out.choices]
    assert len(set(texts)) == 3  # different seeds, different samples
    assert [c.text for c in client.completions.create(prompt="Sample me", n=3, **SAMPLED).choices] == texts
    want = [llm.generate("Sample me", SamplingParams(max_new_tokens=12, temperature=1.0, seed=7 + i), method="ngram",
                         num_draft_tokens=4).text for i in range(3)]
    assert texts == want
    one = client.completions.create(prompt="Sample me", n=1, **SAMPLED)
    assert one.choices[0].text == texts[0]  # n = 1 keeps the request's own seed


def test_n_chat_samples_over_raw_http(base_url, llm):
    body = {"messages": CHAT, "n": 2, **SAMPLED}
    out = post(base_url, "chat/completions", body).json()
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert all(c["message"]["role"] == "assistant" for c in out["choices"])
    want = [llm.generate(CHAT, SamplingParams(max_new_tokens=12, temperature=1.0, seed=7 + i), method="ngram",
                         num_draft_tokens=4).text for i in range(2)]
    assert [c["message"]["content"] for c in out["choices"]] == want
    assert post(base_url, "chat/completions", body).json()["choices"] == out["choices"]


def test_greedy_choices_are_identical(client):
    alone = client.completions.create(prompt="Once upon a time", **GREEDY).choices[0].text
    out = client.completions.create(prompt="Once upon a time", n=2, **GREEDY)
    assert [c.text for c in out.choices] == [alone, alone]
    chat = client.chat.completions.create(messages=CHAT, n=2, **GREEDY)
    assert chat.choices[0].message.content == chat.choices[1].message.content


def test_usage_sums_the_choices_and_counts_the_prompt_once(client):
    out = client.completions.create(prompt="Count me", n=3, extra_body={"ignore_eos": True}, **SAMPLED)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(b"Count me"), 3 * 12)
    assert out.usage.total_tokens == len(b"Count me") + 36
    spec = out.model_extra["metrics"]["speculative_decoding"]
    assert spec["mean_acceptance_length"] == round(1 + spec["num_accepted_tokens"] / max(spec["num_drafts"], 1), 4)


def test_streamed_choices_make_the_whole_ones(client):
    """Each chunk carries its choice's index; each choice ends with its own finish_reason; the usage chunk comes once,
    last, with the sums; the per-choice metrics of the final chunks add up to the request's."""
    kw = dict(prompt="The cache", n=2, **SAMPLED)
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    texts, finished, spec = ["", ""], [], []
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += choice.text
        if choice.finish_reason is not None:
            finished.append(choice.index)
            spec.append(chunk.model_extra["metrics"]["speculative_decoding"])
        assert chunk.usage is None
    assert texts == [c.text for c in whole.choices] and sorted(finished) == [0, 1]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    total = chunks[-1].model_extra["metrics"]["speculative_decoding"]
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert total[key] == sum(s[key] for s in spec) == whole.model_extra["metrics"]["speculative_decoding"][key]


def test_streamed_chat_choices_over_raw_http(base_url):
    body = {"messages": CHAT, "n": 2, **SAMPLED}
    whole = post(base_url, "chat/completions", body).json()
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    events = sse(post(base_url, "chat/completions", streamed))
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    usage = [e for e in events[:-1] if not e["choices"]]
    assert len(usage) == 1 and usage[0] is events[-2] and usage[0]["usage"] == whole["usage"]
    texts, roles, finishes = ["", ""], [[], []], [[], []]
    for event in events[:-2]:
        (choice,) = event["choices"]
        texts[choice["index"]] += choice["delta"].get("content", "")
        roles[choice["index"]].append(choice["delta"].get("role"))
        finishes[choice["index"]].append(choice["finish_reason"])
    assert texts == [c["message"]["content"] for c in whole["choices"]]
    for i in range(2):  # the role in each choice's first delta only; its finish reason in its last chunk only
        assert roles[i][0] == "assistant" and set(roles[i][1:]) <= {None}
        assert finishes[i][-1] == whole["choices"][i]["finish_reason"] and set(finishes[i][:-1]) <= {None}


def test_prompt_lists_give_one_choice_per_prompt_in_order(client, base_url):
    prompts = ["abc", "Once upon a time", "The cache"]
    alone = [client.completions.create(prompt=p, **GREEDY).choices[0].text for p in prompts]
    out = client.completions.create(prompt=prompts, **GREEDY)
    assert [c.index for c in out.choices] == [0, 1, 2] and [c.text for c in out.choices] == alone
    assert out.usage.prompt_tokens == sum(len(p.encode()) for p in prompts)
    ids = post(base_url, "completions", {"prompt": [list(p.encode()) for p in prompts], **GREEDY}).json()
    assert [c["text"] for c in ids["choices"]] == alone
    chunks = list(client.completions.create(prompt=prompts, stream=True, **GREEDY))
    streamed = [""] * 3
    for chunk in chunks:
        streamed[chunk.choices[0].index] += chunk.choices[0].text
    assert streamed == alone


def test_prompt_lists_times_n_are_prompt_major(client):
    """Choice index = prompt index x n + sample index; each prompt's samples are those of its own request."""
    prompts = ["abc", "Sample me"]
    out = client.completions.create(prompt=prompts, n=2, **SAMPLED)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for p, prompt in enumerate(prompts):
        alone = client.completions.create(prompt=prompt, n=2, **SAMPLED)
        assert [c.text for c in out.choices[2 * p:2 * p + 2]] == [c.text for c in alone.choices]
    assert out.usage.prompt_tokens == sum(len(p.encode()) for p in prompts)


def test_completion_logprobs_per_choice(client):
    kw = dict(prompt=["abc", "Once upon a time"], logprobs=2, extra_body={"ignore_eos": True}, **GREEDY)
    out = client.completions.create(**kw)
    for choice in out.choices:  # each choice's text_offset counts in its own text
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.text_offset) == 12 and lp.text_offset[0] == 0
        assert lp.text_offset == sorted(lp.text_offset)
    chunks = list(client.completions.create(stream=True, **kw))
    for choice in out.choices:
        mine = [c.choices[0].logprobs for c in chunks if c.choices[0].index == choice.index and c.choices[0].logprobs]
        assert [o for lp in mine for o in lp.text_offset] == choice.logprobs.text_offset


OK = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "temperature": 0}
BAD = [  # (id, path, body, param)
    ("n-0", "completions", {**OK, "n": 0}, "n"),
    ("n-17", "completions", {**OK, "n": 17}, "n"),
    ("chat-n-17", "chat/completions", {"model": MODEL, "messages": CHAT, "n": 17}, "n"),
    ("n-string", "completions", {**OK, "n": "2"}, "n"),
    ("empty-prompt-list", "completions", {**OK, "prompt": []}, None),  # as an empty token list always was
    ("17-prompts", "completions", {**OK, "prompt": ["a"] * 17}, "prompt"),
    ("17-token-lists", "completions", {**OK, "prompt": [[97]] * 17}, "prompt"),
    ("mixed-prompt-list", "completions", {**OK, "prompt": ["a", [97]]}, "prompt"),
    ("strings-and-ids", "completions", {**OK, "prompt": ["a", 97]}, "prompt"),
    ("an-empty-prompt-in-a-list", "completions", {**OK, "prompt": ["abc", ""]}, None),  # as an empty prompt alone
    ("an-empty-token-list-in-a-list", "completions", {**OK, "prompt": [[97], []]}, None),
    ("a-prompt-past-the-context", "completions", {**OK, "prompt": ["abc", "x" * 300], "n": 2}, None),
    ("stream-options-without-stream", "completions", {**OK, "stream_options": {"include_usage": True}},
     "stream_options"),
    ("chat-stream-options-stream-false", "chat/completions",
     {"model": MODEL, "messages": CHAT, "stream": False, "stream_options": {"include_usage": False}}, "stream_options"),
]


@pytest.mark.parametrize("path,body,param", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_choices_are_400s(base_url, app, path, body, param):
    assert_error(post(base_url, path, body), 400, param)
    wait_until_idle(app.state.runner)  # a list refused for one of its prompts left none of the others running


def test_the_official_client_gets_a_bad_request(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(prompt="hi", n=17, **GREEDY)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(prompt=[], **GREEDY)


@pytest.fixture
def slow_server(llm):
    """Two seats and one queued: three choices in flight at most; engine steps take 50 ms. Yields (url, runner,
    aborted ids)."""
    with slow_server_of(llm, 2, 1) as server:
        yield server


def test_every_choice_takes_a_seat(slow_server):
    """The queue bound counts choices: n = 2 beside 2 running is a 429; more choices than the server ever queues is
    a 400; once the first ends, n = 3 fits."""
    url, runner, _ = slow_server
    assert_error(post(url, "completions", {**OK, "n": 4}, {}), 400, "n")
    assert_error(post(url, "completions", {**OK, "prompt": ["a", "b"], "n": 2}, {}), 400, "n")
    first = {}
    thread = threading.Thread(target=lambda: first.update(r=post(url, "completions", {**OK, "n": 2, "max_tokens": 8},
                                                                 {})))
    thread.start()
    deadline = time.monotonic() + 10
    while runner.in_flight < 2:
        assert time.monotonic() < deadline, "the first request never arrived"
        time.sleep(0.005)
    busy = post(url, "completions", {**OK, "n": 2}, {})
    assert_error(busy, 429, None)
    assert busy.headers["retry-after"] == "1"
    thread.join()
    assert first["r"].status_code == 200 and len(first["r"].json()["choices"]) == 2
    assert len(post(url, "completions", {**OK, "n": 3}, {}).json()["choices"]) == 3
    wait_until_idle(runner)


def test_a_client_gone_mid_stream_frees_every_choice(slow_server):
    url, runner, aborted = slow_server
    body = {**OK, "max_tokens": 32, "ignore_eos": True, "stream": True, "n": 3, "temperature": 1.0}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        next(response.iter_lines())  # the first chunk, then hang up
    wait_until_idle(runner)
    assert len(aborted) == 3


def test_a_client_gone_before_the_answer_frees_every_choice(slow_server):
    url, runner, aborted = slow_server
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json={**OK, "max_tokens": 32, "ignore_eos": True, "prompt": ["a", "b"]},
                   timeout=0.2)
    wait_until_idle(runner)
    assert len(aborted) == 2


def test_a_failing_choice_fails_its_request_and_frees_the_others(llm, monkeypatch):
    """Choice 1 (seed 101) breaks in its detokenising: the request is a 500 (an error event when streamed), its other
    choices are aborted, and the server goes on."""
    from verispec.server import runner as runner_module

    app = create_app(llm, MODEL, method="ar", max_num_seqs=4, kv_cache_tokens=1024)
    runner, feed = app.state.runner, runner_module.feed

    def failing_feed(stopper, tokens, num_draft=0):
        if stopper.params.seed == 101:
            raise ValueError("broken on purpose")
        return feed(stopper, tokens, num_draft)

    monkeypatch.setattr(runner_module, "feed", failing_feed)
    body = {**OK, "max_tokens": 24, "ignore_eos": True, "temperature": 1.0, "seed": 100, "n": 3}
    with live(app) as url:
        failed = post(url, "completions", body, {})
        assert_error(failed, 500, None)
        assert "broken on purpose" in failed.json()["error"]["message"]
        wait_until_idle(runner)
        events = sse(post(url, "completions", {**body, "stream": True}, {}))
        assert "broken on purpose" in events[-2]["error"]["message"] and events[-1] == "[DONE]"
        wait_until_idle(runner)
        assert len(post(url, "completions", {**body, "seed": 0}, {}).json()["choices"]) == 3
        page = httpx.get(f"{url}/metrics").text
        assert metric(page, "verispec:num_requests_running") == 0
