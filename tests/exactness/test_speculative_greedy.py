"""Greedy speculative decoding emits exactly the autoregressive greedy tokens, whatever the draft.

The reference is ``method="ar"`` on the same target (itself checked against transformers in
tests/unit/test_generation.py). Three drafts cover the possibilities: the target itself ("same":
every draft is accepted, so each round commits K + 1 tokens and the draft model's cache must stay in
step with the target's), a noisy copy of the target ("near": rounds end anywhere, so both caches
roll back to every possible length), and an unrelated random model ("other": nearly every draft is
rejected, so both caches roll back almost every round). Stops (EOS, max_new_tokens, stop strings) that fall inside
a committed chunk must end the output at exactly the same token as autoregressive decoding.
"""

from __future__ import annotations

import math

import pytest

import torch

from exact_helpers import use_fused_quantized_draft
from tiny import EOS_ID, make_hf_dir
from verispec import LLM, SamplingParams
from verispec.draft_vocab import save_table

ARCHS = ["qwen2", "llama"]
KS = [1, 2, 4, 8]
DRAFTS = ["same", "near", "other", "same-int4", "same-int8", "same-int8-fused", "same-head", "same-int8-head"]
HEAD_ROWS = 128  # "-head" drafts: the target restricted to half its tokens (draft_vocab.py)
PROMPTS = ["Hello, world", "def f(x):\n    return"]
N = 24


@pytest.fixture(scope="module")
def draft_dirs(tmp_path_factory):
    """Drafts sharing the tokenizer. near: the target's weights (tiny_dirs, seed 0) plus noise;
    other: another architecture, another seed."""
    root = tmp_path_factory.mktemp("drafts")
    out = {}
    for arch in ARCHS:
        out[arch, "near"] = make_hf_dir(root / f"near_{arch}", arch, 0, noise=0.01)
    out["qwen2", "other"] = make_hf_dir(root / "llama_s5", "llama", seed=5)
    out["llama", "other"] = make_hf_dir(root / "qwen2_s6", "qwen2", seed=6)
    return out


@pytest.fixture(scope="module")
def head_table(tmp_path_factory):
    """A frequency table over the tiny tokenizer's 259 tokens in a fixed shuffled order."""
    path = tmp_path_factory.mktemp("vocab") / "tiny.draft-vocab"
    save_table(path, torch.randperm(259, generator=torch.Generator().manual_seed(3)), 259)
    return path


@pytest.fixture(scope="module")
def llms(tiny_dirs, draft_dirs, head_table):
    """{(arch, draft): LLM}; each LLM also serves as the AR reference (method "ar" ignores the draft)."""
    out = {}
    for arch in ARCHS:
        target = str(tiny_dirs[arch])
        # draft_quant="none": these drafts keep the float weights, so "same" really is the target
        out[arch, "same"] = LLM(target=target, draft=target, dtype="float32", draft_quant="none")
        for d in ("near", "other"):
            out[arch, d] = LLM(target=target, draft=str(draft_dirs[arch, d]), dtype="float32", draft_quant="none")
        # the same weights in 4 bits (the default on CPU) and in int8: an approximate q; the output must not change
        out[arch, "same-int4"] = LLM(target=target, draft=target, dtype="float32")
        out[arch, "same-int8"] = LLM(target=target, draft=target, dtype="float32", draft_quant="int8")
        # the same weights in bf16 and int8, each draft step one fused C++ call per layer
        out[arch, "same-int8-fused"] = use_fused_quantized_draft(
            LLM(target=target, draft=target, dtype="float32", draft_quant="none"), target, 8)
        # the target's weights with an LM head kept to HEAD_ROWS tokens: drafts outside them are impossible
        head = dict(draft_vocab=HEAD_ROWS, draft_vocab_table=str(head_table))
        out[arch, "same-head"] = LLM(target=target, draft=target, dtype="float32", draft_quant="none", **head)
        out[arch, "same-int8-head"] = LLM(target=target, draft=target, dtype="float32", draft_quant="int8", **head)
    return out


