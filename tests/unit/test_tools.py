"""Tool calling (tools.py): a request's tools checked in one line naming the field, the forced call's grammar (every
sentence one call, or more with parallel calls, arguments matching the schema), the model's ``<tool_call>`` blocks
parsed into OpenAI calls whole and in any split of the text, and conversations with tool calls and results through
the chat template."""

from __future__ import annotations

import json

import pytest
import torch

from tiny import EOS_ID, VOCAB, byte_tokenizer
from verispec import ConfigError, SamplingParams
from verispec.errors import VerispecError
from verispec.sampling import Grammars
from verispec.tokenizer import Codec
from verispec.tools import Tools, template_message

WEATHER = {"type": "function", "function": {"name": "weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
    "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "time"}}  # no parameters: any object
CALL = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def grammars():
    return Grammars(byte_tokenizer(), VOCAB, (EOS_ID,))


def matches(grammars, tools: Tools, text: str) -> bool:
    """The forced grammar accepts ``text`` whole (EOS may follow it)."""
    m = grammars.mask(tools.grammar(grammars.literal), 0)
    ids = list(text.encode())
    for i, t in enumerate(ids):
        if not m.allowed(ids[:i])[t]:
            return False
    return bool(m.allowed(ids)[EOS_ID])


# -- checks --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tools,choice,match", [
    ([], "auto", r"^tools: a list of 1 to 128"),
    ([{"type": "retrieval"}], "auto", r"^tools\.0: expected"),
    ([{"type": "function", "function": {"name": "a b"}}], "auto", r"^tools\.0\.function\.name: 1 to 64"),
    ([TIME, TIME], "auto", r"^tools\.1\.function\.name: 'time' is given twice"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}], "auto",
     r"^tools\.0\.function\.parameters: invalid JSON schema"),
    ([WEATHER], "sometimes", r"^tool_choice: "),
    ([WEATHER], {"type": "function", "function": {"name": "time"}}, r"^tool_choice: the function 'time' is not"),
])
def test_bad_tools_are_one_line_naming_the_field(tools, choice, match):
    with pytest.raises(ConfigError, match=match):
        Tools(tools, choice)


def test_what_each_choice_asks_for(grammars):
    auto, none = Tools([WEATHER, TIME]), Tools([WEATHER, TIME], "none")
    assert auto.template_tools() == [WEATHER, TIME] and none.template_tools() is None
    assert auto.grammar() is None and none.grammar() is None and not auto.forced
    named = Tools([WEATHER, TIME], {"type": "function", "function": {"name": "time"}})
    assert named.forced and named.named == "time" and Tools([WEATHER], "required").forced
    assert grammars.literal("<tool_call>") == '"<tool_call>"'  # the byte tokenizer has no such token


# -- the forced call's grammar ---------------------------------------------------------------------------------------


def test_required_grammar_takes_calls_of_the_tools_with_valid_arguments(grammars):
    tools = Tools([WEATHER, TIME], "required")
    assert matches(grammars, tools, CALL)
    assert matches(grammars, tools, '<tool_call>\n{"name": "time", "arguments": {"zone": 2}}\n</tool_call>')
    assert matches(grammars, tools, CALL + "\n" + CALL)  # parallel calls
    assert not matches(grammars, tools, "")  # a call is required
    assert not matches(grammars, tools, CALL.replace("Paris", "Oslo"))  # not in the enum
    assert not matches(grammars, tools, CALL.replace("weather", "rain"))  # no such function
    assert not matches(grammars, tools, "Sure. " + CALL)  # nothing but calls
    assert not matches(grammars, tools, CALL.replace('", "', '","'))  # the template's separators, exactly
    assert not matches(grammars, Tools([WEATHER, TIME], "required", parallel=False), CALL + "\n" + CALL)


def test_named_grammar_takes_that_function_only(grammars):
    tools = Tools([WEATHER, TIME], {"type": "function", "function": {"name": "weather"}})
    assert matches(grammars, tools, CALL)
    assert not matches(grammars, tools, '<tool_call>\n{"name": "time", "arguments": {}}\n</tool_call>')


def test_the_grammar_goes_into_sampling_params_and_refuses_a_second_constraint(grammars):
    grammar = Tools([WEATHER], "required").grammar(grammars.literal)
    assert SamplingParams(grammar=grammar).constraint == grammar
    with pytest.raises(ConfigError, match="^grammar: not with a response_format"):
        SamplingParams(grammar=grammar, response_format={"type": "json_object"})
    with pytest.raises(ConfigError, match="^grammar: .*unknown name"):
        SamplingParams(grammar="start: nothing_here")


