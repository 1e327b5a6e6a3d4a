"""Tools through the server with the official client: forced calls (named, required) come back as ``tool_calls``
with ``finish_reason: "tool_calls"``, arguments matching the function's schema, whole and streamed (OpenAI's
tool-call deltas), equal to the Python API and to plain decoding (``num_speculative_tokens: 0``); conversations with
tool calls and tool results are served; ``tool_choice: "none"`` leaves the tools out of the prompt; bad tools are
400s naming the field, and the server keeps serving."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from conftest import API_KEY, MODEL
from verispec import SamplingParams
from verispec.tools import Tools

AUTH = {"Authorization": f"Bearer {API_KEY}"}
ARGS = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer",
                                                                                        "minimum": 1, "maximum": 9}},
        "required": ["city", "days"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": ARGS}}
TIME = {"type": "function", "function": {"name": "time", "parameters": {"type": "object", "properties": {},
                                                                      "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
CHAT = [{"role": "user", "content": "Rome?"}]
NAMED = {"type": "function", "function": {"name": "weather"}}


def check_call(call, name: str | None = None) -> dict:
    """A call in OpenAI's shape, of a known function, its arguments matching the schema -> the arguments."""
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in ("weather", "time") and (name is None or call.function.name == name)
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, ARGS if call.function.name == "weather" else TIME["function"]["parameters"])
    return arguments


def test_a_named_choice_is_a_call_of_that_function(client, llm):
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS, tool_choice=NAMED, max_tokens=100,
                                           temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    arguments = check_call(choice.message.tool_calls[0], "weather")
    want = llm.generate(CHAT, SamplingParams(max_new_tokens=100), tools=Tools(TOOLS, NAMED))
    assert [json.loads(c["function"]["arguments"]) for c in want.tool_calls] == [arguments]


def test_required_sampled_calls_all_match_their_schemas(client):
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=100, temperature=1.0, seed=5, n=6)
    assert len(reply.choices) == 6
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls", choice
        assert len(choice.message.tool_calls) == 1
        check_call(choice.message.tool_calls[0])


def test_speculation_changes_no_token_of_a_forced_call(base_url, fixed_k):
    def ask(k):
        body = {"model": MODEL, "messages": CHAT, "tools": TOOLS, "tool_choice": "required", "max_tokens": 100,
                "temperature": 0, "num_speculative_tokens": k, "logprobs": True}
        r = httpx.post(f"{base_url}/v1/chat/completions", json=body, headers=AUTH, timeout=60)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        calls = [c["function"] for c in choice["message"]["tool_calls"]]
        return calls, [(t["token"], t["logprob"]) for t in choice["logprobs"]["content"]], r.json()["metrics"]

    plain, spec = ask(0), ask(4)
    assert spec[0] == plain[0]  # the calls, token for token; log-probabilities to float32 rounding (bitwise on
    assert [t for t, _ in spec[1]] == [t for t, _ in plain[1]]  # native weights: tests/exactness)
    assert [lp for _, lp in spec[1]] == pytest.approx([lp for _, lp in plain[1]], abs=1e-4)
    assert spec[2]["speculative_decoding"]["num_draft_tokens"] > 0


def test_a_streamed_call_arrives_as_tool_call_deltas(client):
    kwargs = dict(model=MODEL, messages=CHAT, tools=TOOLS, tool_choice=NAMED, max_tokens=100, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls[0]
    chunks = [c for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks).strip()  # nothing but the call
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or ()]
    assert [d.index for d in deltas] == [0]
    assert (deltas[0].function.name, deltas[0].function.arguments) == (whole.function.name, whole.function.arguments)
    assert deltas[0].id.startswith("call_") and deltas[0].type == "function"


def test_auto_without_a_call_is_plain_content(client, llm):
    """A random model writes no ``<tool_call>`` block: the answer is content, as from the Python API with the tools
    in the prompt."""
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS, max_tokens=24, temperature=0)
    choice = reply.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length")
    want = llm.generate(CHAT, SamplingParams(max_new_tokens=24), tools=Tools(TOOLS))
    assert choice.message.content == want.text and want.tool_calls == []


def test_tool_choice_none_leaves_the_tools_out(client):
    kwargs = dict(model=MODEL, messages=CHAT, max_tokens=16, temperature=0)
    with_none = client.chat.completions.create(**kwargs, tools=TOOLS, tool_choice="none")
    without = client.chat.completions.create(**kwargs)
    assert with_none.choices[0].message.content == without.choices[0].message.content
    assert with_none.usage.prompt_tokens == without.usage.prompt_tokens


def test_a_conversation_with_a_call_and_its_result_is_answered(client):
    first = client.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS, tool_choice=NAMED,
                                           max_tokens=100, temperature=0).choices[0].message
    call = first.tool_calls[0]
    messages = [*CHAT, first.model_dump(exclude_none=True),  # the assistant's message as the client returns it
                {"role": "tool", "tool_call_id": call.id, "content": "18C"}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=8, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert reply.usage.prompt_tokens > len("<tool_call>") + len(call.function.arguments)


def bad(name: str, **fields):
    return pytest.param(fields, id=name)


@pytest.mark.parametrize("fields,param", [
    (dict(tools=[{"type": "function", "function": {"name": "two words"}}]), "tools"),
    (dict(tools=[TIME, TIME]), "tools"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}]), "tools"),
    (dict(tools=[{"type": "code_interpreter"}]), "tools"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "rain"}}), "tool_choice"),
    (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "tool_choice"),
    (dict(tools=TOOLS, parallel_tool_calls="yes"), "parallel_tool_calls"),
    (dict(messages=[{"role": "tool", "content": "18C"}]), "messages"),
    (dict(messages=[{"role": "user", "content": "x", "tool_call_id": "c"}]), "messages"),
    (dict(messages=[{"role": "user", "content": None}]), "messages"),
    (dict(messages=[*CHAT, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "time", "arguments": "[1]"}}]},
        {"role": "tool", "tool_call_id": "c", "content": "1"}]), "messages"),
], ids=["bad-name", "twice", "bad-schema", "not-a-function", "named-unknown", "bad-choice", "choice-without-tools",
        "with-response-format", "parallel-not-bool", "tool-without-id", "id-on-user", "null-user-content",
        "arguments-not-object"])
def test_bad_tools_are_400s_naming_the_field(base_url, fields, param):
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 4, **fields}
    r = httpx.post(f"{base_url}/v1/chat/completions", json=body, headers=AUTH, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and "\n" not in error["message"]
    ok = httpx.post(f"{base_url}/v1/chat/completions", headers=AUTH, timeout=30,
                    json={"model": MODEL, "messages": CHAT, "max_tokens": 2})
    assert ok.status_code == 200