def ar(llm, prompt, **kw):
    return llm.generate(prompt, SamplingParams(**kw))


def spec(llm, prompt, K, **kw):
    """Always K drafts a round (early stops: test_early_stop.py), so the round structure checks below hold."""
    return llm.generate(prompt, SamplingParams(**kw), method="draft", num_draft_tokens=K, early_stop=False)


def produced(stats) -> int:
    """Tokens the loop committed: one per target forward (prefill, recovered/bonus, plain step) plus
    the accepted drafts. More than new_tokens means a stop fell inside the last chunk."""
    return stats["accepted_tokens"] + stats["target_forwards"]


def best_forwards(n: int, K: int) -> int:
    """Target forwards for n tokens when every draft is accepted: the prefill, then K + 1 per round."""
    return 1 + math.ceil((n - 1) / (K + 1))


@pytest.mark.parametrize("draft", DRAFTS)
@pytest.mark.parametrize("K", KS)
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_identity(llms, arch, K, draft):
    llm = llms[arch, draft]
    for prompt in PROMPTS:
        want = ar(llm, prompt, max_new_tokens=N, ignore_eos=True)
        out = spec(llm, prompt, K, max_new_tokens=N, ignore_eos=True)
        assert out.token_ids == want.token_ids, f"{arch} K={K} {draft} {prompt!r}"
        assert out.text == want.text and out.finish_reason == "length"
        s = out.stats
        assert s["new_tokens"] == N == produced(s)
        if draft == "same":
            assert s["acceptance_rate"] == 1.0
            assert s["target_forwards"] == best_forwards(N, K)
            assert s["mean_accepted_length"] == pytest.approx(N / best_forwards(N, K))
            assert s["mean_accepted_length"] > 0.6 * (K + 1)
        elif draft.endswith("-head"):
            # accepted drafts are output tokens the restricted head can propose
            kept = set(llm.draft.model.head_ids.tolist())
            assert EOS_ID in kept and len(kept) in (HEAD_ROWS, HEAD_ROWS + 1)  # plus EOS, always kept
            assert llm.draft.model.lm_head.out_features == len(kept)
            assert s["accepted_tokens"] <= sum(t in kept for t in want.token_ids)
        elif draft.startswith("same-int"):
            # quantized q is close to p, not equal (4 bits: further; the tiny random models have many near-ties)
            assert out.stats["acceptance_rate"] > (0.5 if "int8" in draft else 0.15), s["acceptance_rate"]
        elif draft == "near":
            assert 0.05 < s["acceptance_rate"] < 0.98, s["acceptance_rate"]
            if K > 1:  # some round ended after some but not all of its drafts: a rejection past position 0
                acc, reached = s["per_position_acceptance"][1:], s["per_position_reached"][1:]
                assert any(r and a < 1 for a, r in zip(acc, reached)), s["per_position_acceptance"]
        else:
            assert s["acceptance_rate"] < 0.25, f"an unrelated draft agrees too often: {s['acceptance_rate']}"
            assert s["target_forwards"] > N / 2


def _eos_prompts(llm, n=32, want=2):
    """Prompts whose greedy AR continuation emits EOS after at least 3 tokens."""
    found = []
    for i in range(300):
        prompt = f"Prompt number {i}: "
        out = ar(llm, prompt, max_new_tokens=n)
        if out.finish_reason == "eos" and len(out.token_ids) >= 4:
            found.append((prompt, out))
            if len(found) == want:
                return found
    pytest.fail("no prompt found whose greedy continuation ends in EOS")


