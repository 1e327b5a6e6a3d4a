"""The response format's grammar mask (sampling/grammar.py) on the tiny byte tokenizer, where one token is one byte so
every mask can be written by hand: what may follow a prefix, EOS alone once the output is complete (or past an EOS or
a refused token), the matcher rolled back to any earlier or other prefix giving exactly the mask computed from
scratch, and a bad response format refused in one line."""

from __future__ import annotations

import random

import pytest
import torch

from tiny import EOS_ID, VOCAB, byte_tokenizer
from verispec import ConfigError, SamplingParams
from verispec.sampling import Grammars, GrammarMask, Prefix, ProcessorChain

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
          "required": ["a"], "additionalProperties": False}
COMPACT = {**SCHEMA, "x-guidance": {"whitespace_flexible": False}}
WS = set(" \t\n\r")
PROMPT = [5, 6, 7]
END = 258  # the tokenizer's <|endoftext|>: a second EOS id


@pytest.fixture(scope="module")
def grammars():
    return Grammars(byte_tokenizer(), VOCAB, (EOS_ID, END))


def fmt(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}}


def mask(grammars, schema=SCHEMA) -> GrammarMask:
    return grammars.mask(schema, len(PROMPT))


def allowed(m: GrammarMask, text: bytes | list[int]) -> set:
    """What may follow the output ``text``: characters for bytes, ids for the specials."""
    ids = torch.nonzero(m.allowed(list(text))).flatten().tolist()
    return {chr(i) if i < 256 else i for i in ids}


def test_masks_by_hand(grammars):
    m = mask(grammars)
    assert allowed(m, b"") == {"{"}  # (the grammar's own leading whitespace aside: none)
    assert allowed(m, b"{") == WS | {'"'}  # "a" is required: no "}" yet
    assert allowed(m, b'{"a":') == WS | set("-0123456789")  # an integer, after optional whitespace
    assert allowed(m, b'{"a":12') == WS | set("0123456789,}")
    assert allowed(m, b'{"a":12,"b":') == WS | set("tf")
    assert allowed(m, b'{"a":12,"b":t') == {"r"}
    assert allowed(m, b'{"a":12,"b":true}') == {EOS_ID, END}  # complete: EOS alone (every EOS id)
    c = mask(grammars, COMPACT)
    assert allowed(c, b"{") == {'"'} and allowed(c, b'{"a":12') == set("0123456789,}")


def test_a_minus_takes_any_digit(grammars):
    """JSON's number grammar: '-0' is a number too."""
    assert allowed(mask(grammars), b'{"a": -') == set("0123456789")


def test_complete_eos_and_refused_tokens_leave_eos_only(grammars):
    m = mask(grammars)
    done = b'{"a":1}'
    assert allowed(m, done) == {EOS_ID, END}
    assert allowed(m, [*done, EOS_ID]) == {EOS_ID, END}  # past an EOS (ignore_eos, or a draft after one)
    assert allowed(m, [*done, EOS_ID, *b"xyz"]) == {EOS_ID, END}
    assert allowed(m, b'{"a":1x') == {EOS_ID, END}  # a refused token (a rejected draft): never an exception
    assert allowed(m, b'{"a":1x}}}') == {EOS_ID, END}  # ... nor anything after it
    assert allowed(m, b'{"a":1') == WS | set("0123456789,}")  # and the matcher is still right after it
    assert allowed(m, b"}") == {EOS_ID, END}  # refused at the first token
    assert allowed(m, b"") == {"{"}


def test_rollback_gives_the_mask_computed_from_scratch(grammars):
    """One matcher asked about many prefixes in any order (longer, shorter, branching, with refused tokens) answers
    each exactly as a fresh matcher does."""
    rng = random.Random(0)
    m = mask(grammars)
    walks = []
    for _ in range(6):  # valid outputs: each token drawn among the allowed ones, a refused one now and then
        out, fresh = [], mask(grammars)
        for _ in range(rng.randint(3, 20)):
            ok = torch.nonzero(fresh.allowed(out)).flatten().tolist()
            out.append(rng.randrange(256) if rng.random() < 0.1 else rng.choice(ok))
        walks.append(out)
    queries = [w[:rng.randint(0, len(w))] for w in walks for _ in range(8)]
    rng.shuffle(queries)
    for q in queries:
        assert torch.equal(m.allowed(q), mask(grammars).allowed(q)), bytes(t for t in q if t < 256)


