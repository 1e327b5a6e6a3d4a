"""Native GGUF weights: models/gguf_native.py's decoding and csrc/linear_gguf.cpp's arithmetic,
then GGUF files loaded with ``weights="native"``.

The kernel's contract (header of csrc/linear_gguf.cpp), checked here against float64 references built
from gguf-py's own dequantization of the raw blocks (not from gguf_native.dequantize):
- each activation row is cut into the blocks of gn.blocks(K) (512s, then 256, 128) and each quantized to int8 with
  s_b = max|x_b| / 127 (1 for an all-zero block), q = round-half-even(x / s_b) in float32;
- against the float64 product over those rounded activations (x_hat = q * s_b) the error is fp32
  accumulation only (measured ~2e-8 of sum |W| |x_hat|; tolerance 1e-5, see TIGHT);
- against the exact float64 product the error is at most sum_b (s_b / 2) sum_{k in b} |W[n, k]| plus fp32
  accumulation, and an adversarial row reaches ~98% of that bound (so half of it would be wrong);
- a row's output is bitwise the same whatever else is in the call; AVX512 and portable paths agree bitwise.
Negative controls: references with a classic kernel bug (no activation rounding, Q4_K/Q5_K min dropped,
symmetric offset off by one) must fail the same check; loaders with a classic bug (q/k/v parts in the
wrong order, llama Q/K rows left permuted) must fail the loader checks.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize

from exact_helpers import bf16_bits, special_bias
from gguf_tiny import fake_registry, random_kquant, write_gguf
from tiny import make_hf_dir, make_hf_model
from verispec import LLM, kernels
from verispec.draft_vocab import save_table
from verispec.errors import VerispecError
from verispec.models import gguf_native as gn
from verispec.models.kv_cache import KVCache
from verispec.models.linear import Linear
from verispec.models.loader import load

pytestmark = pytest.mark.skipif(not kernels.available(), reason="C++ kernels not built")

TYPES = list(gn.KINDS)  # Q8_0 Q4_0 Q5_0 Q4_K Q5_K Q6_K
SYMMETRIC = ("Q8_0", "Q4_0", "Q5_0")
Q_MAX = {"Q8_0": 256, "Q4_0": 16, "Q5_0": 32, "Q4_K": 16, "Q5_K": 32, "Q6_K": 64}  # q < this
SCALE_BYTES = {"Q4_K": 20, "Q5_K": 20, "Q6_K": 18}  # per block; symmetric types: 2 per group of 32
MIXED = (("Q4_K", 8), ("Q6_K", 6), ("Q8_0", 10))  # one matrix, three segments (like fused q/k/v)
MS = (1, 2, 3, 5, 8, 16, 17)
# fp32 accumulation, relative to sum |W| |x_hat| (measured ~2e-8 typically, up to ~1.5e-6 on random K-quant
# blocks, whose s * q and min terms are each larger than w and cancel in a lane's 32-product sum)
TIGHT = 1e-5
BF16_ROUND = 2.0 ** -8  # bf16 output: half an ulp, relative


def ks(t: str) -> tuple[int, ...]:
    """K values to test: blocks of 256 + 128 (K = 384) and one of 512 (K = 512); K-quants need multiples of 256."""
    return (512,) if t in gn.K_QUANTS else (384, 512)


# --- raw GGUF blocks ---------------------------------------------------------------------------------

def random_raw(t: str, N: int, K: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes in every field (all q patterns, e.g. Q8_0's -128 that no quantizer writes), fp16
    scales finite, small and of either sign: [N, bytes]."""
    block, size = GGML_QUANT_SIZES[Q[t]]
    n = N * (K // block)
    raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)

    def f16(lo, hi):
        v = rng.uniform(lo, hi, n) * rng.choice([-1.0, 1.0], n)
        return v.astype(np.float16).view(np.uint8).reshape(n, 2)

    if t in SYMMETRIC:
        raw[:, 0:2] = f16(1e-3, 1e-2)
    elif t in ("Q4_K", "Q5_K"):
        raw[:, 0:2], raw[:, 2:4] = f16(1e-4, 3e-4), f16(1e-3, 3e-3)
    else:  # Q6_K: d last
        raw[:, -2:] = f16(1e-5, 3e-5)
    return raw.reshape(N, -1)


def file_raw(t: str, N: int, K: int, rng: np.random.Generator) -> np.ndarray:
    """What a file holds: gguf-py's quantizer where it has one, else gguf_tiny's random K-quant blocks."""
    if t in gn.K_QUANTS:
        return random_kquant(N, K, Q[t], rng)
    return quantize((rng.standard_normal((N, K)) * 0.05).astype(np.float32), Q[t])


def reference_weight(raw: np.ndarray, t: str, N: int, K: int) -> np.ndarray:
    """float64 [N, K] by gguf-py, independent of gguf_native."""
    return gguf_dequantize(raw, Q[t]).reshape(N, K).astype(np.float64)


def matrix(parts, K: int, seed: int, source=random_raw):
    """parts: ((type, rows), ...) stacked along N -> (NativeWeight, W float64 [N, K], raws)."""
    rng = np.random.default_rng(seed)
    raws = [source(t, n, K, rng) for t, n in parts]
    segs = [gn.pack(*gn.decode(r, t, n, K), t) for r, (t, n) in zip(raws, parts)]
    W = np.concatenate([reference_weight(r, t, n, K) for r, (t, n) in zip(raws, parts)])
    return gn.NativeWeight.from_segments(segs, K), W, raws


def parts_of(name: str) -> tuple:
    return MIXED if name == "mixed" else ((name, 10),)