@pytest.mark.parametrize("arch", ARCHS)
def test_eos_mid_chunk(llms, arch):
    mid_chunk = 0
    for prompt, want in _eos_prompts(llms[arch, "same"]):
        assert want.token_ids[-1] == EOS_ID and EOS_ID not in want.token_ids[:-1]
        for draft in DRAFTS:
            for K in KS:
                out = spec(llms[arch, draft], prompt, K, max_new_tokens=32)
                assert out.token_ids == want.token_ids, f"{arch} {draft} K={K} {prompt!r}"
                assert out.finish_reason == "eos" and out.text == want.text
                assert out.stats["new_tokens"] == len(want.token_ids)
                mid_chunk += draft == "same" and produced(out.stats) > len(want.token_ids)
    assert mid_chunk >= 2, "EOS never fell inside a committed chunk: the test did not test that"


@pytest.mark.parametrize("draft", DRAFTS)
def test_max_new_tokens_mid_chunk(llms, draft):
    llm = llms["qwen2", draft]
    K = 4
    full = ar(llm, PROMPTS[1], max_new_tokens=13, ignore_eos=True).token_ids
    for n in range(1, 14):  # every remainder modulo K + 1
        out = spec(llm, PROMPTS[1], K, max_new_tokens=n, ignore_eos=True)
        assert out.token_ids == full[:n], f"max_new_tokens={n}"
        assert out.finish_reason == "length" and out.stats["new_tokens"] == n
        if draft == "same":  # no forward wasted past the budget
            assert out.stats["target_forwards"] == best_forwards(n, K), f"max_new_tokens={n}"


def _expected_stop(tok, ids, stop):
    """Independent: the first n with the stop string in decode(ids[:n]); the text cut before it."""
    for n in range(1, len(ids) + 1):
        text = tok.decode(ids[:n])
        if stop in text:
            return ids[:n], text[: text.find(stop)]
    return None


@pytest.mark.parametrize("arch", ARCHS)
def test_stop_string_mid_chunk(llms, arch):
    tok = llms[arch, "same"].target.tokenizer
    checked = mid_chunk = 0
    for prompt in ["The answer is", "Once upon a time", "1, 2, 3,", "<html>"]:
        ids = ar(llms[arch, "same"], prompt, max_new_tokens=40, ignore_eos=True).token_ids
        ids = ids[: ids.index(EOS_ID)] if EOS_ID in ids else ids
        pair = next((bytes(ids[j:j + 2]).decode() for j in range(3, len(ids) - 1)
                     if all(32 <= t < 127 for t in ids[j:j + 2])), None)
        if pair is None:
            continue
        want_ids, want_text = _expected_stop(tok, ids, pair)
        want = ar(llms[arch, "same"], prompt, max_new_tokens=40, stop=[pair])
        assert (want.token_ids, want.text) == (want_ids, want_text)
        checked += 1
        for draft in DRAFTS:
            for K in (2, 4, 8):
                out = spec(llms[arch, draft], prompt, K, max_new_tokens=40, stop=[pair])
                assert out.finish_reason == "stop", f"{draft} K={K} {prompt!r} stop {pair!r}"
                assert out.token_ids == want_ids and out.text == want_text
                assert out.stats["new_tokens"] == len(want_ids)
                mid_chunk += draft == "same" and produced(out.stats) > len(want_ids)
    assert checked >= 2 and mid_chunk >= 2


@pytest.mark.parametrize("kw", [
    dict(max_new_tokens=30, ignore_eos=True),
    dict(max_new_tokens=30, stop=["e "]),
    dict(max_new_tokens=30, temperature=1.0, seed=3),
    dict(max_new_tokens=30, temperature=0.8, top_p=0.9, seed=4, ignore_eos=True),
])
@pytest.mark.parametrize("draft", DRAFTS)
def test_stream_concatenates_to_generate(llms, draft, kw):
    llm = llms["qwen2", draft]
    for prompt in ["Stream me: ", "héllo wörld "]:
        out = spec(llm, prompt, 3, **kw)
        pieces = list(llm.stream(prompt, SamplingParams(**kw), method="draft", num_draft_tokens=3,
                                 early_stop=False))
        assert all(isinstance(p, str) and p for p in pieces)
        assert "".join(pieces) == out.text
        assert llm.last_output.token_ids == out.token_ids
        assert llm.last_output.finish_reason == out.finish_reason
        if "temperature" not in kw:  # greedy: the same as autoregressive streaming
            assert out.token_ids == ar(llm, prompt, **kw).token_ids


