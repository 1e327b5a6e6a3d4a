"""Structured output (SamplingParams.response_format, sampling/grammar.py) stays exact under speculative decoding.

A tiny float32 target with a real byte-level tokenizer (tests/tiny.py: one token per byte, so grammar masks are
byte sets) and a noisy copy of it as the draft model:

- greedy: every method gives plain decoding's tokens under the schema, token for token, and they are valid JSON;
- sampling (T = 1): two hundred outputs (every method) parse and match the schema (jsonschema), each ending in EOS;
- the law: with an enum schema the output is one of six strings, whose exact probabilities come from transformers'
  forward of the same weights and a mask written from the enum by hand (not from llguidance); speculative sampling
  (draft model, n-gram) matches it (chi-square), also when the draft's q ignores the grammar (rejection sampling
  corrects any q). Negative control that must fail: the verifier giving every row the mask of the committed prefix
  (the drafts before the row ignored) yields strings outside the enum.
"""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
import torch

import verispec.drafters.draft_model
import verispec.engine.engine
from exact_helpers import ALPHA, chi2_pvalue, variant_verify
from tiny import EOS_ID, make_hf_dir
from verispec import LLM, SamplingParams
from verispec.cli import main
from verispec.sampling import GrammarMask, ProcessorChain

SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 999},
    "ok": {"type": "boolean"},
    "tag": {"enum": ["red", "green", "blue"]},
    "name": {"type": "string", "maxLength": 4},
    "xs": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3}},
    "required": ["id", "ok", "tag", "name", "xs"], "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False}}  # compact JSON: a random model's output stays short
FORMAT = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA, "strict": True}}
PROMPTS = ["Record: ", 'Give {"id": 7, "ok": true, "tag": "red", "name": "ab", "xs": [1, 2]} or '
                       '{"id": 12, "ok": false, "tag": "blue", "name": "x", "xs": []}: ']
METHODS = [("draft", 4), ("draft", 2), ("ngram", 3), ("auto", 4)]
MAX_NEW = 96

ENUM = ["aab", "ab", "abba", "b", "ba", "bab"]  # a JSON string out of six: branches at every draft position
ENUM_FORMAT = {"type": "json_schema", "json_schema": {"name": "pick", "schema": {"enum": ENUM}}}
ENUM_PROMPT = 'pick one: "ab" "bab" "abba" "b" "aab" -> '
ENUM_LARK = "start: \"\\\"\" (" + " | ".join(f'"{v}"' for v in ENUM) + ") \"\\\"\"\n"  # the same six, as a grammar
CONSTRAINTS = {"schema": dict(response_format=ENUM_FORMAT), "lark": dict(grammar=ENUM_LARK)}
N_LAW = 500  # generations per positive case (~10 ms each)
N_NEG = 150


@pytest.fixture(scope="module")
def llm(tiny_dirs, tmp_path_factory):
    near = make_hf_dir(tmp_path_factory.mktemp("near") / "qwen2", "qwen2", 0, noise=0.01)
    return LLM(target=str(tiny_dirs["qwen2"]), draft=str(near), dtype="float32", draft_quant="none",
               progress=False)


def check(out) -> dict:
    """The output parses as JSON, matches the schema and ended with EOS; -> the value."""
    assert out.finish_reason == "eos" and out.token_ids[-1] == EOS_ID, out.text
    value = json.loads(out.text)
    jsonschema.validate(value, SCHEMA, cls=jsonschema.Draft202012Validator)
    return value


@pytest.mark.parametrize("method,K", METHODS)
def test_greedy_speculative_output_is_plain_decodings_under_the_schema(llm, method, K):
    drafted = 0
    for prompt in PROMPTS:
        params = SamplingParams(max_new_tokens=MAX_NEW, response_format=FORMAT)
        want = llm.generate(prompt, params)
        got = llm.generate(prompt, params, method=method, num_draft_tokens=K)
        assert got.token_ids == want.token_ids
        check(want)
        drafted += got.stats.get("drafted_tokens", 0)
        free = llm.generate(prompt, SamplingParams(max_new_tokens=len(want.token_ids)))
        assert free.token_ids != want.token_ids  # the mask changed what the model says
    assert drafted > 0 or method == "auto"  # verify passes ran (auto may judge drafting not worth it)


