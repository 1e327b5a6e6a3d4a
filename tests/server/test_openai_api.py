"""The official openai client against a live server: completions, chat, streaming, usage, seeds, stop strings,
lengths, speculative stats, and concurrent requests that each get what they get alone."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from conftest import MODEL, metric

GREEDY = dict(model=MODEL, temperature=0, max_tokens=12)
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colours."}]


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion_runs_to_max_tokens(client):
    out = client.completions.create(prompt="Once upon a time", **GREEDY)
    choice = out.choices[0]
    assert out.object == "text_completion" and out.model == MODEL
    assert choice.finish_reason == "length" and choice.text
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(b"Once upon a time"), 12)
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12


def test_token_id_prompt_is_the_text_prompt(client):
    by_text = client.completions.create(prompt="abc", **GREEDY).choices[0].text
    assert client.completions.create(prompt=list(b"abc"), **GREEDY).choices[0].text == by_text


def test_chat_completion(client):
    out = client.chat.completions.create(messages=CHAT, **GREEDY)
    msg = out.choices[0].message
    assert out.object == "chat.completion" and msg.role == "assistant" and msg.content
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 12


def test_chat_template_is_applied(client, llm):
    out = client.chat.completions.create(messages=CHAT[1:], **GREEDY)
    assert out.usage.prompt_tokens == len(llm.codec.encode(CHAT[1:]))
    assert out.usage.prompt_tokens > len(CHAT[1]["content"])  # the template's tokens too


def test_streamed_pieces_make_the_whole_completion(client):
    whole = client.completions.create(prompt="The cache", **GREEDY).choices[0].text
    chunks = list(client.completions.create(prompt="The cache", stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == whole
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1]) and len(chunks) > 1


def test_streamed_chat_deltas_make_the_whole_message(client):
    whole = client.chat.completions.create(messages=CHAT, **GREEDY).choices[0].message.content
    chunks = list(client.chat.completions.create(messages=CHAT, stream=True, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole
    assert chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].model_extra["metrics"]["speculative_decoding"].keys() >= {"num_drafts", "mean_acceptance_length"}


def test_include_usage_adds_a_last_chunk(client):
    chunks = list(client.chat.completions.create(messages=CHAT, stream=True, stream_options={"include_usage": True},
                                                 **GREEDY))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_same_seed_same_text(client):
    kw = dict(model=MODEL, prompt="Sample me", max_tokens=16, temperature=1.0, top_p=0.95, seed=7)
    texts = [client.completions.create(**kw).choices[0].text for _ in range(2)]
    other = client.completions.create(**{**kw, "seed": 8}).choices[0].text
    top_k = client.completions.create(**kw, extra_body={"top_k": 1}).choices[0].text
    assert texts[0] == texts[1] != other
    assert top_k == client.completions.create(prompt="Sample me", **{**GREEDY, "max_tokens": 16}).choices[0].text


def test_stop_string_cuts_the_text_and_ends_the_request(client, app, monkeypatch):
    whole = client.completions.create(prompt="Stop here", **{**GREEDY, "max_tokens": 16}).choices[0].text
    stop = next(ch for ch in whole[3:] if ch.isascii() and ch.isprintable())  # a character past the start
    engine, aborted = app.state.runner.engine, []
    abort = engine.abort
    monkeypatch.setattr(engine, "abort", lambda rid: (aborted.append(rid), abort(rid))[1])
    out = client.completions.create(prompt="Stop here", stop=[stop, "never-seen"], **{**GREEDY, "max_tokens": 16})
    assert out.choices[0].text == whole[:whole.index(stop)]
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens < 16
    assert len(aborted) == 1  # the engine stopped generating at the stop string
    streamed = client.completions.create(prompt="Stop here", stop=stop, stream=True, **{**GREEDY, "max_tokens": 16})
    assert "".join(c.choices[0].text for c in streamed) == whole[:whole.index(stop)]


def test_speculative_stats(client, base_url):
    before = httpx.get(f"{base_url}/metrics").text
    # top_k=1 samples the greedy text, which n-gram lookup drafts well here; a seeded sampling request drafts its
    # full K every step (a greedy one gets K from the engine's cost model, possibly 0)
    out = client.completions.create(model=MODEL, prompt="Hello Hello Hello", max_tokens=16, temperature=1.0, seed=0,
                                    extra_body={"top_k": 1})
    stats = out.model_extra["metrics"]["speculative_decoding"]
    assert 0 < stats["num_accepted_tokens"] <= stats["num_draft_tokens"]
    assert stats["mean_acceptance_length"] == round(1 + stats["num_accepted_tokens"] / stats["num_drafts"], 4)
    after = httpx.get(f"{base_url}/metrics").text
    for name, key in [("drafts", "num_drafts"), ("draft_tokens", "num_draft_tokens"),
                      ("accepted_tokens", "num_accepted_tokens")]:
        series = f"verispec:spec_decode_num_{name}_total"
        assert metric(after, series) - metric(before, series) == stats[key]
    per_pos = [metric(after, "verispec:spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
               for i in range(4)]
    assert sum(per_pos) == metric(after, "verispec:spec_decode_num_accepted_tokens_total")
    assert per_pos == sorted(per_pos, reverse=True)  # a later position is accepted only after the earlier ones


def test_concurrent_requests_get_what_they_get_alone(client, base_url, app, monkeypatch):
    prompts = [f"Request {i}: " + "xyz"[: i % 3 + 1] * (i + 1) for i in range(8)]

    def ask(prompt):
        return client.completions.create(prompt=prompt, **{**GREEDY, "max_tokens": 16}).choices[0].text

    alone = [ask(p) for p in prompts]
    runner = app.state.runner
    engine, peak = runner.engine, []
    step = engine.step

    def step_once_all_are_in():  # hold the first step until all 8 are submitted: they run as one batch
        if not peak:
            deadline = time.monotonic() + 10
            while runner.in_flight < len(prompts) and time.monotonic() < deadline:
                time.sleep(0.005)
            peak.append(0)
            return []  # back to the inbox: the runner admits them all before the next step
        peak.append(engine.scheduler.num_running)
        return step()

    monkeypatch.setattr(engine, "step", step_once_all_are_in)
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(ask, prompts))
    assert max(peak) == len(prompts)
    assert together == alone and len(set(alone)) == len(alone)
    page = httpx.get(f"{base_url}/metrics").text
    assert metric(page, "verispec:num_requests_running") == 0
    assert metric(page, "verispec:num_requests_waiting") == 0
    assert metric(page, "verispec:kv_cache_usage_perc") == 0
    assert metric(page, "verispec:generation_tokens_total") >= 16 * 16
    assert metric(page, "verispec:e2e_request_latency_seconds_count") >= 16


def test_a_request_sets_its_own_k(client):
    """num_speculative_tokens: 0 turns speculation off for the request, N drafts N tokens every step (the last steps
    excepted, or fewer where lookup finds fewer); the text is the same either way (greedy); out of range is a 400."""
    kw = dict(prompt="abc abc abc abc abc abc", **{**GREEDY, "max_tokens": 24})
    off = client.completions.create(**kw, extra_body={"num_speculative_tokens": 0})
    three = client.completions.create(**kw, extra_body={"num_speculative_tokens": 3})
    assert off.choices[0].text == three.choices[0].text
    assert off.model_extra["metrics"]["speculative_decoding"]["num_drafts"] == 0
    spec = three.model_extra["metrics"]["speculative_decoding"]
    assert 0 < spec["num_drafts"] and spec["num_draft_tokens"] <= 3 * spec["num_drafts"]  # n-gram: up to K a step
    with pytest.raises(openai.BadRequestError):
        client.completions.create(**kw, extra_body={"num_speculative_tokens": 17})


def test_chat_logprobs_whole_and_streamed(client, llm):
    """logprobs + top_logprobs: one entry a token of the message (the target's own numbers, as LLM.generate reports
    them), its alternatives likeliest first; the streamed chunks' entries add up to the whole one's."""
    from verispec import SamplingParams

    out = client.chat.completions.create(messages=CHAT, logprobs=True, top_logprobs=3, **GREEDY)
    content = out.choices[0].logprobs.content
    want = llm.generate(CHAT, SamplingParams(max_new_tokens=12, logprobs=3))
    assert len(content) == out.usage.completion_tokens == len(want.logprobs)
    assert [c.logprob for c in content] == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-4)
    for c in content:  # greedy: each token is its row's likeliest
        assert len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token and c.logprob <= 0
        assert c.bytes == list(c.token.encode()) and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
    chunks = list(client.chat.completions.create(messages=CHAT, logprobs=True, top_logprobs=3, stream=True, **GREEDY))
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    # the same tokens; their numbers to float rounding: the second request's rows may come from forwards of other
    # sizes (its prompt's cached blocks, the batch it shares)
    assert [c.token for c in streamed] == [c.token for c in content]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], rel=1e-5, abs=1e-6)
    plain = client.chat.completions.create(messages=CHAT, **GREEDY)
    assert plain.choices[0].logprobs is None  # not asked, none given


def test_completion_logprobs_whole_and_streamed(client):
    out = client.completions.create(prompt="Once upon a time", logprobs=2, **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 12
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert all(len(top) <= 2 and max(top.values()) == pytest.approx(v) for top, v in zip(lp.top_logprobs,
                                                                                          lp.token_logprobs))
    chunks = list(client.completions.create(prompt="Once upon a time", logprobs=2, stream=True, **GREEDY))
    assert [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens] == lp.tokens
    assert [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs] == \
        pytest.approx(lp.token_logprobs, rel=1e-5, abs=1e-6)  # float rounding: test_chat_logprobs_whole_and_streamed
    assert [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset] == lp.text_offset


def test_logit_bias_and_penalties_as_the_python_api_applies_them(client, llm):
    """logit_bias, presence / frequency / repetition penalties and min_p reach the sampler: a greedy request with
    them (speculating: the server's n-gram drafts) gives the plain-decoding output of LLM.generate with the same
    processors, and a bias of -100 on the first plain token moves it."""
    from verispec import SamplingParams

    plain = llm.generate("Once upon a time", SamplingParams(max_new_tokens=12))
    ban = {str(plain.token_ids[0]): -100}
    out = client.completions.create(prompt="Once upon a time", logit_bias=ban, **GREEDY)
    want = llm.generate("Once upon a time", SamplingParams(max_new_tokens=12, logit_bias={plain.token_ids[0]: -100}))
    assert out.choices[0].text == want.text and want.token_ids[0] != plain.token_ids[0]
    extra = dict(presence_penalty=1.5, frequency_penalty=0.8)
    out = client.completions.create(prompt="abc abc abc abc", extra_body={"repetition_penalty": 1.3, "min_p": 0.1},
                                    **extra, **GREEDY)
    want = llm.generate("abc abc abc abc",
                        SamplingParams(max_new_tokens=12, repetition_penalty=1.3, min_p=0.1, **extra))
    assert out.choices[0].text == want.text
    assert want.text != llm.generate("abc abc abc abc", SamplingParams(max_new_tokens=12)).text  # they changed it
