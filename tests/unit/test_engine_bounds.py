"""A request's K is set once (Engine.add) and bounds everything sized per request; a drafter's failure costs its own
request the speculation and nothing else; a sequence whose drafter reads the target's features never takes a shared
prefix whose features no forward of its own computed. Each test fails on the engine before these rules."""

from __future__ import annotations

import dataclasses

import torch
import pytest

from verispec import LLM, SamplingParams
from verispec.config import SpecConfig
from verispec.drafters.base import Draft, Drafter, DraftRequest
from verispec.drafters.ngram import NgramDrafter
from verispec.engine import Engine
from verispec.sampling import LogitsProcessor

PROMPT = list(b"def add(a, b): return a + b\ndef add(a, b): return a + b\ndef ")
OTHER = list(b"Hello, world. Hello, world. Hello")
NEW = 24


@pytest.fixture(scope="module")
def llm(tiny_dirs):
    return LLM(target=str(tiny_dirs["qwen2"]), draft=str(tiny_dirs["qwen2"]), dtype="float32", draft_quant=None,
               progress=False)


def engine(llm, **kw) -> Engine:
    return Engine(llm.target.model, num_blocks=64, block_size=4, chunk_size=16, logit_mask=llm.logit_mask,
                  eos_token_ids=(), **kw)


def run(eng: Engine, jobs) -> list[list[int]]:
    """jobs: (prompt, drafter or factory, K, fixed_k) -> each request's output ids, all in one engine."""
    reqs = [eng.add(p, SamplingParams(max_new_tokens=NEW), d, k, fixed_k=f) for p, d, k, f in jobs]
    while eng.has_work:
        eng.step()
    return [r.output_ids for r in reqs]


@pytest.fixture(scope="module")
def ar(llm):
    return run(engine(llm), [(PROMPT, None, 0, False), (OTHER, None, 0, False)])


@pytest.mark.parametrize("k", [8, 12, 16])
def test_a_request_k_above_the_server_default_sizes_auto_by_it(llm, ar, k):
    """The server's default K is 4; a request asks for k with auto (draft model that is always right, early stops):
    auto's controllers are made for the request's K by the engine, never indexed past it (was an IndexError)."""
    server = SpecConfig("auto", 4)
    factory = lambda K: llm.make_drafter(server.with_k(K))  # noqa: E731 - what the server's runner passes
    eng = engine(llm)
    out = run(eng, [(PROMPT, factory, k, True), (OTHER, None, 0, False)])
    assert out == ar
    assert eng.max_draft_tokens == 16


def test_k_is_bounded_by_the_engine(llm, ar):
    seen = []
    eng = engine(llm, max_draft_tokens=3)
    req = eng.add(PROMPT, SamplingParams(max_new_tokens=NEW), lambda K: seen.append(K) or NgramDrafter(1, 4), 10,
                  fixed_k=True)
    assert seen == [3] and req.seq.num_draft_tokens == 3
    while eng.has_work:
        eng.step()
    assert req.output_ids == ar[0]


class Failing(Drafter):
    """Drafts one right token, then raises (or overdrafts) on its second round."""

    def __init__(self, how: str):
        self.how, self.rounds = how, 0

    def propose(self, request: DraftRequest) -> Draft:
        self.rounds += 1
        if self.rounds == 2:
            if self.how == "raise":
                raise RuntimeError("drafter bug")
            return Draft(torch.zeros(1, request.num_tokens + 3, dtype=torch.long))
        return Draft(torch.zeros(1, 1, dtype=torch.long))


class FailingReader(Failing):
    feature_layers = (1,)  # the engine keeps the target's features for it until it is dropped


@pytest.mark.parametrize("how", ["raise", "overdraft", "raise-reading-features"])
def test_a_failing_drafter_fails_nobody(llm, ar, how):
    """Its request decodes on without speculation (the same tokens: the target alone decides); the neighbour's
    output is unchanged."""
    bad = FailingReader("raise") if how == "raise-reading-features" else Failing(how)
    eng = engine(llm)
    out = run(eng, [(PROMPT, bad, 4, True), (OTHER, NgramDrafter(1, 4), 4, True)])
    assert out == ar
    assert bad.rounds == 2  # dropped after the failure: never asked again


class Recorder(Drafter):
    """Reads the target's features (layer 1) and records the prompt rows of its first round; never drafts."""

    feature_layers = (1,)

    def __init__(self):
        self.first = None

    def propose(self, request: DraftRequest) -> Draft:
        if self.first is None:
            self.first = request.features[:len(PROMPT) - 1].clone()
        return Draft(torch.empty(1, 0, dtype=torch.long))


def test_features_are_computed_even_when_the_prefix_is_shared(llm):
    """With prefix reuse, a second request with the same prompt would take the first one's prefix blocks and read
    features no forward had written (uninitialised memory). It must see exactly what the first one saw."""
    eng = engine(llm, prefix_reuse=True)
    a, b = Recorder(), Recorder()
    keep = eng.add(PROMPT, SamplingParams(max_new_tokens=4), a, 2, fixed_k=True)
    while eng.has_work:
        eng.step()
    eng.add(PROMPT, SamplingParams(max_new_tokens=4), b, 2, fixed_k=True)
    while eng.has_work:
        eng.step()
    assert keep.finished and a.first is not None and b.first is not None
    assert torch.isfinite(b.first).all()
    assert torch.equal(a.first, b.first)
    assert a.first.abs().sum() > 0


class Explodes(LogitsProcessor):
    """A processor of one request's own that raises once its prefix is long enough (a grammar engine's bug, say)."""

    def __call__(self, prefix, logits):
        if len(prefix) > len(OTHER) + 3:
            raise RuntimeError("processor bug")
        return logits


@pytest.mark.parametrize("drafter", [None, "ngram"])
def test_a_request_whose_own_step_fails_fails_alone(llm, ar, drafter):
    """Its accept raises mid-generation: it ends with finish_reason "error" and the error kept, its blocks are freed,
    and its neighbour (speculating or not) decodes exactly what it decodes alone (before, the whole step raised and
    the server failed every request in flight)."""
    eng = engine(llm)
    good = eng.add(PROMPT, SamplingParams(max_new_tokens=NEW), NgramDrafter(1, 4) if drafter else None, 4, fixed_k=True)
    bad = eng.add(OTHER, SamplingParams(max_new_tokens=NEW), NgramDrafter(1, 4) if drafter else None, 4, fixed_k=True)
    bad.chain = dataclasses.replace(bad.chain, processors=(*bad.chain.processors, Explodes()))
    while eng.has_work:
        eng.step()
    assert good.output_ids == ar[0] and good.finish_reason == "length"
    assert bad.finish_reason == "error" and "processor bug" in str(bad.error) and 0 < len(bad.output_ids) < NEW
    assert bad.request_id not in eng.requests and eng.blocks.usage == 0