def test_two_hundred_sampled_outputs_match_the_schema(llm):
    values, accepted = [], 0
    for i in range(180):
        method, K = METHODS[i % len(METHODS)]
        params = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, seed=i, response_format=FORMAT)
        out = llm.generate(PROMPTS[i % 2], params, method=method, num_draft_tokens=K)
        values.append(check(out))
        accepted += out.stats.get("accepted_tokens", 0)
    for i in range(20):  # and plain sampling
        values.append(check(llm.generate(PROMPTS[i % 2], SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0,
                                                                        seed=1000 + i, response_format=FORMAT))))
    assert accepted > 0
    assert len({v["tag"] for v in values}) == 3 and len({v["id"] for v in values}) > 20  # really sampled


def test_json_object_mode(llm):
    for seed in range(10):
        out = llm.generate(PROMPTS[1], SamplingParams(max_new_tokens=12, temperature=1.0, seed=seed,
                                                      response_format={"type": "json_object"}),
                           method="draft", num_draft_tokens=4)
        assert out.text.startswith("{")  # a prefix of an object (12 tokens: rarely a whole one)
        if out.finish_reason == "eos":
            assert isinstance(json.loads(out.text), dict)


# ---------------------------------------------------------------------------------------------------------------------
# The law of the output under an enum schema, exactly
# ---------------------------------------------------------------------------------------------------------------------


def enum_next(prefix: str) -> set[str]:
    """By hand: what may follow the output ``prefix`` ('"' + letters ...) under ENUM, '' for EOS."""
    if prefix == "":
        return {'"'}
    body = prefix[1:]
    if body.endswith('"'):
        return {""}
    nxt = {v[len(body)] for v in ENUM if v.startswith(body) and len(v) > len(body)}
    return nxt | ({'"'} if body in ENUM else set())


