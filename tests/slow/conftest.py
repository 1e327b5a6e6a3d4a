"""The float32 runs of the default pair, shared by test_real_models.py (our AR output against transformers')
and test_real_speculative.py (speculative output against our AR output): one load of the 6 GB float32
target (and the 2 GB draft) and one AR run per prompt serve both."""

from __future__ import annotations

import pytest

from real_models import DRAFT, FLOAT32_PROMPTS, K, N_TOKENS, TARGET, pull


@pytest.fixture(scope="session")
def float32_llm():
    from verispec import LLM

    for name in (TARGET, DRAFT):
        pull(name)
    llm = LLM(target=TARGET, dtype="float32", progress=False)  # method "draft" loads the default draft
    assert llm.target.source == TARGET and llm.draft is None
    return llm


@pytest.fixture(scope="session")
def float32_outputs(float32_llm):
    """{key: (ar, spec)}: greedy AR and greedy speculative (K draft tokens) outputs for every float32 prompt."""
    from verispec import SamplingParams

    params = SamplingParams(max_new_tokens=N_TOKENS)
    out = {key: (float32_llm.generate(p["text"], params, chat=p["chat"]),
                 float32_llm.generate(p["text"], params, method="draft", num_draft_tokens=K, chat=p["chat"]))
           for key, p in FLOAT32_PROMPTS.items()}
    assert float32_llm.draft.source == DRAFT
    return out
