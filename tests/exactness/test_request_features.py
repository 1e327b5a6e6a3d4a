"""What a request may ask for beyond temperature / top-k / top-p, exact under speculation on native weights.

Log-probabilities (SamplingParams(logprobs=N)) come from the target's own row for each committed token, so they do
not depend on what drafted: every drafter's greedy output reports the same bits as plain decoding, and a sampled
output's values are those of the target's forward over that output. Logit bias, penalties and min-p are processors
of each row given its own prefix (drafts before it included): greedy output with them is plain decoding's with them,
token for token, whatever drafted (their sampled law: test_processor_distribution.py)."""

from __future__ import annotations

import pytest
import torch

from test_native_exactness import DIMS, ggufs  # noqa: F401 - the tiny native GGUF target and drafts (a fixture)
from verispec import LLM, SamplingParams, kernels
from verispec.engine import Capture, Engine

pytestmark = pytest.mark.skipif(not kernels.available(), reason="C++ kernels not built")
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], list(b"Hello, world. Hello, world!")]
METHODS = [("draft", "same", 4), ("draft", "other", 4), ("draft", "near", 2), ("ngram", "same", 4),
           ("auto", "other", 4)]


@pytest.fixture(scope="module")
def llms(ggufs):  # noqa: F811
    return {d: LLM(target=str(ggufs["target"]), draft=str(ggufs["target" if d == "same" else d]), dtype="bfloat16",
                   weights="native", draft_weights="native", progress=False) for d in ("same", "near", "other")}


@pytest.mark.parametrize("method,draft,K", METHODS)
def test_greedy_logprobs_are_bitwise_those_of_plain_decoding(llms, method, draft, K):
    llm, accepted = llms[draft], 0
    for prompt in PROMPTS:
        params = SamplingParams(max_new_tokens=24, ignore_eos=True, logprobs=5)
        want = llm.generate(prompt, params)
        got = llm.generate(prompt, params, method=method, num_draft_tokens=K)
        assert got.token_ids == want.token_ids
        assert got.stats["drafted_tokens"] > 0  # verify passes ran: their rows chose these tokens
        accepted += got.stats["accepted_tokens"]
        assert len(got.logprobs) == len(got.token_ids) and got.logprobs == want.logprobs  # floats: bitwise
        for lp, token in zip(got.logprobs, got.token_ids):  # greedy: the token is its row's argmax (the right row)
            assert lp.token == token and lp.top[0] == (token, lp.logprob) and len(lp.top) == 5
            assert lp.logprob <= 0 and [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
    assert accepted > 0 or draft == "other"  # accepted drafts' rows too (an unrelated draft: recovered tokens only)


def forward_logprobs(llm, prompt: list[int], out: list[int]) -> torch.Tensor:
    """The target's log-probability of each output token from one engine prefill over prompt + output (every row's
    full distribution kept by a capture; a row's numbers do not depend on the forward's other rows)."""
    V = llm.target.config.vocab_size
    eng = Engine(llm.target.model, num_blocks=64, block_size=16, chunk_size=512, logit_mask=llm.logit_mask)
    req = eng.add(prompt + out, SamplingParams(max_new_tokens=1), capture=Capture((), topk=V))
    while eng.has_work:
        eng.step()
    at = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(out))  # the row before each output token
    ids, lp = req.topk_ids[at].long(), req.topk_logp[at].float()  # [n, V] each, every token of the row
    return lp.gather(1, (ids == torch.tensor(out)[:, None]).float().argmax(1, keepdim=True))[:, 0]


@pytest.mark.parametrize("method,draft,K", [("draft", "other", 4), ("ngram", "same", 3)])
def test_sampled_logprobs_are_the_targets_for_the_sampled_tokens(llms, method, draft, K):
    """T = 0.9 with top-p: still the model's own log-probabilities (before temperature), each from the row that
    chose the token."""
    llm = llms[draft]
    for seed in range(3):
        params = SamplingParams(max_new_tokens=20, temperature=0.9, top_p=0.95, seed=seed, logprobs=0,
                                ignore_eos=True)
        out = llm.generate(PROMPTS[1], params, method=method, num_draft_tokens=K)
        assert [lp.token for lp in out.logprobs] == out.token_ids and all(lp.top == () for lp in out.logprobs)
        want = forward_logprobs(llm, PROMPTS[1], out.token_ids)
        got = torch.tensor([lp.logprob for lp in out.logprobs])
        torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)  # the reference is stored as float16


def test_without_logprobs_none_are_kept_and_a_stop_string_trims_them_with_the_tokens(llms, tiny_dirs):
    out = llms["same"].generate(PROMPTS[0], SamplingParams(max_new_tokens=8), method="draft", num_draft_tokens=4)
    assert out.logprobs is None
    llm = LLM(target=str(tiny_dirs["qwen2"]), dtype="float32", progress=False)  # a tokenizer with text
    full = llm.generate("Hello, world", SamplingParams(max_new_tokens=24, ignore_eos=True, logprobs=2))
    text = full.text  # a stop string first met mid-way
    stop = next(text[i:i + 2] for i in range(len(text) // 3, len(text) - 2) if text.find(text[i:i + 2]) == i)
    cut = llm.generate("Hello, world", SamplingParams(max_new_tokens=24, ignore_eos=True, logprobs=2, stop=(stop,)),
                       method="ngram", num_draft_tokens=3)
    assert cut.finish_reason == "stop" and len(cut.token_ids) < len(full.token_ids)
    assert [lp.token for lp in cut.logprobs] == cut.token_ids == full.token_ids[:len(cut.token_ids)]
    with pytest.raises(Exception, match="logprobs must be an integer in 0..20"):
        SamplingParams(logprobs=21)


PROCESSORS = [dict(logit_bias={7: -100, 40: 5.0}), dict(presence_penalty=1.2, frequency_penalty=0.7),
              dict(repetition_penalty=1.4), dict(min_p=0.2, presence_penalty=-0.5)]


@pytest.mark.parametrize("method,draft,K", METHODS)
@pytest.mark.parametrize("kw", PROCESSORS, ids=lambda kw: "-".join(kw))
def test_greedy_with_processors_is_plain_decoding_with_them(llms, method, draft, K, kw):
    llm = llms[draft]
    changed, drafted = False, 0
    for prompt in PROMPTS:
        params = SamplingParams(max_new_tokens=24, ignore_eos=True, logprobs=1, **kw)
        want = llm.generate(prompt, params)
        got = llm.generate(prompt, params, method=method, num_draft_tokens=K)
        assert got.token_ids == want.token_ids and got.logprobs == want.logprobs
        drafted += got.stats["drafted_tokens"]
        changed |= want.token_ids != llm.generate(prompt, SamplingParams(max_new_tokens=24, ignore_eos=True)).token_ids
    assert changed or "min_p" in kw  # the processors changed the text (min-p leaves greedy decoding alone)
    assert drafted > 0  # verify passes ran
