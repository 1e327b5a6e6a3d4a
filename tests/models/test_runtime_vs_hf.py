"""Our runtime (verispec.models.llama) against transformers' own model classes, on tiny random models.

Every comparison is against transformers' full forward over the whole sequence (the reference), never
against our own output: prefill, token-by-token and chunked decode through the KV cache, the residual
stream returned by ``hidden_layers``, ``num_logits``, a left-padded batch with an explicit mask, and
Mistral's sliding window.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from tiny import ARCH_EXTRA, make_hf_dir
from verispec.models.kv_cache import KVCache
from verispec.models.loader import load

ARCHS = list(ARCH_EXTRA)
TOL = 1e-4
T = 20


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    return (a.float() - b.float()).abs().max().item()


def load_pair(path):
    """(transformers model, our LoadedModel) from the same HF directory, both float32 on CPU."""
    transformers.logging.set_verbosity_error()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ours = load(str(path), torch.float32, "cpu")
    return hf, ours


@pytest.fixture(scope="module")
def pairs(tiny_dirs):
    cache = {}

    def get(arch):
        if arch not in cache:
            cache[arch] = load_pair(tiny_dirs[arch])
        return cache[arch]

    return get


def token_ids(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (batch, length), generator=g)


def positions(batch: int, start: int, end: int) -> torch.Tensor:
    return torch.arange(start, end).expand(batch, end - start)


@torch.no_grad()
def hf_logits(hf, ids, **kw):
    return hf(ids, **kw).logits.float()


@pytest.mark.parametrize("arch", ARCHS)
def test_config_read_from_hf_dir(arch, pairs):
    hf, ours = pairs(arch)
    c, h = ours.config, hf.config
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.hidden_size, c.vocab_size) == (
        h.num_hidden_layers, h.num_attention_heads, h.num_key_value_heads, h.hidden_size, h.vocab_size)
    assert c.head_dim == (getattr(h, "head_dim", None) or h.hidden_size // h.num_attention_heads)
    assert c.tie_word_embeddings == bool(h.tie_word_embeddings)
    if arch == "llama3":  # the RoPE scaling must really be read, or the comparisons below prove little
        assert c.rope_scaling and c.rope_scaling["rope_type"] == "llama3"
    if arch == "qwen2":
        assert c.qkv_bias and not c.o_bias
    if arch == "qwen3":
        assert c.qk_norm and c.head_dim == 32
    if arch == "smollm2":
        assert ours.model.lm_head.weight is ours.model.embed_tokens.weight


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_matches_hf(arch, pairs):
    hf, ours = pairs(arch)
    ids = token_ids(2, T)
    ref = hf_logits(hf, ids)
    cache = KVCache.for_model(ours.config, 2, 32, torch.float32)
    logits, hidden = ours.model(ids, positions(2, 0, T), cache)
    assert hidden == {}
    assert logits.dtype == torch.float32 and logits.shape == (2, T, ours.config.vocab_size)
    assert cache.length == T
    assert max_diff(logits, ref) <= TOL


@pytest.mark.parametrize("arch", ARCHS)
def test_hidden_layers_match_hf(arch, pairs):
    hf, ours = pairs(arch)
    L = ours.config.num_layers
    ids = token_ids(2, T, seed=2)
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
    assert len(ref.hidden_states) == L + 1
    cache = KVCache.for_model(ours.config, 2, T, torch.float32)
    _, hidden = ours.model(ids, positions(2, 0, T), cache, hidden_layers=tuple(range(L + 1)))
    assert sorted(hidden) == list(range(L + 1))
    for i in range(L):  # 0 = embeddings, i = residual stream after layer i
        assert hidden[i].shape == (2, T, ours.config.hidden_size)
        assert max_diff(hidden[i], ref.hidden_states[i]) <= TOL, i
    # HF's last entry has the final norm applied; ours is the raw residual stream: apply HF's norm to it.
    with torch.no_grad():
        normed = hf.model.norm(hidden[L].clone())
    assert max_diff(normed, ref.hidden_states[L]) <= TOL
    # ... and the raw stream is really un-normed (the two differ)
    assert max_diff(hidden[L], ref.hidden_states[L]) > 1e-2
    # a subset returns just that subset
    cache = KVCache.for_model(ours.config, 2, T, torch.float32)
    _, only = ours.model(ids, positions(2, 0, T), cache, hidden_layers=(1,))
    assert list(only) == [1] and max_diff(only[1], ref.hidden_states[1]) <= TOL


@pytest.mark.parametrize("arch", ARCHS)
def test_token_by_token_decode_matches_hf(arch, pairs):
    hf, ours = pairs(arch)
    ids = token_ids(2, T, seed=3)
    ref = hf_logits(hf, ids)
    cache = KVCache.for_model(ours.config, 2, T, torch.float32)
    P = 7
    logits, _ = ours.model(ids[:, :P], positions(2, 0, P), cache)
    assert max_diff(logits, ref[:, :P]) <= TOL
    for t in range(P, T):
        logits, _ = ours.model(ids[:, t:t + 1], positions(2, t, t + 1), cache)
        assert cache.length == t + 1
        assert max_diff(logits, ref[:, t:t + 1]) <= TOL, t


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_decode_matches_hf(arch, pairs):
    hf, ours = pairs(arch)
    ids = token_ids(2, T, seed=4)
    ref = hf_logits(hf, ids)
    cache = KVCache.for_model(ours.config, 2, T, torch.float32)
    bounds = [0, 5, 10, 11, 15, 17, T]  # prefill 5, a chunk of 5, one token, a chunk of 4, 2, 3
    for a, b in zip(bounds, bounds[1:]):
        logits, _ = ours.model(ids[:, a:b], positions(2, a, b), cache)
        assert max_diff(logits, ref[:, a:b]) <= TOL, (a, b)
    assert cache.length == T


@pytest.mark.parametrize("arch", ARCHS)
def test_num_logits(arch, pairs):
    hf, ours = pairs(arch)
    ids = token_ids(2, T, seed=5)
    ref = hf_logits(hf, ids)
    cache = KVCache.for_model(ours.config, 2, T, torch.float32)
    full, _ = ours.model(ids, positions(2, 0, T), cache)
    cache = KVCache.for_model(ours.config, 2, T, torch.float32)
    last, hidden = ours.model(ids, positions(2, 0, T), cache, num_logits=1, hidden_layers=(1,))
    assert last.shape == (2, 1, ours.config.vocab_size)
    assert max_diff(last, ref[:, -1:]) <= TOL
    assert max_diff(last, full[:, -1:]) <= 1e-5
    assert hidden[1].shape[1] == T  # num_logits trims the logits, not the hidden states
    assert cache.length == T
    cache = KVCache.for_model(ours.config, 2, T, torch.float32)
    three, _ = ours.model(ids, positions(2, 0, T), cache, num_logits=3)
    assert max_diff(three, ref[:, -3:]) <= TOL


@pytest.mark.parametrize("arch", ARCHS)
def test_left_padded_batch_matches_rows_alone(arch, pairs):
    """Row 1 is shorter and left-padded; an explicit mask hides the pad keys, positions restart at 0."""
    hf, ours = pairs(arch)
    n0, n1 = 16, 9
    pad = n0 - n1
    row0 = token_ids(1, n0 + 1, seed=6)[0]
    row1 = token_ids(1, n1 + 1, seed=7)[0]
    ref0 = hf_logits(hf, row0[None])[0]  # each row alone, unpadded, one token longer (for a decode step)
    ref1 = hf_logits(hf, row1[None])[0]

    PAD_ID = 0
    ids = torch.stack([row0[:n0], torch.cat([torch.full((pad,), PAD_ID), row1[:n1]])])  # [2, n0]
    real = torch.ones(2, n0, dtype=torch.bool)
    real[1, :pad] = False
    pos = torch.stack([torch.arange(n0), torch.cat([torch.zeros(pad, dtype=torch.long), torch.arange(n1)])])
    causal = torch.ones(n0, n0, dtype=torch.bool).tril()
    # [2, 1, T, S]: pad keys hidden from every query. The pad queries of row 1 then see no key at all;
    # SDPA on CPU returns zeros for such rows, and their outputs are never attended to (pad keys).
    mask = causal[None, None] & real[:, None, None, :]
    cache = KVCache.for_model(ours.config, 2, n0 + 1, torch.float32)
    logits, _ = ours.model(ids, pos, cache, mask=mask)
    assert max_diff(logits[0], ref0[:n0]) <= TOL
    assert max_diff(logits[1, pad:], ref1[:n1]) <= TOL

    # one decode step for both rows: the new token sees every real key, never a pad key
    step_ids = torch.stack([row0[n0:], row1[n1:]])  # [2, 1]
    step_pos = torch.tensor([[n0], [n1]])
    step_mask = torch.cat([real, torch.ones(2, 1, dtype=torch.bool)], dim=1)[:, None, None, :]  # [2,1,1,S+1]
    logits, _ = ours.model(step_ids, step_pos, cache, mask=step_mask)
    assert max_diff(logits[0, 0], ref0[n0]) <= TOL
    assert max_diff(logits[1, 0], ref1[n1]) <= TOL


def test_left_padding_changes_logits_without_mask(pairs):
    """Guard for the test above: without the pad mask the padded row's logits really are different."""
    hf, ours = pairs("qwen2")
    ids = torch.cat([torch.zeros(1, 5, dtype=torch.long), token_ids(1, 8, seed=8)], dim=1)
    ref = hf_logits(hf, ids[:, 5:])
    cache = KVCache.for_model(ours.config, 1, 13, torch.float32)
    pos = torch.cat([torch.zeros(5, dtype=torch.long), torch.arange(8)])[None]
    logits, _ = ours.model(ids, pos, cache)
    assert max_diff(logits[:, 5:], ref) > 1e-2


