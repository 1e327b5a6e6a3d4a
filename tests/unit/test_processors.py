"""The processor chain: the built-in transforms bitwise as before, each row's own prefix reaching every processor
(in plain decoding, in a draft and in each verify row), the prefix-independent fast path, and a temperature too
small for float arithmetic decoding greedily instead of failing on NaN.
"""

from __future__ import annotations

import pytest
import torch

from exact_helpers import BanLast
from verispec import LLM, SamplingParams
from verispec.sampling import (LogitsProcessor, Prefix, ProcessorChain, argmax, draw, logits_to_probs, next_token,
                               row_prefixes, sample)
from verispec.spec.verify import verify

PARAMS = [dict(temperature=0), dict(temperature=1.0), dict(temperature=0.7, top_k=5),
          dict(temperature=1.3, top_p=0.8), dict(temperature=0.9, top_k=20, top_p=0.95)]


class Recorder(LogitsProcessor):
    """Records the prefix of every row it is given; leaves the logits as they are."""

    def __init__(self):
        self.seen = []

    def __call__(self, prefix, logits):
        self.seen.append(list(prefix))
        return logits.clone()


class AllRows(LogitsProcessor):
    """A prefix-independent processor: records what it is called with, adds 1 to token 0."""

    prefix_independent = True

    def __init__(self):
        self.calls = []

    def __call__(self, prefix, logits):
        self.calls.append((prefix, tuple(logits.shape)))
        return logits.index_add(-1, torch.tensor([0]), torch.ones(*logits.shape[:-1], 1, dtype=logits.dtype))


@pytest.mark.parametrize("kw", PARAMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_chain_is_the_mask_then_logits_to_probs_bitwise(kw, dtype):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 4, 50, generator=g) * 3).to(dtype)
    mask = torch.zeros(50, dtype=torch.bool)
    mask[[7, 48, 49]] = True
    params = SamplingParams(**kw)
    want = logits_to_probs(logits.masked_fill(mask, float("-inf")), params)
    assert torch.equal(ProcessorChain.from_params(params, mask).probs(None, logits), want)
    assert torch.equal(ProcessorChain.from_params(params).probs(None, logits), logits_to_probs(logits, params))


@pytest.mark.parametrize("kw", PARAMS)
def test_draw_is_the_old_drafter_code_draw_for_draw(kw):
    """draw() is logits_to_probs + sample / argmax, as the drafters once wrote it: same tokens, same q, same
    generator state afterwards."""
    params = SamplingParams(**kw)
    logits = torch.randn(1, 40, generator=torch.Generator().manual_seed(1)) * 2
    g_old, g_new = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    for _ in range(20):
        probs = None if params.greedy else logits_to_probs(logits, params)
        old = argmax(logits) if probs is None else sample(probs, g_old)
        token, q = draw(logits, Prefix([1, 2]), ProcessorChain.from_params(params), g_new)
        assert torch.equal(token, old) and token.shape == (1,)
        assert (q is None) == (probs is None) and (q is None or torch.equal(q, probs))
    assert torch.equal(g_old.get_state(), g_new.get_state())


def test_prefix_is_context_plus_drafts_without_copies():
    context = [1, 2, 3]
    for drafts in (torch.tensor([4, 5]), [4, 5], [torch.tensor([4]), torch.tensor([5])]):
        p = Prefix(context, drafts)
        assert len(p) == 5 and list(p) == [1, 2, 3, 4, 5] and p[-1] == 5 and p[0] == 1 and p[-4] == 2
        assert p[1:4] == [2, 3, 4] and p[::-2] == [5, 3, 1] and 4 in p
        with pytest.raises(IndexError):
            p[5]
        with pytest.raises(IndexError):
            p[-6]
    assert p.context is context  # a view, not a copy
    assert list(Prefix([7])) == [7]
    rows = row_prefixes([[1], [2, 3]], torch.tensor([[4, 5], [6, 7]]))
    assert [list(r) for r in rows] == [[1], [1, 4], [1, 4, 5], [2, 3], [2, 3, 6], [2, 3, 6, 7]]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_verify_gives_row_i_the_context_and_the_drafts_before_it(temperature):
    rec = Recorder()
    chain = ProcessorChain.from_params(SamplingParams(temperature=temperature), extra=[rec])
    logits = torch.randn(2, 3, 10, generator=torch.Generator().manual_seed(2))  # [B, K+1, V]
    drafts = torch.tensor([[4, 5], [6, 7]])  # [B, K]
    g = None if chain.greedy else torch.Generator().manual_seed(0)
    verify(logits, drafts, None, chain, g, [[1, 2, 3], [8, 9]])
    assert rec.seen == [[1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4, 5], [8, 9], [8, 9, 6], [8, 9, 6, 7]]


