"""The batched forward on a paged KV cache (Transformer.forward_paged): several sequences' prefill chunks, decodes
and verify chunks in one call. Each row's logits must not depend on what else the call carries: bitwise with
native GGUF matrices in bf16 (csrc decoder_layer_paged), and there also bitwise the single-sequence decode path
(decoder_layer_quantized) for the same cached keys; the per-op path (float32) agrees with the contiguous cache."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from tiny import make_hf_model
from verispec import LLM, kernels
from verispec.errors import VerispecError
from verispec.models.kv_cache import KVCache, PagedBatch, PagedKVCache

sys.path.insert(0, str(Path(__file__).parent))
from gguf_tiny import write_gguf  # noqa: E402

DIMS = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
TYPES = {"attn_q.weight": Q.Q4_K, "attn_k.weight": Q.Q6_K, "attn_v.weight": Q.Q8_0, "attn_output.weight": Q.Q8_0,
         "ffn_gate.weight": Q.Q4_K, "ffn_up.weight": Q.Q6_K, "ffn_down.weight": Q.Q4_K, "output.weight": Q.Q6_K,
         "token_embd.weight": Q.Q8_0}
BLOCK = 4
# per sequence, the chunks it feeds in turn: a prefill (split in two for the third), decodes, verify chunks
SCHEDULES = [
    [list(range(3, 14)), [20], [21, 22, 23], [24]],
    [[7, 8, 9, 10, 11], [30, 31], [32], [33, 34, 35, 36, 37]],
    [list(range(40, 60)), list(range(60, 63)), [70], [71, 72]],
]


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    if not kernels.available():
        pytest.skip("C++ kernels not built")
    path = tmp_path_factory.mktemp("paged") / "target.gguf"
    write_gguf(path, "qwen2", make_hf_model("qwen2", seed=3, **DIMS), TYPES, seed=4, kquant_scale=2.0)
    return LLM(target=str(path), dtype="bfloat16", weights="native", progress=False).target.model


def run(model, steps: list[list[int]], tables: list[list[int]], cache: PagedKVCache) -> dict:
    """Feed ``steps`` (each a list of sequence indices: their next chunk goes into that forward) -> {(seq, chunk):
    logits [rows, V]}."""
    fed, out = [0] * len(SCHEDULES), {}
    for step in steps:
        chunks, ids = [], []
        for s in step:
            chunk = SCHEDULES[s][fed[s]]
            start = sum(len(c) for c in SCHEDULES[s][:fed[s]])
            chunks.append((len(chunk), start, tables[s]))
            ids += chunk
        logits, _ = model.forward_paged(torch.tensor(ids), PagedBatch(chunks), cache)
        row = 0
        for s in step:
            n = len(SCHEDULES[s][fed[s]])
            out[s, fed[s]] = logits[row:row + n]
            row, fed[s] = row + n, fed[s] + 1
    return out


def tables_for(interleaved: bool) -> list[list[int]]:
    """Block tables of 8 blocks per sequence: disjoint, interleaved across sequences or not."""
    return [[b * 3 + s if interleaved else s * 8 + b for b in range(8)] for s in range(3)]


def test_each_row_is_the_same_alone_or_batched_bitwise(native):
    cfg = native.config
    alone = {}
    for s in range(3):  # each sequence on its own cache, one chunk per forward
        cache = PagedKVCache.for_model(cfg, 24, BLOCK, torch.bfloat16)
        res = run(native, [[s]] * len(SCHEDULES[s]), tables_for(False), cache)
        alone.update(res)
    cache = PagedKVCache.for_model(cfg, 24, BLOCK, torch.bfloat16)
    # sequences at different phases share forwards: prefill chunks next to decodes and verify chunks
    batched = run(native, [[0, 1], [0, 2], [1, 2, 0], [2, 1], [0, 1, 2]], tables_for(True), cache)
    assert batched.keys() == alone.keys()
    for key in alone:
        assert torch.equal(batched[key], alone[key]), key
    # the check can fail: the same token one position off, or read against another sequence's keys, differs
    table = tables_for(True)[0]
    shifted, _ = native.forward_paged(torch.tensor([20]), PagedBatch([(1, 10, table)]), cache)
    assert not torch.equal(shifted, alone[0, 1])
    other, _ = native.forward_paged(torch.tensor([20]), PagedBatch([(1, 11, tables_for(True)[2])]), cache)
    assert not torch.equal(other, alone[0, 1])


def test_decode_rows_are_the_single_sequence_path_bitwise(native):
    """A short prompt (<= 16 tokens: one fused call) and decodes on a contiguous cache give the same logits as the
    paged forward, in a batch with another sequence."""
    cfg = native.config
    prompt, decodes = [5, 9, 2, 7, 1, 8], [[11], [12, 13, 14], [15]]
    cache = KVCache.for_model(cfg, 1, 32, torch.bfloat16)
    want, pos = [], 0
    for chunk in [prompt, *decodes]:
        ids = torch.tensor([chunk])
        logits, _ = native(ids, torch.arange(pos, pos + len(chunk))[None], cache)
        want.append(logits[0])
        pos += len(chunk)
    paged = PagedKVCache.for_model(cfg, 16, BLOCK, torch.bfloat16)
    other = list(range(90, 99))  # another sequence's prefill shares the first forward
    mine, theirs = [1, 4, 6, 8, 10], [0, 2, 3]
    logits, _ = native.forward_paged(torch.tensor(prompt + other), PagedBatch([(6, 0, mine), (9, 0, theirs)]), paged)
    got, pos = [logits[:6]], 6
    for chunk in decodes:
        logits, _ = native.forward_paged(torch.tensor(chunk), PagedBatch([(len(chunk), pos, mine)]), paged)
        got.append(logits)
        pos += len(chunk)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_per_op_path_matches_the_contiguous_cache(tmp_path):
    """float32 weights: the per-op paged path (attention a row at a time) against the model's own forward."""
    from tiny import make_hf_dir
    make_hf_dir(tmp_path / "m", "qwen2", seed=2)
    model = LLM(target=str(tmp_path / "m"), dtype="float32", progress=False).target.model
    prompt, decodes = list(range(3, 23)), [[40], [41, 42, 43]]
    cache = KVCache.for_model(model.config, 1, 40, torch.float32)
    want, pos = [], 0
    for chunk in [prompt, *decodes]:
        logits, _ = model(torch.tensor([chunk]), torch.arange(pos, pos + len(chunk))[None], cache)
        want.append(logits[0])
        pos += len(chunk)
    paged = PagedKVCache.for_model(model.config, 12, BLOCK, torch.float32)
    table, got, pos = [11, 3, 7, 0, 5, 9, 2], [], 0
    for chunk in [prompt, *decodes]:
        logits, hidden = model.forward_paged(torch.tensor(chunk), PagedBatch([(len(chunk), pos, table)]), paged,
                                             hidden_layers=(1,))
        got.append(logits)
        assert hidden[1].shape == (len(chunk), model.config.hidden_size)
        pos += len(chunk)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def test_logit_rows_and_bad_batches(native):
    cache = PagedKVCache.for_model(native.config, 8, BLOCK, torch.bfloat16)
    batch = PagedBatch([(3, 0, [0]), (2, 0, [1])])
    full, _ = native.forward_paged(torch.tensor([1, 2, 3, 4, 5]), batch, cache)
    some, _ = native.forward_paged(torch.tensor([1, 2, 3, 4, 5]), batch, cache, logit_rows=torch.tensor([2, 4]))
    assert torch.equal(some, full[[2, 4]])
    with pytest.raises(VerispecError):
        PagedBatch([])
    with pytest.raises(VerispecError):
        PagedBatch([(2, 0, [])])
    with pytest.raises(RuntimeError, match="block id"):  # block 9 is not in an 8-block cache
        native.forward_paged(torch.tensor([1, 2]), PagedBatch([(2, 0, [9])]), cache)