def test_the_chain_masks_each_row_by_its_own_prefix(grammars):
    """Through ProcessorChain, as the verifier calls it: row i's prefix is the context plus drafts[:i]; forbidden
    tokens get -inf, allowed ones keep their logit, padding rows stay masked."""
    params = SamplingParams(temperature=1.0, response_format=fmt(SCHEMA))
    pad = torch.zeros(VOCAB, dtype=torch.bool)
    pad[259:] = True
    chain = ProcessorChain.from_params(params, pad, prompt_len=len(PROMPT), grammars=grammars)
    drafts = torch.tensor(list(b'{"a":1'))
    logits = torch.randn(len(drafts) + 1, VOCAB, generator=torch.Generator().manual_seed(0))  # [K + 1, V]
    out = chain.logits([Prefix(PROMPT, drafts[:i]) for i in range(len(drafts) + 1)], logits)
    for i in range(len(drafts) + 1):
        want = mask(grammars).allowed(drafts[:i].tolist())
        assert torch.equal(torch.isfinite(out[i]), want)
        assert torch.equal(out[i][want], logits[i][want])
    probs = chain.probs([Prefix(PROMPT, drafts[:i]) for i in range(len(drafts) + 1)], logits)
    assert torch.allclose(probs.sum(-1), torch.ones(len(drafts) + 1)) and not probs[:, 259:].any()


def test_json_object_mode(grammars):
    params = SamplingParams(response_format={"type": "json_object"})
    assert params.response_schema == {"type": "object"}
    m = grammars.mask(params.response_schema, 0)
    assert allowed(m, b"") == {"{"} and allowed(m, b"{") == WS | {'"', "}"}
    assert allowed(m, b'{"x": [1, {"y": null}]}') == {EOS_ID, END}


def test_response_format_is_checked_in_one_line():
    assert SamplingParams(response_format={"type": "text"}).response_format is None
    p = SamplingParams(response_format=fmt(SCHEMA))
    assert p == SamplingParams(response_format=p.response_format) and hash(p)  # kept as JSON text: hashable
    assert p.response_schema == SCHEMA
    for bad, match in [({"type": "xml"}, "response_format must be"),
                       ({"type": "json_schema"}, "response_format must be"),
                       (fmt({"type": "foo"}), "invalid JSON schema: .*foo"),
                       (fmt({"type": "object", "properties": {"a": {"$ref": "#/nope"}}}), "invalid JSON schema"),
                       (fmt({"type": "integer", "minimum": "x"}), "invalid JSON schema"),
                       ("{not json", "response_format is not JSON"), (["json_object"], "response_format must be"),
                       ({"type": "json_schema", "json_schema": {"name": 3, "schema": {}}}, "name must be a string")]:
        with pytest.raises(ConfigError, match=match) as e:
            SamplingParams(response_format=bad)
        assert "\n" not in str(e.value)


def test_a_chain_with_a_response_format_needs_the_grammars(grammars):
    params = SamplingParams(response_format={"type": "json_object"})
    with pytest.raises(ConfigError, match="needs the model's tokenizer"):
        ProcessorChain.from_params(params)
    with pytest.raises(ConfigError, match="needs the model's tokenizer"):
        Grammars(None, VOCAB, (EOS_ID,)).mask({"type": "object"}, 0)
    with pytest.raises(ConfigError, match="needs an EOS token"):
        Grammars(byte_tokenizer(), VOCAB, ()).mask({"type": "object"}, 0)
    chain = ProcessorChain.from_params(params, grammars=grammars)
    assert not chain.prefix_independent and isinstance(chain.processors[0], GrammarMask)