def test_plain_decoding_and_drafts_give_the_processor_their_prefix():
    rec = Recorder()
    chain = ProcessorChain.from_params(SamplingParams(temperature=1.0), extra=[rec])
    draw(torch.zeros(1, 10), [1, 2], chain, torch.Generator().manual_seed(0))
    draw(torch.zeros(1, 10), Prefix([1, 2], [torch.tensor([3])]), chain, torch.Generator().manual_seed(0))
    assert rec.seen == [[1, 2], [1, 2, 3]]


def test_a_banned_token_follows_the_drafts_in_verify_as_in_plain_decoding():
    """Greedy, with BanLast: each row's own argmax is the token that ends its prefix, so each row must ban the
    right one. Verify accepts both drafts and adds the bonus; plain decoding, step by step, picks the same."""
    V, context = 8, [0, 5]
    logits = torch.zeros(1, 3, V)
    for i, (top, second) in enumerate([(5, 2), (2, 7), (7, 1)]):  # row i's top is the last token of its prefix
        logits[0, i, top], logits[0, i, second] = 3.0, 2.0
    chain = ProcessorChain.from_params(SamplingParams(temperature=0), extra=[BanLast()])
    v = verify(logits, torch.tensor([[2, 7]]), None, chain, None, [context])
    assert v.tokens.tolist() == [[2, 7, 1]] and v.num_accepted.tolist() == [2]
    ar = list(context)
    for i in range(3):
        ar.append(int(draw(logits[0, i:i + 1], ar, chain, None)[0]))
    assert ar[2:] == [2, 7, 1]
    # the committed context alone for every row (ignoring the drafts) bans 5 in row 1 too: x_2 = 7 is then
    # rejected for 2, a token that row may not repeat -- the bug the exactness test's negative control plants
    p = chain.probs([context] * 3, logits[0])
    assert p.argmax(-1).tolist() == [2, 2, 7]


def test_prefix_independent_processors_see_every_row_at_once_in_order():
    rows = AllRows()
    rec = Recorder()
    chain = ProcessorChain.from_params(SamplingParams(temperature=1.0), torch.zeros(6, dtype=torch.bool), [rows, rec])
    assert not chain.prefix_independent
    assert ProcessorChain.from_params(SamplingParams(), torch.zeros(6, dtype=torch.bool), [rows]).prefix_independent
    logits = torch.zeros(2, 3, 6)
    out = chain.logits(row_prefixes([[1], [2]], torch.tensor([[3, 4], [5, 6]])), logits)
    assert rows.calls == [(None, (2, 3, 6))]  # once, all rows, no prefix
    assert len(rec.seen) == 6 and out.shape == (2, 3, 6)
    assert torch.equal(out[..., 0], torch.ones(2, 3)) and not out[..., 1:].any()


def test_a_chain_that_reads_prefixes_needs_them():
    chain = ProcessorChain.from_params(SamplingParams(temperature=1.0), extra=[BanLast()])
    with pytest.raises(ValueError, match="prefix"):
        chain.probs(None, torch.zeros(2, 5))
    with pytest.raises(ValueError, match="prefixes for"):
        chain.probs([[1]], torch.zeros(2, 5))
    with pytest.raises(ValueError, match="prefix"):
        verify(torch.zeros(1, 2, 5), torch.tensor([[1]]), None, chain, torch.Generator(), None)


