"""The draft model's KV cache kept across requests (models/kv_cache.PrefixCache): a request feeds the draft only
what follows the prefix it shares with the last one, the kept keys/values are those a fresh prefill computes,
outputs stay the target's, and a request running at the same time never gets a live cache."""

from __future__ import annotations

import pytest
import torch

from verispec import LLM, SamplingParams
from verispec.drafters import draft_model
from verispec.models.kv_cache import KVCache, PrefixCache

GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)
A = [5, 9, 14, 3, 7, 7, 21, 40, 2, 11, 30, 8]
B = A[:7] + [99, 17, 4, 60]  # shares 7 tokens with A


@pytest.fixture(scope="module")
def llm(tiny_dirs):
    d = str(tiny_dirs["qwen2"])
    return LLM(target=d, draft=d, dtype="float32", draft_quant="none")


@pytest.fixture
def first_feeds(monkeypatch):
    """(cache length before, tokens fed) of every draft forward."""
    calls, real = [], draft_model.DraftModelDrafter._forward

    def spy(self, tokens):
        calls.append((self.cache.length, tokens.shape[1]))
        return real(self, tokens)

    monkeypatch.setattr(draft_model.DraftModelDrafter, "_forward", spy)
    return calls


def fresh_kv(model, tokens: list[int]):
    cache = KVCache.for_model(model.config, 1, len(tokens), torch.float32)
    model(torch.tensor([tokens]), torch.arange(len(tokens))[None], cache)
    return cache.k, cache.v


def max_kv_difference(model, cache: KVCache, tokens: list[int]) -> float:
    """Largest |difference| between cache's slots [0, len(tokens)) and a fresh prefill of tokens."""
    k, v = fresh_kv(model, tokens)
    n = len(tokens)
    return max((cache.k[:, :, :, :n] - k).abs().max().item(), (cache.v[:, :, :, :n] - v).abs().max().item())


def test_a_request_feeds_the_draft_only_what_follows_the_shared_prefix(llm, first_feeds):
    llm.draft_prefixes.limit(0)
    llm.generate(A, GREEDY, method="draft")
    assert first_feeds[0] == (0, len(A) + 1)  # nothing kept yet: the whole prompt and the first token
    first_feeds.clear()
    llm.generate(B, GREEDY, method="draft")
    assert first_feeds[0] == (7, len(B) + 1 - 7)
    first_feeds.clear()
    llm.draft_prefixes.limit(3)  # what the bench does between prompts
    llm.generate(A, GREEDY, method="auto")
    assert first_feeds and first_feeds[0][0] <= 3


def test_a_conversations_next_turn_feeds_the_draft_only_the_new_turn(llm, first_feeds):
    llm.draft_prefixes.limit(0)
    first = llm.generate(A, GREEDY, method="draft")
    first_feeds.clear()
    second = A + first.token_ids + B  # the answer, then the next question
    llm.generate(second, GREEDY, method="draft")
    start, fed = first_feeds[0]
    # the draft saw all of the first request but its last token or two (a last draft never fed, a closing
    # target step); now it is fed the rest, through the second request's first token
    assert len(A) + len(first.token_ids) - 3 <= start and start + fed == len(second) + 1


def test_the_bench_lets_a_draft_reuse_only_what_the_prompt_shares_with_the_one_before(llm, first_feeds):
    from verispec.bench.prompts import Prompt
    from verispec.bench.runner import run_prompt
    from verispec.config import SpecConfig

    llm.generate(A, GREEDY, method="draft")  # the store now holds all of A
    first_feeds.clear()
    runs = [("one", SpecConfig("draft", 4), llm), ("two", SpecConfig("draft", 4), llm)]
    run_prompt(llm, Prompt("a", "coding", "-"), A, GREEDY, runs, shared=3)
    prefills = [start for start, fed in first_feeds if start + fed == len(A) + 1]  # each run's first forward
    assert len(prefills) == 2 and max(prefills) <= 3  # not the whole prompt the first run fed


def kept_a(llm, capacity: int):
    """(draft model, a store keeping its cache of A, that cache)"""
    model = llm.draft_model().model
    cache = KVCache.for_model(model.config, 1, capacity, torch.float32)
    model(torch.tensor([A]), torch.arange(len(A))[None], cache)
    store = PrefixCache()
    store.put(model, cache, list(A))
    return model, store, cache


