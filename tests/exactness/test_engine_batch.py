"""The batched engine (engine/engine.py) on a native GGUF target: what a request gets does not depend on who
shares its batch. Greedy and seeded sampling, plain decoding and speculation (a draft model that is always right,
one that is nearly always wrong, n-gram lookup), prompts shorter and longer than one fused call; alone, together,
and against LLM.generate where both compute the same way (prompts of <= 16 tokens)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from tiny import make_hf_model
from verispec import LLM, SamplingParams, kernels
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.drafters.ngram import NgramDrafter
from verispec.engine import Engine

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
from gguf_tiny import write_gguf  # noqa: E402

pytestmark = pytest.mark.skipif(not kernels.available(), reason="C++ kernels not built")

DIMS = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
TYPES = {"attn_q.weight": Q.Q4_K, "attn_k.weight": Q.Q6_K, "attn_v.weight": Q.Q8_0, "attn_output.weight": Q.Q8_0,
         "ffn_gate.weight": Q.Q4_K, "ffn_up.weight": Q.Q6_K, "ffn_down.weight": Q.Q4_K, "output.weight": Q.Q6_K,
         "token_embd.weight": Q.Q8_0}
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], list(b"Hello, world. Hello, world!"), [9, 9, 8, 7], list(range(30, 70)),
           list(b"abcabcabcabc"), [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]]
NEW = 20


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine")
    write_gguf(root / "target.gguf", "qwen2", make_hf_model("qwen2", seed=11, **DIMS), TYPES, seed=5, kquant_scale=2.0)
    write_gguf(root / "other.gguf", "llama", make_hf_model("llama", seed=12, **DIMS), TYPES, seed=7, kquant_scale=2.0)
    target = LLM(target=str(root / "target.gguf"), draft=str(root / "target.gguf"), dtype="bfloat16",
                 weights="native", draft_weights="native", progress=False)
    other = LLM(target=str(root / "other.gguf"), dtype="bfloat16", weights="native", progress=False)
    return target, other


def drafter_for(models, kind: str):
    target, other = models
    if kind == "ar":
        return None
    if kind == "ngram":
        return NgramDrafter(1, 4)
    return DraftModelDrafter((target.draft if kind == "same" else other.target).model, early_stop=False)


def run(models, jobs, num_blocks=64, seen: dict | None = None, fixed_k: bool = True, **engine_kw) -> list[list[int]]:
    """jobs: (prompt, params, drafter kind, K) -> each request's output ids, all in one engine (``seen`` gets the
    engine's preemption count and the requests). ``fixed_k``: every draft round drafts K (on these tiny models the
    cost model would often draft nothing)."""
    target = models[0]
    engine = Engine(target.target.model, num_blocks=num_blocks, block_size=4, chunk_size=16,
                    max_num_batched_tokens=64, logit_mask=target.logit_mask, **engine_kw)
    reqs = [engine.add(p, params, drafter_for(models, kind), K, fixed_k) for p, params, kind, K in jobs]
    for _ in range(2000):
        if not engine.has_work:
            break
        engine.step()
    assert not engine.has_work and engine.blocks.num_free == engine.blocks.num_blocks  # nothing leaks
    assert all(r.finished for r in reqs)
    if seen is not None:
        seen.update(preemptions=engine.scheduler.num_preemptions, requests=reqs)
    return [r.output_ids for r in reqs]


def jobs_for(kind: str, K: int, sampled: bool):
    params = [SamplingParams(max_new_tokens=NEW, ignore_eos=True, **({"temperature": 0.8, "seed": 100 + i}
                                                                    if sampled else {}))
              for i in range(len(PROMPTS))]
    return [(p, params[i], kind, K) for i, p in enumerate(PROMPTS)]


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("kind,K", [("ar", 0), ("same", 4), ("other", 3), ("ngram", 4)])
def test_a_request_gets_the_same_tokens_alone_and_in_a_batch(models, kind, K, sampled):
    jobs = jobs_for(kind, K, sampled)
    alone, seen = [run(models, [job])[0] for job in jobs], {}
    together = run(models, jobs, seen=seen)
    assert together == alone
    assert sum(r.drafted for r in seen["requests"]) >= (NEW if K else 0)  # speculation ran
    assert all(len(out) == NEW for out in alone)
    assert len({tuple(out) for out in alone}) == len(alone)  # varied text: the identity means something


@pytest.mark.parametrize("kind,K", [("same", 4), ("other", 3), ("ngram", 4)])
def test_greedy_speculation_is_plain_decoding(models, kind, K):
    assert run(models, jobs_for(kind, K, False)) == run(models, jobs_for("ar", 0, False))


@pytest.mark.parametrize("kind", ["same", "ngram"])
def test_the_cost_model_picks_k_per_step_and_output_stays_exact(models, kind):
    seen = {}
    out = run(models, jobs_for(kind, 4, False), seen=seen, fixed_k=False)
    assert out == run(models, jobs_for("ar", 0, False))
    if kind == "ngram":  # lookups cost ~nothing next to a step: some steps draft (a draft model as dear as the
        assert sum(r.drafted for r in seen["requests"]) > 0  # target, "same", rightly never beats plain steps)


def test_sixteen_requests_together_get_what_llm_generate_gives_each_alone(models):
    """LLM.generate runs one request through the same engine (its whole prompt in one chunk): 16 requests in one
    batch (plain, draft model, n-gram; greedy and seeded; prompts of 4 to 40 tokens, several prefill chunks here)
    each get bitwise the tokens it gets alone."""
    target = models[0]
    kinds = [("ar", 0), ("same", 4), ("ngram", 4), ("ar", 0)]
    jobs = [(job[0], job[1], *kinds[i % 4]) for i, job in enumerate(jobs_for("ar", 0, False) + jobs_for("ar", 0, True)
                                                                     + jobs_for("ar", 0, False)[:4])]
    assert len(jobs) == 16
    methods = {"ar": "ar", "same": "draft", "ngram": "ngram"}
    alone = [target.generate(p, params, method=methods[kind], num_draft_tokens=K or 4, early_stop=False).token_ids
             for p, params, kind, K in jobs]
    seen = {}
    assert run(models, jobs, max_num_seqs=16, seen=seen) == alone
    assert max(len(p) for p, *_ in jobs) > 16 and sum(r.drafted for r in seen["requests"]) > 0


def test_preemption_under_a_tiny_cache_loses_nothing(models):
    jobs = jobs_for("same", 4, False)
    roomy, seen = run(models, jobs), {}
    tight = run(models, jobs, num_blocks=24, seen=seen)  # room for ~2 requests at a time: others wait or are preempted
    assert seen["preemptions"] > 0 and all(len(out) == NEW for out in tight)
    # greedy tokens survive a recompute (its prefill computes the same rows as the decode steps did)
    assert tight == roomy


def test_abort_frees_the_request(models):
    target = models[0]
    engine = Engine(target.target.model, num_blocks=32, block_size=4, chunk_size=16, logit_mask=target.logit_mask)
    a = engine.add(PROMPTS[0], SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    b = engine.add(PROMPTS[1], SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    engine.step()
    engine.step()
    engine.abort(a.request_id)
    assert a.finish_reason == "abort"
    while engine.has_work:
        engine.step()
    assert b.finish_reason == "length" and len(b.output_ids) == NEW
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_eos_ends_a_request_and_is_kept(models):
    jobs = jobs_for("same", 4, False)
    full = run(models, jobs)
    eos = full[0][5]  # pretend the sixth token of the first request is an end of sequence
    params = SamplingParams(max_new_tokens=NEW)
    seen = {}
    out = run(models, [(p, params, kind, K) for p, _, kind, K in jobs], eos_token_ids=(eos,), seen=seen)
    for got, want, req in zip(out, full, seen["requests"]):
        cut = want.index(eos) + 1 if eos in want else NEW
        assert got == want[:cut]
        assert req.finish_reason == ("eos" if eos in want else "length")