# -- parsing ---------------------------------------------------------------------------------------------------------


def test_parse_whole_answers():
    tools = Tools([WEATHER, TIME])
    content, calls = tools.parse(CALL)
    assert content is None and len(calls) == 1
    call = calls[0]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "weather", "arguments": '{"city": "Paris"}'}
    content, calls = tools.parse("Let me look.\n" + CALL + "\n" + CALL.replace("Paris", "Rome"))
    assert content == "Let me look." and [json.loads(c["function"]["arguments"])["city"] for c in calls] == [
        "Paris", "Rome"]
    assert len({c["id"] for c in calls}) == 2
    assert tools.parse("No tools needed.") == ("No tools needed.", [])


@pytest.mark.parametrize("text", [
    "<tool_call>\nnot json\n</tool_call>",
    '<tool_call>\n{"name": "rain", "arguments": {}}\n</tool_call>',  # not one of the tools
    '<tool_call>\n{"name": "time", "arguments": [1]}\n</tool_call>',  # arguments not an object
    "a < b, and <tool_c is not a tag",
])
def test_what_is_not_a_call_stays_content_verbatim(text):
    assert Tools([WEATHER, TIME]).parse(text) == (text, [])


def test_a_block_left_open_is_a_call_if_its_json_is_whole():
    tools = Tools([WEATHER])
    assert tools.parse(CALL.removesuffix("\n</tool_call>"))[1][0]["function"]["name"] == "weather"
    cut = CALL[:30]
    assert tools.parse(cut) == (cut, [])


def test_without_parallel_calls_only_the_first_block_is_a_call():
    content, calls = Tools([WEATHER], parallel=False).parse(CALL + "\n" + CALL)
    assert len(calls) == 1 and content == CALL


@pytest.mark.parametrize("cut", [1, 3, 7, 11, 12, 40, 60, 75])
def test_streamed_in_any_split_the_parser_gives_the_whole_answers_calls(cut):
    text = "Checking: " + CALL + "\n" + CALL.replace("Paris", "Rome") + " done"
    parser = Tools([WEATHER]).parser()
    content, calls = [], []
    for i in range(0, len(text), cut):
        c, k = parser.feed(text[i:i + cut])
        assert "<" not in c  # a partial <tool_call> is held back, never given out as content
        content.append(c)
        calls += k
    c, k = parser.close()
    content.append(c)
    calls += k
    assert "".join(content) == "Checking: \n done"
    assert [c["function"]["arguments"] for c in calls] == ['{"city": "Paris"}', '{"city": "Rome"}']


# -- conversations ---------------------------------------------------------------------------------------------------


def test_a_conversation_with_calls_and_results_goes_through_the_template():
    codec = Codec(byte_tokenizer(), VOCAB)
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Rome"}'}}
    messages = [{"role": "user", "content": "Rome?"},
                template_message({"role": "assistant", "content": "", "tool_calls": [call]}),
                {"role": "tool", "content": "18C", "tool_call_id": "call_1"}]
    text = codec.decode(codec.encode(messages, tools=[WEATHER]))
    assert "<tools> weather</tools>" in text
    assert '<tool_call>\n{"name": "weather", "arguments": {"city": "Rome"}}\n</tool_call>' in text
    assert text.endswith("<|start|>tool\n18C<|end|>\n<|start|>assistant\n")
    with pytest.raises(VerispecError, match="tools need a conversation"):
        codec.encode("hi", tools=[WEATHER])
    with pytest.raises(ConfigError, match=r"tool_calls\.0\.function\.arguments must be a JSON object"):
        template_message({"role": "assistant", "content": "",
                          "tool_calls": [{**call, "function": {"name": "weather", "arguments": "[1]"}}]})
    with pytest.raises(VerispecError, match="unexpected key 'tool_calls' in a user message"):
        codec.encode([{"role": "user", "content": "x", "tool_calls": []}])


def test_a_forced_call_under_the_grammar_is_what_the_mask_allows(grammars):
    """The mask of the first position after a required choice: only the opening of a block."""
    m = grammars.mask(Tools([WEATHER], "required").grammar(grammars.literal), 0)
    assert torch.nonzero(m.allowed([])).flatten().tolist() == [ord("<")]
