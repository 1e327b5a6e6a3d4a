"""KVCache: incremental decode equals recompute, truncate() is a true rollback, capacity is enforced."""

from __future__ import annotations

import pytest
import torch

from verispec.errors import VerispecError
from verispec.models.kv_cache import KVCache
from verispec.models.loader import load


@pytest.fixture(scope="module", params=["qwen2", "mistral"])
def lm(request, tiny_dirs):
    return load(str(tiny_dirs[request.param]), torch.float32, "cpu")


def ids_of(batch, n, seed):
    return torch.randint(0, 256, (batch, n), generator=torch.Generator().manual_seed(seed))


def pos(batch, a, b):
    return torch.arange(a, b).expand(batch, b - a)


def step(model, cache, ids, start):
    """Feed ids [B, T] at positions start..start+T-1; return logits [B, T, V]."""
    return model(ids, pos(ids.shape[0], start, start + ids.shape[1]), cache)[0]


def test_for_model_shapes(lm):
    cfg = lm.config
    cache = KVCache.for_model(cfg, 3, 17, torch.float32)
    assert cache.k.shape == (cfg.num_layers, 3, cfg.num_kv_heads, 17, cfg.head_dim)
    assert cache.v.shape == cache.k.shape
    assert cache.length == 0 and cache.capacity == 17


def test_prefill_then_decode_equals_full_recompute(lm):
    model, cfg = lm.model, lm.config
    ids = ids_of(2, 18, seed=0)
    full = step(model, KVCache.for_model(cfg, 2, 18, torch.float32), ids, 0)  # one prefill of everything
    cache = KVCache.for_model(cfg, 2, 18, torch.float32)
    parts = [step(model, cache, ids[:, :6], 0)]
    for t in range(6, 18):
        parts.append(step(model, cache, ids[:, t:t + 1], t))
    # Different matrix shapes (1 query row vs 18) may reduce in a different order: not bitwise.
    assert (torch.cat(parts, dim=1) - full).abs().max().item() <= 1e-5
    assert cache.length == 18


def history(prompt, rejected):
    """The forward calls of one speculative round: prompt prefill, a 2-token chunk, then single tokens."""
    chunks = [(prompt, 0), (rejected[:, :2], 12)]
    chunks += [(rejected[:, t:t + 1], 12 + t) for t in range(2, rejected.shape[1])]
    return chunks


@pytest.mark.parametrize("keep", [0, 12, 14, 16, 9])
def test_truncate_then_decode_equals_fresh_cache(lm, keep):
    """Roll back a rejected continuation, decode different tokens: same as never having gone forward."""
    model, cfg = lm.model, lm.config
    prompt = ids_of(2, 12, seed=1)
    rejected = ids_of(2, 6, seed=2)
    accepted = ids_of(2, 5, seed=3)
    seq = torch.cat([prompt, rejected], dim=1)

    cache = KVCache.for_model(cfg, 2, 24, torch.float32)
    for chunk, start in history(prompt, rejected):
        step(model, cache, chunk, start)
    assert cache.length == 18
    cache.truncate(keep)
    assert cache.length == keep
    new = torch.cat([seq[:, keep:12], accepted], dim=1)  # re-feed a dropped prompt part, then new tokens
    got = decode_from(model, cache, new, keep)

    # A cache that made only the forward calls for the kept tokens, never the rolled-back ones.
    fresh = KVCache.for_model(cfg, 2, 24, torch.float32)
    for chunk, start in history(prompt, rejected):
        if start + chunk.shape[1] <= keep:
            step(model, fresh, chunk, start)
        elif start < keep:  # keep falls inside this call: recompute just the kept part
            step(model, fresh, chunk[:, :keep - start], start)
    assert fresh.length == keep
    want = decode_from(model, fresh, new, keep)
    assert cache.length == fresh.length == keep + new.shape[1]
    if keep in (0, 12, 14, 16):
        # The kept keys/values came from the very same forward calls in both caches, and the new
        # tokens run the same calls on them: float32 results must be bitwise equal.
        assert torch.equal(got, want)
    else:
        # keep=9 cuts into the 12-token prefill: the kept K/V were computed by a T=12 prefill in one
        # cache and a T=9 prefill in the other. Different GEMM/SDPA shapes sum in a different order,
        # so K/V differ by a few float32 ulps (~2e-6) and logits of magnitude ~5 by up to ~4e-6
        # (measured), i.e. rounding, not stale state: the tolerance below is ~10x that.
        assert (got - want).abs().max().item() <= 5e-5


def decode_from(model, cache, new, start):
    """Feed ``new`` after ``start`` cached tokens: first a chunk of 3 (or fewer), then one at a time."""
    out = [step(model, cache, new[:, :3], start)]
    for j in range(3, new.shape[1]):
        out.append(step(model, cache, new[:, j:j + 1], start + j))
    return torch.cat(out, dim=1)


def test_truncated_slots_are_not_attended(lm):
    """After truncate, stale keys beyond the length must not influence the next token."""
    model, cfg = lm.model, lm.config
    prompt = ids_of(1, 8, seed=4)
    nxt = ids_of(1, 1, seed=5)
    cache = KVCache.for_model(cfg, 1, 16, torch.float32)
    step(model, cache, prompt, 0)
    step(model, cache, ids_of(1, 4, seed=6), 8)
    cache.truncate(8)
    # poison the stale slots: if they were read, the logits would be NaN
    cache.k[:, :, :, 9:] = float("nan")
    cache.v[:, :, :, 9:] = float("nan")
    got = step(model, cache, nxt, 8)
    assert torch.isfinite(got).all()
    fresh = KVCache.for_model(cfg, 1, 16, torch.float32)
    step(model, fresh, prompt, 0)
    assert torch.equal(got, step(model, fresh, nxt, 8))


def test_capacity_is_enforced(lm):
    model, cfg = lm.model, lm.config
    cache = KVCache.for_model(cfg, 1, 10, torch.float32)
    with pytest.raises(VerispecError, match="KV cache full"):
        step(model, cache, ids_of(1, 11, seed=7), 0)
    assert cache.length == 0
    step(model, cache, ids_of(1, 8, seed=7), 0)
    with pytest.raises(VerispecError, match="capacity 10") as e:
        step(model, cache, ids_of(1, 3, seed=8), 8)
    assert "\n" not in str(e.value)
    assert cache.length == 8
    step(model, cache, ids_of(1, 2, seed=8), 8)  # exactly full is fine
    assert cache.length == 10
    with pytest.raises(VerispecError):
        step(model, cache, ids_of(1, 1, seed=9), 10)
    with pytest.raises(VerispecError):
        cache.reserve(1)
    assert cache.reserve(0) == 10
    assert cache.length == 10


def test_reserve_does_not_advance():
    cache = KVCache(2, 1, 2, 5, 4, torch.float32)
    assert cache.reserve(5) == 0
    assert cache.length == 0
    cache.advance(3)
    assert cache.reserve(2) == 3
    with pytest.raises(VerispecError):
        cache.reserve(3)


@pytest.mark.parametrize("n", [-1, 5, 100])
def test_truncate_outside_range_raises(n):
    cache = KVCache(2, 1, 2, 8, 4, torch.float32)
    cache.advance(4)
    # KVCache.truncate raises ValueError (an internal misuse rather than user input); accept either.
    with pytest.raises((ValueError, VerispecError)):
        cache.truncate(n)
    assert cache.length == 4
    cache.truncate(4)
    cache.truncate(0)
    assert cache.length == 0