# --- Mistral sliding window -------------------------------------------------------------------------

WINDOW = 8


@pytest.fixture(scope="module")
def mistral_window(tmp_path_factory):
    path = make_hf_dir(tmp_path_factory.mktemp("mistral_sw") / "m", "mistral", sliding_window=WINDOW,
                       tokenizer=False)
    hf, ours = load_pair(path)
    assert hf.config.sliding_window == WINDOW
    assert ours.config.sliding_window == WINDOW
    return hf, ours


def banded_mask(batch: int, n: int) -> torch.Tensor:
    """An explicit 4D additive mask [B, 1, n, n]: query q sees keys k with q - WINDOW < k <= q."""
    q = torch.arange(n)[:, None]
    k = torch.arange(n)[None, :]
    allowed = (k <= q) & (k > q - WINDOW)  # itself and the WINDOW-1 keys before it
    bias = torch.zeros(n, n).masked_fill(~allowed, torch.finfo(torch.float32).min)
    return bias[None, None].expand(batch, 1, n, n)


def hf_without_window(hf):
    """The same HF Mistral weights with sliding_window=None (plain causal attention)."""
    cfg = hf.config.to_dict()
    cfg["sliding_window"] = None
    nowin = transformers.MistralForCausalLM(transformers.MistralConfig(**cfg)).eval()
    nowin.load_state_dict(hf.state_dict())
    return nowin


