"""The float32 runs of the default pair, shared by test_real_models.py (our AR output against transformers')
and test_real_speculative.py (speculative output against our AR output): one load of the 6 GB float32
target (and the 2 GB draft) and one AR run per prompt serve both. The model is let go as soon as the runs are
done, before transformers' loads (the suite's peak memory: one float32 1.5B model at a time)."""

from __future__ import annotations

import gc

import pytest

from real_models import DRAFT, FLOAT32_PROMPTS, K, N_TOKENS, TARGET, pull


@pytest.fixture(scope="session")
def float32_outputs():
    """{key: (ar, spec, gap)}: greedy AR and greedy speculative (K draft tokens) outputs for every float32 prompt,
    and where they differ, the target's AR logit gap between the two tokens at the first difference (else None)."""
    import torch

    from verispec import LLM, SamplingParams
    from verispec.models.kv_cache import KVCache
    from verispec.sampling import mask_logits

    for name in (TARGET, DRAFT):
        pull(name)
    llm = LLM(target=TARGET, dtype="float32", progress=False)  # method "draft" loads the default draft
    assert llm.target.source == TARGET and llm.draft is None
    params = SamplingParams(max_new_tokens=N_TOKENS)
    out = {}
    for key, p in FLOAT32_PROMPTS.items():
        ar = llm.generate(p["text"], params, chat=p["chat"])
        spec = llm.generate(p["text"], params, method="draft", num_draft_tokens=K, chat=p["chat"])
        got, want, gap = spec.token_ids, ar.token_ids, None
        j = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if j is not None:  # the target's own AR logits at the first difference
            ids = torch.tensor([ar.prompt_token_ids + want[:j]])
            cache = KVCache.for_model(llm.target.config, 1, ids.shape[1], llm.dtype)
            logits = mask_logits(llm.target.model(ids, torch.arange(ids.shape[1])[None], cache, num_logits=1)[0],
                                 llm.logit_mask)[0, -1]
            gap = (logits[want[j]] - logits[got[j]]).item()
        out[key] = (ar, spec, gap)
    assert llm.draft.source == DRAFT
    del llm
    gc.collect()
    return out