def activations(M: int, K: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    """Gaussian rows, plus the edge cases: an all-zero block (scale 1) and one huge outlier."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * torch.exp(torch.randn(M, 1, generator=g))
    bl = gn.blocks(K)
    x[0, :bl[0][1] if len(bl) > 1 else K // 2] = 0.0  # a whole block where the row has several
    if M > 1:
        x[1, K // 3] = 300.0
    return x.to(dtype)


def linear(x, nw, bias=None):
    return kernels.ops.linear_gguf(x, *nw.tensors, bias)


# --- the float64 models of the kernel ---------------------------------------------------------------

def rounded_activations(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """The stated activation rounding, in float32 as the kernel does it -> (x_hat [M, K] float64, s [M, K/B])."""
    M, K = x.shape
    xf = x.float().numpy()
    x_hat, scales = np.zeros((M, K)), []
    for k0, B in gn.blocks(K):
        xb = xf[:, k0:k0 + B]
        amax = np.abs(xb).max(-1)
        s = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)  # [M]
        inv = (np.float32(1) / s).astype(np.float32)
        q = np.clip(np.rint(xb * inv[:, None]), -127, 127)  # float32 product, ties to even
        x_hat[:, k0:k0 + B] = q.astype(np.float64) * s[:, None]
        scales.append(s.astype(np.float64))
    return x_hat, np.stack(scales, axis=1)  # [M, K], [M, nb]


def activation_bound(s: np.ndarray, W: np.ndarray) -> np.ndarray:
    """[M, N]: sum_b (s_b / 2) sum_{k in b} |W[n, k]|, the worst case of the activation rounding."""
    wsum = np.stack([np.abs(W[:, k0:k0 + B]).sum(-1) for k0, B in gn.blocks(W.shape[1])], axis=1)  # [N, nb]
    return (s / 2) @ wsum.T


def excess(y: torch.Tensor, ref: np.ndarray, tol: np.ndarray) -> float:
    """max(|y - ref| - tol): <= 0 when y is within tolerance everywhere."""
    return float((np.abs(y.double().numpy() - ref) - tol).max())


def tight_check(y, x, W, bias, ref_W=None, exact_acts=False) -> float:
    """excess of y over the emulation (x_hat @ W^T + bias); ref_W / exact_acts make deliberately wrong references."""
    x_hat, _ = rounded_activations(x)
    xr = x.double().numpy() if exact_acts else x_hat
    Wr = W if ref_W is None else ref_W
    b = 0.0 if bias is None else bias.double().numpy()
    ref = xr @ Wr.T + b
    tol = TIGHT * (np.abs(x_hat) @ np.abs(W).T + np.abs(b)) + 1e-30
    if y.dtype == torch.bfloat16:
        tol = tol + BF16_ROUND * np.abs(ref)
    return excess(y, ref, tol)


def bound_check(y, x, W, bias, factor=1.0) -> float:
    """excess of y over the exact float64 product, allowed factor * the activation bound + fp32 accumulation."""
    _, s = rounded_activations(x)
    b = 0.0 if bias is None else bias.double().numpy()
    xd = x.double().numpy()
    ref = xd @ W.T + b
    tol = factor * activation_bound(s, W) + TIGHT * (np.abs(xd) @ np.abs(W).T + np.abs(b)) + 1e-30
    if y.dtype == torch.bfloat16:
        tol = tol + BF16_ROUND * (np.abs(ref) + activation_bound(s, W))
    return excess(y, ref, tol)


@pytest.fixture(params=["auto", "avx2", "portable"])
def isa(request):
    """Every code path: the fastest this CPU has, AVX2 (what machines without AVX512-VNNI run) and
    "portable", the CPU feature fallback (plain C++)."""
    if request.param not in ("auto", *kernels.cpu_isas()):
        pytest.skip(f"this CPU cannot run the {request.param} path ({kernels.cpu_isas()})")
    kernels.set_isa(request.param)
    try:
        if request.param != "auto":
            assert kernels.isa().endswith(request.param)
        yield request.param
    finally:
        kernels.set_isa("auto")


# --- 1. decoding -------------------------------------------------------------------------------------

@pytest.mark.parametrize("source", ["random_bytes", "file"])
@pytest.mark.parametrize("t", TYPES)
def test_decode_then_dequantize_is_gguf_dequantize_exactly(t, source):
    rng = np.random.default_rng(1)
    for N in (6, 10):
        for K in ks(t):
            raw = (random_raw if source == "random_bytes" else file_raw)(t, N, K, rng)
            q, scales = gn.decode(raw, t, N, K)
            shape = (N, K // 256, SCALE_BYTES[t]) if t in SCALE_BYTES else (N, K // 32, 2)
            assert q.shape == (N, K) and q.dtype == np.uint8 and int(q.max()) < Q_MAX[t]
            assert scales.shape == shape and scales.dtype == np.uint8
            assert np.array_equal(gn.dequantize(q, scales, t), reference_weight(raw, t, N, K)), (t, N, K)


def test_decode_reads_every_field():
    """Guard for the test above: one flipped bit anywhere in a block changes exactly that block's weights."""
    rng = np.random.default_rng(2)
    for t in TYPES:
        K = 256
        raw = random_raw(t, 2, K, rng)
        base = gn.dequantize(*gn.decode(raw, t, 2, K), t)
        block, size = GGML_QUANT_SIZES[Q[t]]
        for byte in range(size):
            flipped = raw.copy()
            flipped[1, byte] ^= 0x01
            w = gn.dequantize(*gn.decode(flipped, t, 2, K), t)
            assert np.array_equal(w, reference_weight(flipped, t, 2, K)), (t, byte)
            changed = np.nonzero((w != base).any(0))[0]
            assert np.array_equal(w[0], base[0]) and changed.size and changed.max() < block, (t, byte)


def test_supported_and_blocks():
    sizes = {K: [B for _, B in gn.blocks(K)] for K in (128, 256, 384, 512, 896, 1536, 8960)}
    assert sizes == {128: [128], 256: [256], 384: [256, 128], 512: [512], 896: [512, 256, 128],
                     1536: [512] * 3, 8960: [512] * 17 + [256]}
    assert all(sum(b) == K for K, b in sizes.items())
    for t in TYPES:
        assert gn.supported(t, 512) and gn.supported(t, 1536)
        assert not gn.supported(t, 200) and not gn.supported(t, 320)  # K % 128 != 0
        assert gn.supported(t, 384) == (t in SYMMETRIC)  # K-quants need K % 256 == 0
    for t in ("F16", "F32", "BF16", "Q4_1", "Q5_1", "Q2_K", "Q3_K", "IQ4_NL"):
        assert not gn.supported(t, 512), t


# --- 2. kernel vs float64 ----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", TYPES + ["mixed"])
def test_kernel_matches_float64_references(isa, name, dtype):
    for K in ks(name) if name != "mixed" else (512,):
        nw, W, _ = matrix(parts_of(name), K, seed=K + len(name))
        N = W.shape[0]
        x = activations(max(MS), K, seed=3, dtype=dtype)
        bias = torch.randn(N, generator=torch.Generator().manual_seed(4))
        for M in MS:
            for b in (None, bias):
                y = linear(x[:M], nw, b)
                assert y.shape == (M, N) and y.dtype == dtype
                assert torch.isfinite(y).all()
                assert tight_check(y, x[:M], W, b) <= 0, (name, K, M, b is not None)
                assert bound_check(y, x[:M], W, b) <= 0, (name, K, M, b is not None)
        if dtype == torch.bfloat16:  # the same numbers as the fp32 call, rounded once at the end
            assert torch.equal(linear(x, nw, bias), linear(x.float(), nw, bias).to(torch.bfloat16))


@pytest.mark.parametrize("name", TYPES)
def test_negative_control_wrong_references_fail_the_tight_check(name):
    """The tight check tells the stated arithmetic from near misses a kernel could make."""
    K = 512
    nw, W, raws = matrix(parts_of(name), K, seed=7)
    x = activations(8, K, seed=8)
    y = linear(x, nw)
    assert tight_check(y, x, W, None) <= 0
    # no activation rounding: the kernel's error is ~1e-3 of the scale, far above fp32 accumulation
    assert tight_check(y, x, W, None, exact_acts=True) > 0
    q, scales = gn.decode(raws[0], name, W.shape[0], K)
    if name in ("Q4_K", "Q5_K"):  # w = s q - m with the min dropped
        assert np.abs(min_term(scales, name)).max() > 0
        wrong = W + min_term(scales, name)
    else:  # w = s (q - c) with c off by one
        c = gn.SYMMETRIC_SHIFT[name]
        s = group_scale(scales, name, K)
        assert np.array_equal(s * (q.astype(np.float64) - c), W)  # the control's own model is right
        wrong = s * (q.astype(np.float64) - (c - 1))
    assert not np.array_equal(wrong, W)
    assert tight_check(y, x, W, None, ref_W=wrong) > 0


def group_scale(scales: np.ndarray, t: str, K: int) -> np.ndarray:
    """[N, K] float64: the scale s of each weight's group, from decode's scale bytes."""
    N = scales.shape[0]
    if t == "Q6_K":
        d = scales[..., 0:2].copy().view(np.float16).astype(np.float64)
        return np.repeat(d * scales[..., 2:18].view(np.int8), 16, axis=-1).reshape(N, K)
    d = scales.copy().view(np.float16).astype(np.float64)
    return np.repeat(d, 32, axis=-1).reshape(N, K)


def min_term(scales: np.ndarray, t: str) -> np.ndarray:
    """[N, K] float64: Q4_K / Q5_K's m = dmin * mn per group of 32."""
    N, nb = scales.shape[:2]
    dmin = scales[..., 2:4].copy().view(np.float16).astype(np.float64)
    return np.repeat(dmin * scales[..., 12:20], 32, axis=-1).reshape(N, nb * 256)


@pytest.mark.parametrize("name", TYPES + ["mixed"])
def test_activation_bound_is_reached_by_an_adversarial_row(name):
    """Each activation sits 0.49 s_b off its rounded value, on the side of sign(W[0, k]): output row 0's
    error is ~98% of the stated bound, inside it, and over half of it (a bound with half the activation
    term would be wrong: the negative control)."""
    K = 512
    nw, W, _ = matrix(parts_of(name), K, seed=9)
    (_, B), = gn.blocks(K)
    rng = np.random.default_rng(10)
    sb = 2.0 ** -rng.integers(3, 9, K // B)  # powers of two: s_b = max|x_b| / 127 exactly in float32
    q = rng.integers(0, 121, K).astype(np.float64)
    x = np.sign(W[0]) * (q + 0.49) * np.repeat(sb, B)
    x[::B] = 127 * sb * np.where(W[0, ::B] < 0, -1, 1)  # each block's max: exactly 127 s_b
    x = torch.from_numpy(x.astype(np.float32))[None]
    y = linear(x, nw)
    x_hat, s = rounded_activations(x)
    assert np.array_equal(s[0], sb)
    err = abs(y[0, 0].item() - float(x.double().numpy()[0] @ W[0]))
    bound = activation_bound(s, W)[0, 0]
    assert 0.9 * bound < err <= bound * (1 + 1e-4), (err, bound)
    assert bound_check(y, x, W, None) <= 0
    assert bound_check(y, x, W, None, factor=0.5) > 0


@pytest.mark.parametrize("K,parts", [(896, (("Q8_0", 37), ("Q5_0", 29))),  # Qwen2.5-0.5B's hidden: B = 128
                                     (1536, (("Q4_K", 21), ("Q6_K", 11), ("Q5_K", 7), ("Q4_0", 5)))])
def test_kernel_at_model_shapes(K, parts):
    """Many blocks per row (7 and 6), many tiles, odd segment sizes: both paths, every row count."""
    nw, W, _ = matrix(parts, K, seed=K)
    x = activations(17, K, seed=21)
    full = linear(x, nw)
    assert tight_check(full, x, W, None) <= 0 and bound_check(full, x, W, None) <= 0
    for M in (1, 2, 5, 16):
        assert torch.equal(linear(x[:M], nw), full[:M]), M
    kernels.force_portable(True)
    try:
        portable = linear(x, nw)
    finally:
        kernels.force_portable(False)
    assert tight_check(portable, x, W, None) <= 0
    if kernels.fast():
        assert torch.equal(portable, full)


def test_zero_rows_non_contiguous_x_and_bf16_bias():
    nw, W, _ = matrix((("Q4_K", 8),), 512, seed=22)
    assert linear(torch.randn(0, 512), nw).shape == (0, 8)
    x = torch.randn(512, 6).t()  # a transposed view
    assert not x.is_contiguous() and torch.equal(linear(x, nw), linear(x.contiguous(), nw))
    bias = torch.randn(8).bfloat16()
    y = linear(x.bfloat16(), nw, bias)
    assert y.dtype == torch.bfloat16 and tight_check(y, x.bfloat16(), W, bias) <= 0


# --- 3. batch invariance, 4. portable path -----------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", TYPES + ["mixed"])
def test_rows_do_not_depend_on_the_rest_of_the_call(name, dtype):
    K = 512
    nw, _, _ = matrix(parts_of(name), K, seed=11)
    x = activations(33, K, seed=12, dtype=dtype)
    full = linear(x, nw)  # [33, N]
    assert (full != 0).any(1).all() and len({tuple(r.tolist()) for r in full.float()}) == 33  # live rows
    for M in [*range(1, 18), 33]:
        for start in (0, 1, 2) if M <= 31 else (0,):
            assert torch.equal(linear(x[start:start + M], nw), full[start:start + M]), (M, start)
    others = activations(9, K, seed=13, dtype=dtype)
    for i in range(33):
        assert torch.equal(linear(x[i:i + 1], nw), full[i:i + 1]), i
        mixed = torch.cat([others[: i % 9], x[i:i + 1], others[i % 9:]])  # row i at position i % 9 of 10
        assert torch.equal(linear(mixed, nw)[i % 9], full[i]), i
    # leading dimensions are rows too
    assert torch.equal(linear(x[:32].reshape(4, 8, K), nw), full[:32].reshape(4, 8, -1))


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0"])
def test_bf16_activations_give_their_fp32_results_rounded_to_nearest_even(name):
    """The kernel writes bf16 results itself: each must be the fp32 result (the same activations in) rounded as
    .to() rounds; truncating, or rounding ties away, fails."""
    nw, _, _ = matrix(parts_of(name), 768, seed=19)
    x = activations(9, 768, seed=20, dtype=torch.bfloat16)
    bias = torch.randn(nw.out_features)
    y = linear(x, nw, bias)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, linear(x.float(), nw, bias).to(torch.bfloat16))


def test_nan_and_infinite_results_are_written_as_at_bfloat16_writes_them():
    """A NaN bias gives NaN results: in bf16 each must be 0x7FC0 (plain rounding of a 0x7FFFFFFF NaN gives
    0x8000, -0.0), infinities stay infinite, in the four-column stores and in a partial last tile."""
    nw, _, _ = matrix([("Q4_K", 37), ("Q6_K", 29)], 768, seed=21)  # each segment ends in a one-row tile
    x = activations(5, 768, seed=22, dtype=torch.bfloat16)
    bias = special_bias(nw.out_features)
    y, y32 = linear(x, nw, bias), linear(x.float(), nw, bias)
    assert y32.isnan().sum() == 5 * 3 and y32.isinf().sum() == 5 * 2
    assert torch.equal(y.view(torch.int16), bf16_bits(y32))


@pytest.mark.parametrize("name", ["Q4_K", "Q8_0"])
def test_long_inputs_in_row_blocks_give_each_row_its_own_result(name):
    """Prefill-length inputs run in blocks of rows (as many as fit ~256 KB of int8 activations: 16 rows at
    K = 16384), each block over every tile: rows in the second and third block, and a block of 1-3 rows at
    the end, must come out bitwise as they do alone."""
    K = 16384
    nw, W, _ = matrix(parts_of(name), K, seed=16)
    x = activations(38, K, seed=17)  # blocks of 16, 16 and 6 rows
    full = linear(x, nw)
    assert len({tuple(r.tolist()) for r in full}) == 38
    for i in (0, 15, 16, 17, 31, 32, 37):
        assert torch.equal(linear(x[i:i + 1], nw), full[i:i + 1]), i
    assert torch.equal(linear(x[:35], nw), full[:35])  # a last block of 3 rows
    assert bound_check(full, x, W, None) <= 1.0


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K"])
def test_every_tile_shape_gives_each_row_its_own_result(name):
    """csrc/linear_kquant.cpp runs Q4_K / Q6_K in tiles of 16 weight rows: 1-8 activation rows a pass (rows 9-16 in a
    second), over 4, 2 or 1 tiles at once (as many as the registers hold), a thread's range of tiles cut into those
    groups. 12 tiles, the last with 3 rows, give every grouping at 1 and 2 threads; each M = 1..16 must give every
    row bitwise its result alone, on every path this CPU has, and every path the portable one's."""
    K, N = 768, 16 * 11 + 3
    nw, W, _ = matrix(((name, N),), K, seed=23)
    x = activations(16, K, seed=24)
    bias = torch.randn(N)
    before = torch.get_num_threads()
    results = {}
    try:
        for path in ["portable", *(p for p in ("avx2", "avx512-vnni") if p in kernels.cpu_isas())]:
            kernels.set_isa("auto" if path == "avx512-vnni" else path)
            assert kernels.isa().endswith(path)
            for threads in (1, 2):
                torch.set_num_threads(threads)
                alone = torch.cat([linear(x[i:i + 1], nw, bias) for i in range(16)])
                for M in range(1, 17):
                    assert torch.equal(linear(x[:M], nw, bias), alone[:M]), (path, threads, M)
                results[path, threads] = alone
    finally:
        kernels.set_isa("auto")
        torch.set_num_threads(before)
    first = next(iter(results.values()))
    assert all(torch.equal(r, first) for r in results.values())
    assert tight_check(first, x, W, bias) <= 0


def test_rows_do_not_depend_on_the_thread_split():
    nw, _, _ = matrix((("Q4_K", 21), ("Q8_0", 19)), 512, seed=14)  # 11 tiles: split across threads
    x = activations(5, 512, seed=15)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = linear(x, nw)
        torch.set_num_threads(2)
        two = linear(x, nw)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@pytest.mark.parametrize("path", ["avx512-vnni", "avx2"])
@pytest.mark.parametrize("name", TYPES + ["mixed"])
def test_portable_path_agrees_with_the_vector_paths_bitwise(name, path):
    if path not in kernels.cpu_isas():
        pytest.skip(f"this CPU cannot run the {path} path ({kernels.cpu_isas()}); "
                    "test_kernel_matches_float64_references still checks the others")
    # every block size the activations are cut into (512, 256, 128; K-quants: 512, 256), and every row tiling
    # (M = 4: 4 x 4 tiles; 5, 9, 10: 5 x 4 tiles)
    K = 768 if any(t in SCALE_BYTES for t, _ in parts_of(name)) else 896
    nw, _, _ = matrix(parts_of(name), K, seed=16)
    sizes = (1, 2, 3, 4, 5, 9, 10, 16, 17)
    for dtype in (torch.float32, torch.bfloat16):
        x = activations(17, K, seed=17, dtype=dtype)
        # row 0 rounds exact halves (scale 1 in every block: max |x| = 127): ties go to even on both paths
        x[0] = ((torch.arange(K) % 7) - 3 + 0.5).to(dtype)
        x[0, [k0 for k0, _ in gn.blocks(K)]] = 127
        bias = torch.randn(nw.out_features)
        try:
            kernels.set_isa("avx2" if path == "avx2" else "auto")
            assert kernels.isa().endswith(path)
            fast = [linear(x[:M], nw, bias) for M in sizes]
            kernels.force_portable(True)
            assert "portable" in kernels.isa()
            slow = [linear(x[:M], nw, bias) for M in sizes]
        finally:
            kernels.set_isa("auto")
        for a, b in zip(fast, slow):
            assert torch.equal(a, b), (name, dtype, a.shape)


# where q bytes start and end in a block, by type (the rest: fp16 fields and K-quant scales)
Q_BYTES = {"Q8_0": (2, 34), "Q4_0": (2, 18), "Q5_0": (2, 22), "Q4_K": (16, 144), "Q5_K": (16, 176), "Q6_K": (0, 192)}


@pytest.mark.parametrize("path", ["avx512-vnni", "avx2"])
@pytest.mark.parametrize("name", TYPES)
def test_largest_products_do_not_overflow_the_vector_paths(name, path):
    """Every q at its largest (Q8_0: -128 and 127) against activations at +-127: the AVX2 path's int16 partial
    sums are then at their bound (4-bit: 8 chunks x 2 x 15 x 127 = 30480); one chunk more, or Q8_0 without its
    sign trick, would saturate and differ from the portable path and from float64."""
    if path not in kernels.cpu_isas():
        pytest.skip(f"this CPU cannot run the {path} path ({kernels.cpu_isas()})")
    K, N = 1024, 8
    block, size = GGML_QUANT_SIZES[Q[name]]
    lo, hi = Q_BYTES[name]
    raw = random_raw(name, N, K, np.random.default_rng(7)).reshape(N * (K // block), size)
    raw[:, lo:hi] = 0xFF
    if name == "Q8_0":  # rows 0-3: q = -128 everywhere (stored q bytes 0x80), rows 4-7: q = 127
        raw.reshape(N, -1, size)[:4, :, lo:hi] = 0x80
        raw.reshape(N, -1, size)[4:, :, lo:hi] = 0x7F
    raw = raw.reshape(N, -1)
    nw = gn.NativeWeight.from_segments([gn.pack(*gn.decode(raw, name, N, K), name)], K)
    W = reference_weight(raw, name, N, K)
    x = torch.full((4, K), 127.0)
    x[1] = -127.0
    x[2, ::2] = -127.0  # half the products negative
    x[3] = torch.where(torch.from_numpy(W[0]) < 0, -127.0, 127.0)  # every product of row 0 of one sign
    try:
        kernels.set_isa("avx2" if path == "avx2" else "auto")
        fast = linear(x, nw)
        kernels.force_portable(True)
        slow = linear(x, nw)
    finally:
        kernels.set_isa("auto")
    assert torch.equal(fast, slow)
    assert tight_check(fast, x, W, None) <= 0


# --- 5. bad inputs -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def q8_512():
    return matrix((("Q8_0", 8),), 512, seed=18)[0]


def test_bad_calls_are_refused(q8_512):
    nw = q8_512
    with pytest.raises(RuntimeError, match="x has 200 features, the weight 512"):
        linear(torch.randn(2, 200), nw)
    with pytest.raises(RuntimeError, match="x has 1024 features"):  # K larger than the packed matrix
        linear(torch.randn(2, 1024), nw)
    with pytest.raises(RuntimeError, match="bf16 or fp32"):
        linear(torch.randn(2, 512).half(), nw)
    kq = matrix((("Q4_K", 8),), 512, seed=19)[0]
    with pytest.raises(RuntimeError, match="x has 384 features"):
        linear(torch.randn(2, 384), kq)
    q, s, meta = kq.tensors
    bad = meta.clone()
    bad[0, 5] = 384  # a K-quant segment that claims K = 384
    with pytest.raises(RuntimeError, match="K % 256"):
        kernels.ops.linear_gguf(torch.randn(1, 384), q, s, bad, None)
    q, s, meta = nw.tensors
    bad = meta.clone()
    bad[0, 0] = 9
    with pytest.raises(RuntimeError, match="unknown kind"):
        kernels.ops.linear_gguf(torch.randn(1, 512), q, s, bad, None)
    bad = meta.clone()
    bad[0, 1] = 13  # 13 rows cannot live in 2 tiles of 4
    with pytest.raises(RuntimeError, match="tiles"):
        kernels.ops.linear_gguf(torch.randn(1, 512), q, s, bad, None)
    with pytest.raises(RuntimeError, match="uint8"):
        kernels.ops.linear_gguf(torch.randn(1, 512), q.view(torch.int8), s, meta, None)


@pytest.mark.parametrize("K", [256, 384, 128])
def test_x_with_a_smaller_k_than_the_weights_is_refused(q8_512, K):
    with pytest.raises(RuntimeError):
        linear(torch.randn(2, K), q8_512)


def test_a_bias_of_the_wrong_length_is_refused(q8_512):
    with pytest.raises(RuntimeError):
        linear(torch.randn(2, 512), q8_512, torch.randn(q8_512.out_features - 1))


def test_decode_refuses_bad_inputs():
    raw = random_raw("Q4_K", 4, 512, np.random.default_rng(20))
    with pytest.raises(ValueError):
        gn.decode(raw, "Q4_K", 4, 384)  # K-quant blocks are 256 wide: 384 is not whole blocks
    with pytest.raises(ValueError):
        gn.decode(raw[:3], "Q4_K", 4, 512)  # too few bytes
    with pytest.raises(ValueError):
        gn.decode(raw, "Q4_1", 4, 512)


def test_pack_refuses_a_k_quant_with_k_not_a_multiple_of_256():
    with pytest.raises(ValueError):
        gn.pack(np.zeros((4, 384), np.uint8), np.zeros((4, 3, 20), np.uint8), "Q4_K")


# --- 6. GGUF files loaded native ---------------------------------------------------------------------

DIMS = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
MODELS = {
    # Q4_K_M-like: every layer matrix native, fused q/k/v of three types, q/k/v biases
    "qwen2": dict(arch="qwen2", dims=DIMS, types={
        "attn_q.weight": Q.Q4_K, "attn_k.weight": Q.Q6_K, "attn_v.weight": Q.Q8_0, "attn_output.weight": Q.Q8_0,
        "ffn_gate.weight": Q.Q4_K, "ffn_up.weight": Q.Q6_K, "ffn_down.weight": Q.Q4_K, "output.weight": Q.Q6_K,
        "token_embd.weight": Q.Q8_0}),
    # llama: the converter permutes Q/K rows; native loading must undo it on the decoded rows
    "llama": dict(arch="llama", dims=DIMS, types={
        "attn_q.weight": Q.Q5_K, "attn_k.weight": Q.Q4_0, "attn_v.weight": Q.Q5_0, "attn_output.weight": Q.Q6_K,
        "ffn_gate.weight": Q.Q8_0, "ffn_up.weight": Q.Q4_K, "ffn_down.weight": Q.Q5_K, "output.weight": Q.Q8_0}),
    # fallbacks: an F16 q part (so all of q/k/v dequantized), a Q4_1 head (no kernel), down_proj with K = 320
    # (not a multiple of 128); the native rest has K = 384 (blocks of B = 128)
    "fallback": dict(arch="qwen2", dims=dict(hidden_size=384, intermediate_size=320, num_attention_heads=6,
                                             num_key_value_heads=2), types={
        "attn_q.weight": Q.F16, "attn_k.weight": Q.Q8_0, "attn_v.weight": Q.Q5_0, "attn_output.weight": Q.Q8_0,
        "ffn_gate.weight": Q.Q4_0, "ffn_up.weight": Q.Q5_0, "ffn_down.weight": Q.Q8_0, "output.weight": Q.Q4_1}),
}
NATIVE_TYPES = {  # module -> segment types a correct native load gives (None: dequantized)
    "qwen2": {"self_attn.qkv_proj": ["Q4_K", "Q6_K", "Q8_0"], "self_attn.o_proj": ["Q8_0"],
              "mlp.gate_up_proj": ["Q4_K", "Q6_K"], "mlp.down_proj": ["Q4_K"], "lm_head": ["Q6_K"]},
    "llama": {"self_attn.qkv_proj": ["Q5_K", "Q4_0", "Q5_0"], "self_attn.o_proj": ["Q6_K"],
              "mlp.gate_up_proj": ["Q8_0", "Q4_K"], "mlp.down_proj": ["Q5_K"], "lm_head": ["Q8_0"]},
    "fallback": {"self_attn.qkv_proj": None, "self_attn.o_proj": ["Q8_0"], "mlp.gate_up_proj": ["Q4_0", "Q5_0"],
                 "mlp.down_proj": None, "lm_head": None},
}
FUSED = {"self_attn.qkv_proj": ("q", "k", "v"), "mlp.gate_up_proj": ("gate", "up")}
LOGITS_REL = 0.1  # native vs dequantized logits, relative L2 over all positions (measured 0.015-0.05, see below)


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    """{name: (path, expected HF-layout weights)}. The HF weights are halved (hidden 256 instead of tiny.py's
    64: the same pre-activation scale) and the random K-quant blocks scaled by 1.5, so that the networks are
    lively (logits of std 0.7-1.5) without being chaotic."""
    root = tmp_path_factory.mktemp("native")
    out = {}
    for i, (name, spec) in enumerate(MODELS.items()):
        src = make_hf_model(spec["arch"], seed=30 + i, **spec["dims"])
        with torch.no_grad():
            for p in src.parameters():
                if p.dim() == 2:
                    p.mul_(0.5)
        path = root / f"{name}.gguf"
        out[name] = path, write_gguf(path, spec["arch"], src, spec["types"], seed=40 + i, kquant_scale=1.5)
    return out


@pytest.fixture(scope="module")
def loaded(ggufs):
    """{(name, weights, dtype): LoadedModel}, loaded lazily."""
    cache = {}

    def get(name, weights="native", dtype=torch.float32):
        key = name, weights, dtype
        if key not in cache:
            cache[key] = load(str(ggufs[name][0]), dtype, "cpu", progress=False, weights=weights)
        return cache[key]
    return get


def expected_matrix(expected: dict, layer: int | None, module: str) -> tuple[np.ndarray, np.ndarray | None]:
    """The float64 weight [N, K] (and bias) that module holds, in HF layout, fused parts concatenated."""
    if layer is None:
        return expected["lm_head.weight"].astype(np.float64), None
    p = f"model.layers.{layer}."
    names = [module.replace("qkv", x).replace("gate_up", x) for x in FUSED[module]] if module in FUSED else [module]
    W = np.concatenate([expected[p + n + ".weight"] for n in names]).astype(np.float64)
    biases = [expected.get(p + n + ".bias") for n in names]
    return W, None if biases[0] is None else np.concatenate(biases)


def modules(model, name: str):
    """(layer or None, module name, Linear) for every matrix NATIVE_TYPES describes."""
    for i, layer in enumerate(model.layers):
        for m in NATIVE_TYPES[name]:
            if m != "lm_head":
                yield i, m, layer.get_submodule(m)
    yield None, "lm_head", model.lm_head


def matrix_excess(lm, expected, name) -> float:
    """Worst tight_check excess over the native matrices of a loaded model (each vs its expected weight)."""
    worst = -np.inf
    x = activations(3, lm.config.hidden_size, seed=50)
    for layer, m, lin in modules(lm.model, name):
        if lin.native is None:
            continue
        W, b = expected_matrix(expected, layer, m)
        xi = x if W.shape[1] == x.shape[1] else activations(3, W.shape[1], seed=51)
        with torch.no_grad():
            y = lin(xi)
        worst = max(worst, tight_check(y, xi, W, None if b is None else torch.from_numpy(b)))
    return worst


@pytest.mark.parametrize("name", list(MODELS))
def test_native_load_keeps_the_intended_matrices_quantized(loaded, name):
    for dtype in (torch.float32, torch.bfloat16):
        lm = loaded(name, "native", dtype)
        for _, m, lin in modules(lm.model, name):
            want = NATIVE_TYPES[name][m]
            assert isinstance(lin, Linear)
            assert (lin.native.types if lin.native is not None else None) == want, (name, m)
            if want is not None:
                assert lin.weight is None and lin.native.out_features == lin.out_features
                assert lin.native.in_features == lin.in_features
                assert (lin.bias is None) == (lin.qbias is None)
        assert lm.model.embed_tokens.weight.dtype == dtype  # looked up, not multiplied: always dequantized
        assert lm.model.fused_quantized == (name != "fallback")
    plain = loaded(name, "dequantized").model
    assert not plain.fused_quantized
    assert all(m.native is None for m in plain.modules() if isinstance(m, Linear))


@pytest.mark.parametrize("name", list(MODELS))
def test_each_native_matrix_computes_its_gguf_weights(loaded, ggufs, name):
    """Every native matrix (fused parts in q, k, v / gate, up order, llama rows un-permuted, biases) against
    the emulation over the weights the file stands for: the tight, fp32-accumulation check."""
    assert matrix_excess(loaded(name), ggufs[name][1], name) <= 0
    # dequantized fallbacks (mixed fused parts included) are the file's weights bit for bit
    sd = loaded(name).model.dense_state_dict()
    for layer, m, lin in modules(loaded(name).model, name):
        if lin.native is None:
            W, _ = expected_matrix(ggufs[name][1], layer, m)
            key = "lm_head.weight" if layer is None else f"layers.{layer}.{m}.weight"
            assert torch.equal(sd[key], torch.from_numpy(W).float()), key


def test_negative_control_parts_in_the_wrong_order_are_caught(ggufs, monkeypatch):
    real = gn.NativeWeight.from_parts
    monkeypatch.setattr(gn.NativeWeight, "from_parts", classmethod(lambda cls, parts: real(parts[::-1])))
    lm = load(str(ggufs["qwen2"][0]), torch.float32, "cpu", progress=False, weights="native")
    assert matrix_excess(lm, ggufs["qwen2"][1], "qwen2") > 0
    assert logits_rel_error(lm, ggufs["qwen2"][0]) > LOGITS_REL


def test_negative_control_llama_rows_left_permuted_are_caught(ggufs, monkeypatch):
    from verispec.models import gguf as gguf_mod

    monkeypatch.setattr(gguf_mod, "_unpermute", lambda w, n_head: w)  # rows left as llama.cpp stores them
    lm = load(str(ggufs["llama"][0]), torch.float32, "cpu", progress=False, weights="native")
    assert matrix_excess(lm, ggufs["llama"][1], "llama") > 0


def model_logits(lm, ids: torch.Tensor) -> torch.Tensor:
    cache = KVCache.for_model(lm.config, ids.shape[0], ids.shape[1], lm.model.dtype)
    logits, _ = lm.model(ids, torch.arange(ids.shape[1]).expand(ids.shape[0], -1), cache)
    return logits.float()


IDS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error over all positions: ||a - b|| / ||b|| (a random network has a few chaotic positions
    where any perturbation, bf16 rounding included, moves the logits by 10-25%; the norm over all is stable)."""
    return ((a - b).norm() / b.norm()).item()


def logits_rel_error(lm, path, ids=IDS) -> float:
    ref = model_logits(load(str(path), torch.float32, "cpu", progress=False), ids)
    assert ref.std() > 0.5  # a lively model
    return rel(model_logits(lm, ids), ref)


def emulating(lm, native_names):
    """The dequantized fp32 model with the kernel's activation rounding (float64 emulation) in front of each
    matrix that the native load keeps native, and float64 products."""
    def forward(self, x):
        x2 = x.reshape(-1, x.shape[-1])
        x_hat, _ = rounded_activations(x2)
        y = x_hat @ self.dense_weight().double().numpy().T
        if self.bias is not None:
            y = y + self.bias.double().numpy()
        return torch.from_numpy(y).float().reshape(*x.shape[:-1], -1)

    for name, mod in lm.model.named_modules():
        if name in native_names:
            mod.forward = forward.__get__(mod)
    return lm


def fp32_noise_positions(a: torch.Tensor, b: torch.Tensor) -> float:
    """The fraction of positions whose logits agree to fp32 noise (relative error < 1e-5)."""
    e = (a - b).norm(dim=-1) / b.norm(dim=-1)
    return (e < 1e-5).float().mean().item()


@pytest.mark.parametrize("name", list(MODELS))
def test_native_model_is_the_file_with_int8_block_activations(loaded, ggufs, name):
    """End to end, fp32: the native model computes the dequantized model with every native matrix's input
    rounded as stated. Most positions agree to fp32 noise (measured median 1e-7 relative); at a few (here
    1 of 32) an activation sits on a rounding boundary, a 1e-7 difference upstream rounds it the other way,
    and that position and the later ones move by ~1e-3 (one rounding step, grown by the network). The
    plain dequantized model (no activation rounding: the negative control) matches at no position."""
    native = loaded(name)
    names = {n for n, m in native.model.named_modules() if isinstance(m, Linear) and m.native is not None}
    plain = model_logits(load(str(ggufs[name][0]), torch.float32, "cpu", progress=False), IDS)
    emulated = model_logits(emulating(load(str(ggufs[name][0]), torch.float32, "cpu", progress=False), names), IDS)
    got = model_logits(native, IDS)
    assert fp32_noise_positions(got, emulated) >= 0.5  # measured 19/32 and 31/32 (a flip carries on to later positions)
    assert rel(got, emulated) < 0.02
    assert fp32_noise_positions(got, plain) == 0.0


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_native_logits_are_close_to_the_dequantized_model(loaded, ggufs, name, dtype):
    """Native vs the same file dequantized in fp32: the only difference in fp32 is the int8 activations
    (per block of 256: rms rounding error ~0.6-1% of the block's rms at each of the 9 matrix inputs, grown
    by the random network), measured 1.5-5% relative; bf16 adds its own roundings (~0.4% each, measured
    1.5-2.5% for the dequantized model in bf16). A matrix with the wrong parts order is ~100% off (the
    negative control below)."""
    err = logits_rel_error(loaded(name, "native", dtype), ggufs[name][0])
    assert err < LOGITS_REL, err


def test_fused_native_layer_matches_the_python_layer(loaded):
    """bf16 + all matrices native: chunks of <= 16 tokens run each layer in one C++ call
    (csrc/decoder_layer.cpp, which dispatches native matrices to linear_gguf)."""
    model = loaded("qwen2", "native", torch.bfloat16).model
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(5))
    outs = {}
    for fused in (True, False):
        model.fused_quantized = fused
        try:
            cache = KVCache.for_model(model.config, 1, 30, torch.bfloat16)
            model(ids[:, :20], torch.arange(20)[None], cache)
            outs[fused] = torch.cat([model(ids[:, p:p + n], torch.arange(p, p + n)[None], cache)[0]
                                     for p, n in ((20, 1), (21, 6), (27, 3))], dim=1)
        finally:
            model.fused_quantized = True
    assert rel(outs[True], outs[False]) < 1e-3  # measured: 0.0 (bitwise equal)


def test_fused_native_layer_is_bitwise_the_same_on_every_path(loaded):
    """The fused layer's attention has an AVX512 path (attend_avx512: 16 keys' scores reduced side by side) next
    to plain loops cloned per ISA; native matrices give the same bits on every path, so the logits must too.
    Contexts of 21-45 tokens: whole blocks of 16 keys and the keys after them. A wrong key order in the blocks
    fails here; a one-rounding difference mostly does not survive the bf16 rounding of the attention output,
    so tests/unit/test_kernels.py compares the two attention paths before it."""
    if "avx512-vnni" not in kernels.cpu_isas():
        pytest.skip(f"no AVX512 path on this CPU ({kernels.cpu_isas()})")
    model = loaded("qwen2", "native", torch.bfloat16).model
    assert model.fused_quantized and model.config.head_dim % 16 == 0
    ids = torch.randint(0, 256, (1, 45), generator=torch.Generator().manual_seed(6))

    def run():
        cache = KVCache.for_model(model.config, 1, 45, torch.bfloat16)
        model(ids[:, :20], torch.arange(20)[None], cache)
        return torch.cat([model(ids[:, p:p + n], torch.arange(p, p + n)[None], cache)[0]
                          for p, n in ((20, 1), (21, 3), (24, 16), (40, 5))], dim=1)

    fast = run()
    try:
        kernels.force_portable(True)
        slow = run()
    finally:
        kernels.set_isa("auto")
    assert torch.equal(fast, slow)


def test_weights_option_is_checked_and_ignored_where_it_cannot_apply(loaded, ggufs, tmp_path, monkeypatch):
    path = str(ggufs["qwen2"][0])
    with pytest.raises(VerispecError, match="weights"):
        load(path, torch.float32, "cpu", progress=False, weights="bogus")
    with pytest.raises(VerispecError, match="weights"):
        LLM(target=path, weights="int3", progress=False)
    # native needs bf16/fp32 on CPU: float16 loads dequantized
    half = load(path, torch.float16, "cpu", progress=False, weights="native").model
    assert all(m.native is None for m in half.modules() if isinstance(m, Linear))
    # HF directories have no GGUF blocks: the option changes nothing
    hf_dir = make_hf_dir(tmp_path / "hf", "qwen2", tokenizer=False)
    hf = load(str(hf_dir), torch.float32, "cpu", progress=False, weights="native").model
    assert all(m.native is None for m in hf.modules() if isinstance(m, Linear))
    # a native matrix has no float copy to re-quantize or restrict: a clean error, not a crash
    with pytest.raises(VerispecError, match="native"):
        loaded("qwen2").model.lm_head.dense_weight()
    table = tmp_path / "half.draft-vocab"
    save_table(table, torch.arange(264), 264)
    with pytest.raises(VerispecError, match="native"):  # a native draft's LM head cannot be restricted
        LLM(target=path, draft=path, weights="native", draft_weights="native", draft_vocab=32,
            draft_vocab_table=str(table), progress=False)
    # a named draft's default head rows (registry draft_vocab_rows, here 32) apply to a dequantized draft; a
    # native one keeps its full head instead of failing
    from verispec import draft_vocab

    real = draft_vocab.head_ids_for

    def with_default(source, vocab_size, rows, table_path, always=()):
        return real(source, vocab_size, 32 if rows is None else rows, str(table), always)
    monkeypatch.setattr(draft_vocab, "head_ids_for", with_default)
    cut = LLM(target=path, draft=path, weights="native", draft_quant="none", progress=False)
    cut.draft_model()
    assert cut.draft_vocab_rows is not None and cut.draft_vocab_rows >= 32
    full = LLM(target=path, draft=path, weights="native", draft_weights="native", progress=False)
    full.draft_model()
    assert full.draft_vocab_rows is None


def test_named_model_native_reads_its_gguf_file(ggufs, monkeypatch, tmp_path):
    """load("<registry name>", weights="native") assembles the GGUF from its parts and reads it natively."""
    path, expected = ggufs["qwen2"]
    fake_registry(monkeypatch, tmp_path, path.read_bytes())
    lm = load("tiny-test", torch.float32, "cpu", progress=False, weights="native")
    assert lm.source == "tiny-test" and lm.model.fused_quantized
    assert lm.model.layers[1].mlp.down_proj.native.types == ["Q4_K"]
    assert matrix_excess(lm, expected, "qwen2") <= 0


def test_native_load_cache(ggufs, monkeypatch, tmp_path):
    """A native load keeps the re-laid-out blocks in $VERISPEC_CACHE/native: the next load reads them back
    (without parsing the GGUF file) and computes the same logits; a damaged entry is rebuilt; an entry of an
    older layout is neither read nor kept."""
    from verispec.models import gguf as gguf_mod
    from verispec.models.gguf_native import LAYOUT
    from verispec.models.loader import native_cache_dir

    monkeypatch.setenv("VERISPEC_NATIVE_CACHE", "1")
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    path = tmp_path / "tiny-llama-l1.gguf"  # "-l" in the name: not to be mistaken for a layout suffix
    shutil.copyfile(ggufs["qwen2"][0], path)
    cache = native_cache_dir(path, torch.bfloat16)
    stale = cache.with_name(cache.name.removesuffix(f"-l{LAYOUT}"))  # the same file in the layout before versions
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"blocks of another layout")
    first = load(str(path), torch.bfloat16, "cpu", progress=False, weights="native")
    assert (cache / "model.safetensors").is_file()
    assert not stale.exists()  # not read, and removed once the new entry is written
    real = gguf_mod.GGUFFile
    monkeypatch.setattr(gguf_mod, "GGUFFile", lambda *a, **k: pytest.fail("the cached load parsed the GGUF file"))
    second = load(str(path), torch.bfloat16, "cpu", progress=False, weights="native")
    assert second.model.fused_quantized and second.model.lm_head.native.types == ["Q6_K"]
    assert torch.equal(model_logits(first, IDS), model_logits(second, IDS))
    monkeypatch.setattr(gguf_mod, "GGUFFile", real)
    (cache / "model.safetensors").write_bytes(b"damaged")
    third = load(str(path), torch.bfloat16, "cpu", progress=False, weights="native")
    assert torch.equal(model_logits(first, IDS), model_logits(third, IDS))
    assert (cache / "model.safetensors").stat().st_size > 1000  # rewritten


def test_concurrent_native_loads_build_the_cache_once(ggufs, monkeypatch, tmp_path):
    """Two loads started at once (two commands on a fresh machine, the tests' parallel workers): one builds the
    cache entry while the other waits for it and reads it back, instead of both writing the same temporary
    files. Without registry.cache_lock both would build (two saves)."""
    import threading

    from verispec.models import loader

    monkeypatch.setenv("VERISPEC_NATIVE_CACHE", "1")
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    path = ggufs["qwen2"][0]
    saves, real_save = [], loader._save_native_cache
    monkeypatch.setattr(loader, "_save_native_cache", lambda *a: (saves.append(1), real_save(*a)))
    start, results = threading.Barrier(2), [None, None]

    def run(i):
        start.wait()
        results[i] = load(str(path), torch.bfloat16, "cpu", progress=False, weights="native")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(saves) == 1, f"{len(saves)} processes built the same cache entry"
    assert torch.equal(model_logits(results[0], IDS), model_logits(results[1], IDS))


def test_auto_weights_pick_native_only_where_it_is_fast(ggufs, tiny_dirs):
    """weights="auto" (the default): native for a GGUF file on CPU in bf16 with a vectorized kernel (AVX512-VNNI
    or AVX2); dequantized in float32, for HF directories, and where only the portable (plain C++) path exists."""
    path = str(ggufs["qwen2"][0])
    auto = load(path, torch.bfloat16, "cpu", progress=False, weights="auto")
    if not kernels.fast():
        pytest.skip(f"no AVX512-VNNI or AVX2 here ({kernels.isa()}): auto loads dequantized")
    assert auto.model.lm_head.native is not None
    assert load(path, torch.float32, "cpu", progress=False, weights="auto").model.lm_head.native is None
    hf = load(str(tiny_dirs["qwen2"]), torch.bfloat16, "cpu", progress=False, weights="auto")
    assert all(getattr(m, "native", None) is None for m in hf.model.modules())
    kernels.force_portable(True)
    try:
        assert load(path, torch.bfloat16, "cpu", progress=False, weights="auto").model.lm_head.native is None
    finally:
        kernels.force_portable(False)


def test_auto_dtype_is_float32_only_where_bf16_products_are_emulated(ggufs, tiny_dirs, monkeypatch):
    """dtype="auto" (the default): bf16 on a GPU, with bf16 matrix hardware, and for a native GGUF target; float32
    for dequantized weights on a CPU that emulates bf16 products, unless float32 would not fit in memory."""
    from verispec import LLM
    from verispec.models import linear, loader

    path, hf = str(ggufs["qwen2"][0]), str(tiny_dirs["qwen2"])
    monkeypatch.setattr(linear, "_FAST_BF16", False)  # a CPU without avx512_bf16 / AMX
    assert loader.auto_dtype(hf, "auto", "cpu") == torch.float32
    assert loader.auto_dtype(path, "dequantized", "cpu") == torch.float32
    assert loader.auto_dtype(path, "auto", "cpu") == (torch.bfloat16 if kernels.fast() else torch.float32)
    assert loader.auto_dtype(hf, "auto", "cuda") == torch.bfloat16
    llm = LLM(target=hf, draft=hf, progress=False)
    assert llm.dtype == torch.float32 and llm.target.model.lm_head.weight.dtype == torch.float32
    assert llm.draft.model.embed_tokens.weight.dtype == torch.float32

    # float32 weights over half the available memory: bf16 instead
    from safetensors.torch import load_file

    need = loader.float32_bytes(hf)
    assert need == 4 * sum(t.numel() for f in Path(hf).glob("*.safetensors") for t in load_file(f).values()) > 0
    assert loader.float32_bytes(path) == 4 * sum(t.size for t in ggufs["qwen2"][1].values())
    monkeypatch.setattr(loader, "available_memory", lambda: 2 * need - 1)
    assert loader.auto_dtype(hf, "auto", "cpu") == torch.bfloat16
    monkeypatch.setattr(loader, "available_memory", lambda: 2 * need)
    assert loader.auto_dtype(hf, "auto", "cpu") == torch.float32

    monkeypatch.setattr(linear, "_FAST_BF16", True)  # avx512_bf16 / AMX: bf16 everywhere
    assert loader.auto_dtype(hf, "auto", "cpu") == torch.bfloat16


def test_kernel_report_gives_each_group_against_the_measured_peak(ggufs, capsys):
    """python -m verispec.bench.native_matmul: per matrix group the time, then G MAC/s and its share of the
    machine's int8 peak (csrc/peak.cpp, measured on the path in use); the portable path has no peak to report."""
    from verispec.bench import native_matmul

    path = str(ggufs["qwen2"][0])
    assert native_matmul.main(["--model", path, "--rows", "1,8", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    if kernels.fast():
        assert kernels.int8_peak_macs() > 1e9  # at least a G MAC/s on any vector path
        table = out.split("G MAC/s (share of the measured int8 peak")[1].splitlines()
        rows = [line for line in table if line.startswith("| 8 |")]
        groups = rows[0].split("|")[2:-1]  # five groups ("-": none in this model) and the total
        assert len(groups) == 6 and "%)" in groups[-1] and sum("%)" in g for g in groups) >= 4
    kernels.force_portable(True)
    try:
        assert kernels.int8_peak_macs() == 0.0
    finally:
        kernels.set_isa("auto")
    assert native_matmul.main(["--model", path, "--rows", "0"]) == 2  # bad input: one line, exit 2