def test_mistral_sliding_window_prefill_matches_hf(mistral_window):
    hf, ours = mistral_window
    n = 3 * WINDOW
    ids = token_ids(2, n, seed=9)
    ref = hf_logits(hf, ids)
    cache = KVCache.for_model(ours.config, 2, n, torch.float32)
    logits, _ = ours.model(ids, positions(2, 0, n), cache)
    assert max_diff(logits, ref) <= TOL
    # the window matters: without it the logits differ past the window, and only there
    full_attention = hf_logits(hf_without_window(hf), ids)
    assert max_diff(full_attention[:, WINDOW:], ref[:, WINDOW:]) > 1e-3
    assert max_diff(full_attention[:, :WINDOW], ref[:, :WINDOW]) <= TOL


def test_mistral_sliding_window_semantics(mistral_window):
    """Which keys HF's window admits, checked against an explicit banded mask on a window-less model,
    so that "we match HF" also means "we match the intended window" (k in (q-W, q])."""
    hf, _ = mistral_window
    n = 3 * WINDOW
    ids = token_ids(1, n, seed=10)
    with torch.no_grad():
        banded = hf_without_window(hf)(ids, attention_mask=banded_mask(1, n)).logits
    assert max_diff(hf_logits(hf, ids), banded) <= TOL


def test_mistral_sliding_window_decode_matches_hf(mistral_window):
    hf, ours = mistral_window
    n = 3 * WINDOW
    ids = token_ids(2, n, seed=11)
    ref = hf_logits(hf, ids)
    # token by token, crossing the window boundary
    cache = KVCache.for_model(ours.config, 2, n, torch.float32)
    P = 3
    logits, _ = ours.model(ids[:, :P], positions(2, 0, P), cache)
    assert max_diff(logits, ref[:, :P]) <= TOL
    for t in range(P, n):
        logits, _ = ours.model(ids[:, t:t + 1], positions(2, t, t + 1), cache)
        assert max_diff(logits, ref[:, t:t + 1]) <= TOL, t
    # chunks that straddle the window
    cache = KVCache.for_model(ours.config, 2, n, torch.float32)
    bounds = [0, 10, 15, 16, n]
    for a, b in zip(bounds, bounds[1:]):
        logits, _ = ours.model(ids[:, a:b], positions(2, a, b), cache)
        assert max_diff(logits, ref[:, a:b]) <= TOL, (a, b)


# --- RoPE: far positions, linear scaling, transformers 4.x config layouts ------------------------------

