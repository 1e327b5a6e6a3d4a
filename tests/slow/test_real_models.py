"""Real weights: greedy decoding of the default target equals transformers' greedy decoding.

Both run in float32 on the same converted directory (``registry.pull`` gives it), with prompt ids
produced independently by the HF tokenizer. Our runs come first (slow/conftest.py, once per session,
shared with test_real_speculative.py, and let go); transformers' model then loads once per module (~7 GB).
"""

from __future__ import annotations

import gc

import pytest
import torch

from verispec.models.hugepages import page_out_file_sources

from real_models import FLOAT32_PROMPTS, N_TOKENS, TARGET, pull

pytestmark = pytest.mark.slow

TIE = 2e-3  # logit gap under which float32 rounding may legitimately flip an argmax


@pytest.fixture(scope="module")
def model_dir():
    return pull(TARGET)


@pytest.fixture(scope="module")
def hf_prompt_ids(model_dir):
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    out = {}
    for key, p in FLOAT32_PROMPTS.items():
        if p["chat"]:
            ids = tok.apply_chat_template([{"role": "user", "content": p["text"]}], tokenize=True,
                                          add_generation_prompt=True)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        else:
            ids = tok(p["text"]).input_ids
        out[key] = list(ids)
    return out


@pytest.fixture(scope="module")
def ours(float32_outputs):
    """Our greedy outputs for every prompt (slow/conftest.py: the float32 runs shared with
    test_real_speculative.py)."""
    return {key: ar for key, (ar, _, _) in float32_outputs.items()}


@pytest.fixture(scope="module")
def hf_model(model_dir, ours):  # ``ours`` first: our runs are done before transformers' model loads
    import transformers

    transformers.logging.set_verbosity_error()
    # read as stored (bf16, mapped), then cast one tensor at a time, dropping each source's pages: a float32 load
    # kept the whole file resident beside the float32 weights (the suite's peak memory); the values are the same
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).eval()
    for p in model.parameters():
        source, p.data = p.data, p.data.float()
        page_out_file_sources([source])
    yield model
    del model
    gc.collect()


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                             pad_token_id=151643)  # stops at the EOS ids of generation_config.json
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("key", list(FLOAT32_PROMPTS))
def test_greedy_matches_transformers(ours, hf_model, hf_prompt_ids, key):
    out = ours[key]
    ids = hf_prompt_ids[key]
    assert out.prompt_token_ids == ids, "prompt encoding differs from the HF tokenizer's"
    want = hf_greedy(hf_model, ids, N_TOKENS)
    got = out.token_ids
    if got == want:
        assert out.finish_reason == ("eos" if len(got) < N_TOKENS else "length")
        return
    # Divergence is only acceptable at a float32 near-tie of transformers' own logits.
    j = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    assert j < min(len(got), len(want)), f"one output stops early: ours {got}, transformers {want}"
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids + want[:j]])).logits[0, -1].float()
    gap = (logits[want[j]] - logits[got[j]]).item()
    assert gap < TIE, (f"{key}: token {j} differs (ours {got[j]}, transformers {want[j]}) with a logit gap of "
                       f"{gap:.4g}: not a rounding tie\nours: {got}\nhf:   {want}")
    assert j >= 8, f"{key}: diverged after only {j} tokens (near-tie gap {gap:.3g})"