def test_the_kept_cache_holds_what_a_fresh_prefill_computes(llm):
    model, store, cache = kept_a(llm, 64)
    taken = store.take(model, B, 32, torch.float32, "cpu")  # smaller than the kept one: handed over
    assert taken is cache and taken.length == 7 and store.entry is None
    assert max_kv_difference(model, taken, B[:7]) < 1e-5
    # negative control: a store that believed one more token was shared hands over a stale slot, and the
    # comparison sees it
    cache.length = len(A)  # truncate() left A's slots as they were
    store.put(model, cache, B[:8] + A[8:])  # lies about token 7
    stale = store.take(model, B, 32, torch.float32, "cpu")
    assert stale.length == 8 and max_kv_difference(model, stale, B[:8]) > 1e-3


def test_a_larger_request_gets_a_copy_of_the_prefix(llm):
    model, store, cache = kept_a(llm, 16)
    taken = store.take(model, B, 100, torch.float32, "cpu")
    assert taken is not cache and taken.capacity == 100 and taken.length == 7
    assert max_kv_difference(model, taken, B[:7]) < 1e-5


def test_what_the_store_will_reuse(llm):
    model = llm.draft_model().model
    cache = KVCache.for_model(model.config, 1, 32, torch.float32)
    cache.length = 20  # a request that ended mid-round: drafts past its committed tokens
    store = PrefixCache()
    store.put(model, cache, list(A))
    assert store.reusable(model, A + [1, 2]) == len(A)  # never past the tokens the request committed
    assert store.reusable(model, A) == len(A) - 1  # the last token is always fed: the draft needs its logits
    assert store.reusable(model, B) == 7 and store.reusable(object(), B) == 0  # another model: nothing
    store.limit(4)
    assert store.reusable(model, B) == 4
    store.limit(0)
    assert store.reusable(model, B) == 0


def test_outputs_stay_the_targets_and_live_caches_are_never_shared(llm, first_feeds):
    ar = {tuple(p): llm.generate(p, GREEDY).text for p in (A, B)}
    for p in (A, B, A):
        assert llm.generate(p, GREEDY, method="draft").text == ar[tuple(p)]
    # two requests at once, pulled in turn: the one that comes second to the store starts from scratch, since the
    # other holds the kept cache until it ends
    first_feeds.clear()
    live, texts = {0: llm.stream(A, GREEDY, method="draft"), 1: llm.stream(B, GREEDY, method="draft")}, ["", ""]
    while live:
        for key in list(live):
            try:
                texts[key] += next(live[key])
            except StopIteration:
                del live[key]
    assert texts == [ar[tuple(A)], ar[tuple(B)]]
    assert [length for length, _ in first_feeds].count(0) == 1
    for p in (A, B):  # the next requests still match the target's outputs
        assert llm.generate(p, GREEDY, method="draft").text == ar[tuple(p)]


def test_a_put_from_another_thread_during_take_never_pairs_one_cache_with_anothers_count(llm, monkeypatch):
    """``put`` runs in a finalizer, possibly on the server's event-loop thread, while the engine thread is in ``take``.
    Simulated by a put landing while take compares prefixes: take must hand over the cache it compared (with its
    count) and leave the new one in the store, never the new cache cut to the old one's count."""
    from verispec.models import kv_cache

    model = llm.draft_model().model
    old, new = (KVCache.for_model(model.config, 1, 32, torch.float32) for _ in range(2))
    old.length, new.length = len(A), 3
    store = PrefixCache()
    store.put(model, old, list(A))
    real = kv_cache.common_prefix

    def racing(a, b):
        monkeypatch.setattr(kv_cache, "common_prefix", real)  # once
        store.put(model, new, list(B[:3]))  # another request's drafter is dropped right now
        return real(a, b)

    monkeypatch.setattr(kv_cache, "common_prefix", racing)
    got = store.take(model, A + [1], 32, torch.float32, "cpu")
    assert got is old and got.length == len(A)
    assert store.entry is not None and store.entry[1] is new and new.length == 3