@pytest.mark.parametrize("arch", ARCHS)
def test_far_and_gapped_positions_match_hf(arch, pairs):
    """Positions with gaps, reaching far past llama3's original_max_position_embeddings (64), as HF
    position_ids. (A constant offset alone would prove little: RoPE scores depend on distances.)"""
    hf, ours = pairs(arch)
    ids = token_ids(2, 12, seed=12)
    pos = torch.tensor([[0, 1, 2, 3, 40, 41, 90, 150, 151, 200, 230, 250],
                        [5, 6, 7, 8, 9, 10, 11, 100, 101, 102, 180, 181]])
    ref = hf_logits(hf, ids, position_ids=pos)
    cache = KVCache.for_model(ours.config, 2, 12, torch.float32)
    logits, _ = ours.model(ids, pos, cache)
    assert max_diff(logits, ref) <= TOL
    # guard: the gaps matter, contiguous positions give different logits
    assert max_diff(logits, hf_logits(hf, ids)) > 1e-3


def test_linear_rope_scaling_matches_hf(tmp_path):
    d = make_hf_dir(tmp_path / "lin", "llama", tokenizer=False,
                    rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0})
    hf, ours = load_pair(d)
    assert ours.config.rope_scaling["rope_type"] == "linear"
    ids = token_ids(2, 16, seed=13)
    pos = torch.cat([positions(2, 0, 8), positions(2, 60, 68)], dim=1)
    cache = KVCache.for_model(ours.config, 2, 16, torch.float32)
    logits, _ = ours.model(ids, pos, cache)
    assert max_diff(logits, hf_logits(hf, ids, position_ids=pos)) <= TOL


@pytest.mark.parametrize("arch, legacy", [
    ("llama3", {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                          "original_max_position_embeddings": 64}}),
    ("llama3", {"rope_theta": 500000.0, "rope_scaling": {"type": "llama3", "factor": 8.0,
                                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                          "original_max_position_embeddings": 64}}),
    ("qwen2", {"rope_theta": 1000000.0}),
])
def test_transformers4_config_layout(arch, legacy, tiny_dirs, tmp_path, pairs):
    """config.json as transformers 4.x writes it (top-level rope_theta, rope_scaling) loads the same model."""
    import json
    import shutil

    d = shutil.copytree(tiny_dirs[arch], tmp_path / arch)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["rope_parameters"]
    cfg.update(legacy)
    (d / "config.json").write_text(json.dumps(cfg))
    ours = load(str(d), torch.float32, "cpu")
    hf, _ = pairs(arch)  # the reference: HF with the original (5.x layout) config
    ids = token_ids(1, 12, seed=14)
    pos = torch.tensor([[0, 1, 2, 3, 40, 41, 90, 150, 151, 200, 230, 250]])
    cache = KVCache.for_model(ours.config, 1, 12, torch.float32)
    logits, _ = ours.model(ids, pos, cache)
    assert max_diff(logits, hf_logits(hf, ids, position_ids=pos)) <= TOL


def test_num_logits_zero_returns_no_rows(pairs):
    _, ours = pairs("qwen2")
    cache = KVCache.for_model(ours.config, 1, 5, torch.float32)
    logits, _ = ours.model(token_ids(1, 5), positions(1, 0, 5), cache, num_logits=0)
    assert logits.shape == (1, 0, ours.config.vocab_size)


@pytest.mark.parametrize("arch, overrides", [
    ("llama", dict(attention_bias=True, mlp_bias=True)),  # q/k/v/o and MLP biases
    ("qwen3", dict(attention_bias=True)),
    ("mistral", dict(head_dim=32)),  # head_dim != hidden/heads (Mistral-Nemo style)
    ("llama", dict(num_key_value_heads=1)),  # MQA
    ("qwen2", dict(num_key_value_heads=4)),  # no GQA
])
def test_config_variants_match_hf(arch, overrides, tmp_path):
    d = make_hf_dir(tmp_path / arch, arch, seed=5, tokenizer=False, **overrides)
    hf, ours = load_pair(d)
    has_bias = any(k.endswith(".bias") for k in hf.state_dict())
    assert has_bias == (arch == "qwen2" or any("bias" in k for k in overrides))
    assert ours.config.num_kv_heads == hf.config.num_key_value_heads
    ids = token_ids(2, 10, seed=15)
    ref = hf_logits(hf, ids)
    cache = KVCache.for_model(ours.config, 2, 10, torch.float32)
    logits, _ = ours.model(ids[:, :7], positions(2, 0, 7), cache)
    assert max_diff(logits, ref[:, :7]) <= TOL
    for t in range(7, 10):
        logits, _ = ours.model(ids[:, t:t + 1], positions(2, t, t + 1), cache)
        assert max_diff(logits, ref[:, t:t + 1]) <= TOL