@pytest.fixture(scope="module")
def exact_law(llm, tiny_dirs) -> np.ndarray:
    """P(output = '"v"' + EOS) for v in ENUM: each step's masked softmax of transformers' logits (T = 1)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_dirs["qwen2"]), dtype=torch.float32).eval()
    prompt = llm.codec.encode(ENUM_PROMPT)
    law = []
    for v in ENUM:
        text, p = f'"{v}"', 1.0
        for t in range(len(text) + 1):
            allowed = sorted(enum_next(text[:t]))
            ids = [EOS_ID if c == "" else ord(c) for c in allowed]
            chosen = EOS_ID if t == len(text) else ord(text[t])
            with torch.no_grad():
                logits = model(torch.tensor([prompt + [ord(c) for c in text[:t]]])).logits[0, -1].double()
            p *= float(torch.softmax(logits[ids], -1)[ids.index(chosen)])
        law.append(p)
    law = np.array(law)
    assert abs(law.sum() - 1) < 1e-9 and law.min() > 1e-3  # every cell reachable: a real test of each branch
    return law


def enum_counts(llm, method: str, n: int, seed: int, constraint: str = "schema") -> tuple[np.ndarray, int]:
    """n sampled outputs under ENUM_FORMAT (or ENUM_LARK) -> (counts per ENUM value, outputs outside it)."""
    counts, bad = np.zeros(len(ENUM), dtype=np.int64), 0
    for i in range(n):
        params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=seed + i, **CONSTRAINTS[constraint])
        out = llm.generate(ENUM_PROMPT, params, method=method, num_draft_tokens=4)
        try:
            counts[ENUM.index(json.loads(out.text))] += 1
        except ValueError:
            bad += 1
    return counts, bad


@pytest.mark.parametrize("constraint", sorted(CONSTRAINTS))
def test_the_hand_written_enum_mask_is_the_grammars(llm, constraint):
    """The exact law's masks are written by hand: llguidance's agree with them on every prefix, from the JSON schema
    and from the Lark grammar alike."""
    params = SamplingParams(**CONSTRAINTS[constraint])
    mask = llm.grammars.mask(params.constraint, 0)
    for v in ENUM:
        text = f'"{v}"'
        for t in range(len(text) + 1):
            got = {("" if i == EOS_ID else chr(i)) for i in torch.nonzero(mask.allowed(list(text[:t].encode())))
                   .flatten().tolist()}
            assert got == enum_next(text[:t]), text[:t]


@pytest.mark.parametrize("method,constraint", [("draft", "schema"), ("ngram", "schema"), ("draft", "lark")])
def test_speculative_sampling_under_a_grammar_is_ar_sampling(llm, exact_law, method, constraint):
    counts, bad = enum_counts(llm, method, N_LAW, seed=10_000, constraint=constraint)
    assert bad == 0
    p = chi2_pvalue(counts, exact_law)
    assert p > ALPHA, f"{method}: chi-square p = {p:.3g}, counts {counts.tolist()}, law {exact_law.round(3).tolist()}"


def test_a_draft_whose_q_ignores_the_grammar_is_still_exact(llm, exact_law, monkeypatch):
    """The draft model's q without the mask (drafts the grammar forbids get p = 0 and are rejected): the verifier
    corrects any q, so the law holds; only acceptance suffers."""
    def unmasked(request):
        chain = request.chain
        return ProcessorChain(chain.params, tuple(p for p in chain.processors if not isinstance(p, GrammarMask)))

    monkeypatch.setattr(verispec.drafters.draft_model, "chain_of", unmasked)
    counts, bad = enum_counts(llm, "draft", N_LAW // 2, seed=20_000)
    assert bad == 0
    p = chi2_pvalue(counts, exact_law)
    assert p > ALPHA, f"q without the mask: chi-square p = {p:.3g}, counts {counts.tolist()}"


@pytest.mark.parametrize("bug", [None, "committed_prefix_only"])
def test_negative_control_mask_of_the_committed_prefix_only_fails(llm, exact_law, monkeypatch, bug):
    """The copied verifier passes; the same one giving every verify row the committed prefix (the grammar mask of
    the first row for all) commits strings outside the enum, so the law test rejects it."""
    monkeypatch.setattr(verispec.engine.engine, "verify", variant_verify(bug))
    counts, bad = enum_counts(llm, "draft", N_NEG, seed=30_000)
    observed = np.append(counts, bad)
    p = chi2_pvalue(observed, np.append(exact_law, 0.0))
    if bug:
        assert bad > 0 and p < ALPHA, f"committed-prefix-only mask not detected: {bad} invalid, p = {p:.3g}"
    else:
        assert bad == 0 and p > ALPHA, f"the copied rule: {bad} invalid, p = {p:.3g}"


# ---------------------------------------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------------------------------------


def test_cli_json_schema_and_json_object(tiny_dirs, tmp_path, capsys):
    path = tmp_path / "record.json"
    path.write_text(json.dumps(SCHEMA))
    base = ["generate", PROMPTS[0], "--target", str(tiny_dirs["qwen2"]), "--dtype", "float32", "--method", "ngram",
            "--max-new-tokens", str(MAX_NEW), "--json"]
    assert main(base + ["--json-schema", str(path)]) == 0
    text = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["text"]
    jsonschema.validate(json.loads(text), SCHEMA)
    path.write_text(json.dumps({"name": "record", "schema": SCHEMA}))  # OpenAI's json_schema object works too
    assert main(base + ["--json-schema", str(path)]) == 0
    assert json.loads(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["text"]) == json.loads(text)
    assert main(base[:-2] + ["8", "--json-object", "--temperature", "1", "--seed", "1"]) == 0
    assert capsys.readouterr().out.startswith("{")


@pytest.mark.parametrize("content,match", [('{"type": "foo"}', "invalid JSON schema: Invalid type: foo"),
                                           ("{oops", "is not a JSON file"), ("[1]", "must hold a JSON object"),
                                           (None, "cannot read")])
def test_cli_bad_schema_file_is_one_line_and_exit_2(tmp_path, capsys, content, match):
    path = tmp_path / "schema.json"
    if content is not None:
        path.write_text(content)
    rc = main(["generate", "hi", "--target", str(tmp_path / "no-model"), "--json-schema", str(path)])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("verispec: error: ") and err.count("\n") == 1 and match in err, err
    assert main(["generate", "hi", "--json-object", "--json-schema", str(path)]) == 2  # one or the other
    assert "not allowed with" in capsys.readouterr().err