def test_stream_with_eos_mid_chunk(llms):
    llm = llms["qwen2", "same"]
    prompt, want = _eos_prompts(llm, want=1)[0]
    for K in KS:
        pieces = list(llm.stream(prompt, SamplingParams(max_new_tokens=32), method="draft", num_draft_tokens=K))
        assert "".join(pieces) == want.text and "<|end|>" not in want.text
        assert llm.last_output.token_ids == want.token_ids and llm.last_output.finish_reason == "eos"


@pytest.fixture(scope="module")
def ids_only(tmp_path_factory):
    root = tmp_path_factory.mktemp("ids_only_spec")
    target = make_hf_dir(root / "t", "qwen2", seed=0, tokenizer=False)  # the weights of tiny_dirs["qwen2"]
    other = make_hf_dir(root / "d", "llama", seed=7, tokenizer=False)
    return {d: LLM(target=str(target), draft=str(target if d == "same" else other), dtype="float32",
                   draft_quant="none")
            for d in ("same", "other")}


@pytest.mark.parametrize("draft", ["same", "other"])
def test_token_ids_only_models(ids_only, llms, draft):
    llm = ids_only[draft]
    assert not llm.codec.has_tokenizer and llm.draft.tokenizer is None
    ids = list("Hello, world".encode())
    # reference: AR on the id-only target; it is the same as with the tokenizer (where padding rows are
    # masked) as long as greedy never picks a padding row, as here
    want = ar(llm, ids, max_new_tokens=N, ignore_eos=True).token_ids
    assert want == ar(llms["qwen2", "same"], ids, max_new_tokens=N, ignore_eos=True).token_ids
    for K in (1, 3, 8):
        out = spec(llm, ids, K, max_new_tokens=N, ignore_eos=True)
        assert out.token_ids == want and out.text == ""
        if draft == "same":
            assert out.stats["acceptance_rate"] == 1.0


@pytest.mark.parametrize("kw", [dict(temperature=1.0, top_k=1), dict(temperature=0.5, top_p=1e-6)])
@pytest.mark.parametrize("draft", DRAFTS)
def test_sampling_path_with_a_single_kept_token_is_greedy(llms, draft, kw):
    """top_k=1 (or a vanishing top_p) leaves one token per step: the *sampling* path (draft
    probabilities, acceptance test, residual) must then reproduce greedy AR token for token."""
    llm = llms["qwen2", draft]
    for K in (1, 4):
        for seed in (0, 1):
            params = SamplingParams(max_new_tokens=N, ignore_eos=True, seed=seed, **kw)
            out = spec(llm, PROMPTS[0], K, **vars(params))
            assert out.token_ids == ar(llm, PROMPTS[0], max_new_tokens=N, ignore_eos=True).token_ids
            assert out.token_ids == ar(llm, PROMPTS[0], **vars(params)).token_ids


@pytest.mark.parametrize("draft", DRAFTS)
def test_prompt_filling_the_context_and_one_token_prompt(llms, draft):
    llm = llms["llama", draft]  # max_position_embeddings = 256
    assert llm.target.config.max_position_embeddings == 256
    for ids, n in ((list(b"x" * 250), 6), ([65], 20)):
        want = ar(llm, ids, max_new_tokens=n, ignore_eos=True).token_ids
        for K in (2, 8):
            assert spec(llm, ids, K, max_new_tokens=n, ignore_eos=True).token_ids == want, (len(ids), K)