# ---------------------------------------------------------------------------------------------
# A temperature too small for float arithmetic is greedy (vLLM's rule: below 1e-5), never NaN
# ---------------------------------------------------------------------------------------------

TINY_T = [1e-40, 1e-30, 1e-6]


@pytest.mark.parametrize("t", TINY_T)
def test_tiny_temperature_is_greedy_and_kept(t):
    params = SamplingParams(temperature=t, seed=0)
    assert params.greedy and params.temperature == t
    assert not SamplingParams(temperature=1e-5).greedy and not SamplingParams(temperature=1e-3).greedy


@pytest.mark.parametrize("t", TINY_T)
def test_tiny_temperature_decodes_greedily_in_next_token_verify_and_a_draft(t):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 3, 30, generator=g) * 5  # [B, K+1, V]
    params, greedy = SamplingParams(temperature=t), SamplingParams(temperature=0)
    gen = torch.Generator().manual_seed(0)
    assert torch.equal(next_token(logits[:, 0], params, gen), argmax(logits[:, 0]))
    assert torch.equal(logits_to_probs(logits, params), logits_to_probs(logits, greedy))
    token, q = draw(logits[:1, 0], [1], ProcessorChain.from_params(params), gen)
    assert q is None and torch.equal(token, argmax(logits[:1, 0]))
    drafts = torch.randint(0, 30, (4, 2), generator=g)
    drafts[0] = argmax(logits[0, :2])  # one row accepts every draft
    got = verify(logits, drafts, None, ProcessorChain.from_params(params), gen)
    want = verify(logits, drafts, None, ProcessorChain.from_params(greedy), None)
    assert torch.equal(got.tokens, want.tokens) and got.num_accepted[0] == 2


@pytest.fixture(scope="module")
def pair(tiny_dirs):
    return LLM(target=str(tiny_dirs["qwen2"]), draft=str(tiny_dirs["llama"]), dtype="float32", draft_quant="none")


@pytest.mark.parametrize("method", ["ar", "draft"])
def test_tiny_temperature_generates_the_greedy_text(pair, method):
    """Through the engine (plain decoding, the draft model's draws, verify): the greedy tokens, not an error."""
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    want = pair.generate(prompt, SamplingParams(max_new_tokens=12, ignore_eos=True), method=method).token_ids
    for t in (1e-40, 1e-30):
        params = SamplingParams(max_new_tokens=12, temperature=t, seed=1, ignore_eos=True)
        assert pair.generate(prompt, params, method=method).token_ids == want


def test_the_params_processors_compute_what_openai_and_vllm_define():
    """By hand, on 6 tokens: prompt [0, 1], output so far [2, 2] + the draft 3 before this row. Bias first, then the
    repetition penalty (divides a positive logit, multiplies a negative one, for any token seen), then frequency
    (per occurrence in the output) and presence (once), then min-p at the request's temperature."""
    import math

    from verispec.sampling import Prefix, ProcessorChain

    logits = torch.tensor([-1.0, 1.0, 0.5, 0.25, 2.0, -0.5])
    kw = dict(temperature=0.5, logit_bias={5: 3.0, 4: -100}, repetition_penalty=2.0, frequency_penalty=0.25,
              presence_penalty=0.125)
    prefix = [Prefix([0, 1, 2, 2], [3])]
    got = ProcessorChain.from_params(SamplingParams(**kw), prompt_len=2).logits(prefix, logits[None])[0]
    want = [-2.0, 0.5, 0.25 - 0.5 - 0.125, 0.125 - 0.25 - 0.125, 2.0 - 100, 2.5]
    assert got.tolist() == pytest.approx(want)
    got = ProcessorChain.from_params(SamplingParams(**kw, min_p=0.02), prompt_len=2).logits(prefix, logits[None])[0]
    cut = 2.5 + 0.5 * math.log(0.02)  # p_i / p_max >= min_p at T = 0.5
    assert got.tolist() == pytest.approx([w if w >= cut else float("-inf") for w in want])
    assert 0 < sum(w >= cut for w in want) < 4  # some kept, some dropped
    assert [type(p).__name__ for p in ProcessorChain.from_params(SamplingParams()).processors] == []  # none: free
