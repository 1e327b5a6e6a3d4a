"""``response_format`` through the server: json_object and json_schema answers parse and match, whole and streamed,
with the official client, equal to ``LLM.generate`` with the same format; bad formats are 400s naming the field."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from conftest import API_KEY, MODEL
from verispec import SamplingParams

AUTH = {"Authorization": f"Bearer {API_KEY}"}
SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tag": {"enum": ["red", "blue"]}},
          "required": ["id", "tag"], "additionalProperties": False,
          "x-guidance": {"whitespace_flexible": False}}  # compact: a random model's answer stays short
FORMAT = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA, "strict": True}}
CHAT = [{"role": "user", "content": "A record, please."}]


def test_json_schema_answers_match_the_schema(client):
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=64, temperature=1.0, seed=3, n=4,
                                           response_format=FORMAT)
    assert len(reply.choices) == 4
    for choice in reply.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_streamed_json_schema_answer_matches_and_equals_the_python_api(client, llm):
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=64, temperature=0,
                                            response_format=FORMAT, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)
    want = llm.generate(CHAT, SamplingParams(max_new_tokens=64, response_format=FORMAT), chat=True)
    assert text == want.text


def test_json_object_answer_is_an_object(client):
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=96, temperature=0,
                                           response_format={"type": "json_object"})
    choice = reply.choices[0]
    if choice.finish_reason == "stop":  # a random model may still be inside its object at max_tokens
        assert isinstance(json.loads(choice.message.content), dict)
    else:
        assert choice.message.content.lstrip().startswith("{")


@pytest.mark.parametrize("response_format", [
    {"type": "xml"},
    {"type": "json_schema"},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": "yes"}},
])
def test_bad_formats_are_400s_naming_the_field(base_url, response_format):
    r = httpx.post(f"{base_url}/v1/chat/completions", headers=AUTH, timeout=30,
                   json={"model": MODEL, "messages": CHAT, "max_tokens": 4, "response_format": response_format})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "response_format" and "\n" not in error["message"], error
