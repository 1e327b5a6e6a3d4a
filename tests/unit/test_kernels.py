"""verispec's C++ kernels for quantized matrices.

int8 (csrc/linear_int8.cpp): exact against a Python model of its arithmetic, close to the float64 product,
bitwise batch-invariant, bitwise the same on the AVX512 and portable paths.
4-bit (csrc/linear_q4.cpp): within int8-activation error of the float64 product over the dequantized
weights, bitwise batch-invariant, the portable path within fp32 rounding of the AVX512 one.
"""

import pytest
import torch

from exact_helpers import bf16_bits, special_bias
from verispec import kernels
from verispec.models.linear import dequantize_q4, pack_int8, pack_q4

pytestmark = pytest.mark.skipif(not kernels.available(), reason="C++ kernels not built")


def int8_linear(x, packed, scale, rowsum, bias, n):
    return torch.ops.verispec.linear_int8(x, packed, scale, rowsum, bias, n)


def python_model(x, w, bias):
    """The kernel's arithmetic in PyTorch: per-row int8 activations, exact integer dots, fp32 epilogue."""
    w = w.float()
    sw = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)  # [N]
    qw = torch.round(w / sw[:, None]).clamp(-127, 127).long()  # [N, K]
    xf = x.float()
    amax = xf.abs().amax(dim=1)
    sx = torch.where(amax > 0, amax / 127, torch.ones_like(amax))  # [M]
    qx = torch.round(xf * (1 / sx)[:, None]).clamp(-127, 127).long()  # [M, K]
    dots = (qx @ qw.T).float()  # exact integers (|dot| < 2^24 for these sizes)
    y = dots * sx[:, None] * sw[None, :]
    return y if bias is None else y + bias.float()


SHAPES = [(1, 64, 4), (3, 200, 70), (16, 896, 1152), (5, 130, 9)]


@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_python_model_bitwise_and_float64_closely(m, k, n, with_bias):
    torch.manual_seed(m * 1000 + k + n)
    w = torch.randn(n, k) * 0.05
    x = torch.randn(m, k)
    bias = torch.randn(n) if with_bias else None
    y = int8_linear(x, *pack_int8(w), bias, n)
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert torch.equal(y, python_model(x, w, bias))
    ref = x.double() @ w.double().T + (0 if bias is None else bias.double())
    assert ((y.double() - ref).norm() / ref.norm()).item() < 0.02


KERNELS = {  # name -> (packer, op, portable-vs-AVX512 tolerance: int8 sums are exact integers)
    "int8": (pack_int8, "linear_int8", 0.0),
    "q4": (pack_q4, "linear_q4", 1e-5),
}


@pytest.mark.parametrize("kind", list(KERNELS))
def test_bf16_activations_give_their_fp32_results_rounded_to_nearest_even(kind):
    """The kernel writes bf16 results itself: each must be the fp32 result (same values in) rounded as .to()
    rounds, to nearest even; truncating, or rounding ties away, fails on these ~2000 outputs."""
    pack, op, _ = KERNELS[kind]
    torch.manual_seed(3)
    w, x = torch.randn(130, 512), torch.randn(16, 512).to(torch.bfloat16)
    packed, bias = pack(w), torch.randn(130)
    y = getattr(kernels.ops, op)(x, *packed, bias, 130)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, getattr(kernels.ops, op)(x.float(), *packed, bias, 130).to(torch.bfloat16))


@pytest.mark.parametrize("kind", list(KERNELS))
def test_nan_and_infinite_results_are_written_as_at_bfloat16_writes_them(kind):
    """A NaN bias gives NaN results: in bf16 each must be 0x7FC0 (plain rounding of a 0x7FFFFFFF NaN gives
    0x8000, -0.0), infinities stay infinite, in the four-column stores and in the partial last tile."""
    pack, op, _ = KERNELS[kind]
    torch.manual_seed(4)
    w, x = torch.randn(130, 512), torch.randn(3, 512).to(torch.bfloat16)
    packed, bias = pack(w), special_bias(130)
    y = getattr(kernels.ops, op)(x, *packed, bias, 130)
    y32 = getattr(kernels.ops, op)(x.float(), *packed, bias, 130)
    assert y32.isnan().sum() == 3 * 3 and y32.isinf().sum() == 3 * 2
    assert torch.equal(y.view(torch.int16), bf16_bits(y32))
    finite = y32.isfinite()
    assert torch.equal(y[finite], y32[finite].to(torch.bfloat16))


@pytest.mark.parametrize("kind", list(KERNELS))
def test_a_rows_result_does_not_depend_on_how_many_rows_share_the_call(kind):
    pack, op, _ = KERNELS[kind]
    torch.manual_seed(4)
    w, x = torch.randn(300, 520), torch.randn(kernels.MAX_ROWS, 520).to(torch.bfloat16)
    packed = pack(w)
    full = getattr(kernels.ops, op)(x, *packed, None, 300)
    for m in range(1, kernels.MAX_ROWS + 1):
        assert torch.equal(getattr(kernels.ops, op)(x[:m], *packed, None, 300), full[:m]), m
        assert torch.equal(getattr(kernels.ops, op)(x[m - 1:m], *packed, None, 300), full[m - 1:m]), m


@pytest.mark.parametrize("path", ["avx512-vnni", "avx2"])
@pytest.mark.parametrize("kind", list(KERNELS))
def test_portable_path_agrees_with_the_vector_paths(kind, path):
    if path not in kernels.cpu_isas():
        pytest.skip(f"this CPU cannot run the {path} path ({kernels.cpu_isas()})")
    pack, op, tol = KERNELS[kind]
    torch.manual_seed(5)
    w, x = torch.randn(77, 333), torch.randn(6, 333)
    packed = pack(w)
    try:
        kernels.set_isa("avx2" if path == "avx2" else "auto")
        assert kernels.isa().endswith(path)
        fast = getattr(kernels.ops, op)(x, *packed, None, 77)
        for m in range(1, 7):  # batch invariance on this path too
            assert torch.equal(getattr(kernels.ops, op)(x[:m], *packed, None, 77), fast[:m]), m
        kernels.force_portable(True)
        assert "portable" in kernels.isa()
        slow = getattr(kernels.ops, op)(x, *packed, None, 77)
    finally:
        kernels.set_isa("auto")
    torch.testing.assert_close(slow, fast, rtol=tol, atol=tol)


@pytest.mark.parametrize("kind", list(KERNELS))
def test_bad_calls_are_refused(kind):
    pack, op, _ = KERNELS[kind]
    packed = pack(torch.randn(8, 64))
    with pytest.raises(RuntimeError, match="at most 16 rows"):
        getattr(kernels.ops, op)(torch.randn(17, 64), *packed, None, 8)
    with pytest.raises(RuntimeError, match="features"):
        getattr(kernels.ops, op)(torch.randn(1, 200), *packed, None, 8)
    with pytest.raises(RuntimeError, match="packed weight must be"):
        getattr(kernels.ops, op)(torch.randn(1, 64), packed[0].view(torch.int16), *packed[1:], None, 8)


def test_forcing_an_unknown_isa_is_refused():
    with pytest.raises(RuntimeError, match="unknown ISA"):
        kernels._C.set_isa("sse9")
    assert kernels.cpu_isas()[-1] == "portable" and kernels.isa().endswith(kernels.cpu_isas()[0])


def test_the_built_kernels_read_the_layout_the_loader_writes():
    """kGgufLayout (csrc) == kernels.GGUF_LAYOUT == what models/gguf_native.py writes and keys its cache by: a
    layout change must change all three, and an extension built before it is refused (kernels._STALE)."""
    from verispec.models import gguf_native

    assert kernels._C.gguf_layout() == kernels.GGUF_LAYOUT == gguf_native.LAYOUT and not kernels._STALE


def test_an_extension_built_from_an_older_source_is_not_used(monkeypatch):
    """An editable install updated without a rebuild keeps an extension that reads another GGUF block layout:
    kernels treats it as absent (GGUF models load dequantized, drafts stay bf16) and says to rebuild, instead
    of running kernels that would read the new blocks wrongly. Negative control: the current build is used."""
    import importlib
    import sys
    import types

    import verispec
    from verispec.models import linear

    stale = types.ModuleType("verispec._C")  # an extension from before kernels reported their layout
    monkeypatch.setitem(sys.modules, "verispec._C", stale)
    monkeypatch.setattr(verispec, "_C", stale)
    try:
        importlib.reload(kernels)
        assert kernels._STALE and not kernels.available()
        with pytest.warns(RuntimeWarning, match="built from an older source.*GGUF models load dequantized"):
            assert not linear.can_run_native(torch.device("cpu"), torch.bfloat16)
    finally:
        monkeypatch.undo()
        importlib.reload(kernels)
    assert not kernels._STALE and kernels.available()


def test_zero_rows_and_leading_dims():
    w = torch.randn(8, 64)
    packed = pack_int8(w)
    x = torch.zeros(2, 3, 64)
    y = int8_linear(x, *packed, None, 8)
    assert y.shape == (2, 3, 8) and torch.equal(y, torch.zeros(2, 3, 8))


def q4_linear(x, packed, d, m, bias, n):
    return torch.ops.verispec.linear_q4(x, packed, d, m, bias, n)


@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_q4_matches_float64_over_the_dequantized_weights(m, k, n, with_bias):
    torch.manual_seed(m * 1000 + k + n)
    w = torch.randn(n, k) * 0.05
    x = torch.randn(m, k)
    bias = torch.randn(n) if with_bias else None
    packed = pack_q4(w)
    wd = dequantize_q4(*packed, n, k)  # [n, k]: what the 4-bit weights stand for
    assert ((wd - w).norm() / w.norm()).item() < 0.1  # 4-bit groups of 32: ~8% weight error
    y = q4_linear(x, *packed, bias, n)
    assert y.shape == (m, n) and y.dtype == torch.float32
    ref = x.double() @ wd.double().T + (0 if bias is None else bias.double())
    assert ((y.double() - ref).norm() / ref.norm()).item() < 0.015  # int8 activations: ~0.5-0.9%


def test_q4_pack_round_trips_representable_weights():
    """Weights that are exactly d * q + m per group (q spanning 0..15, d and m fp16) come back as they were."""
    torch.manual_seed(6)
    q = torch.randint(0, 16, (12, 4, 32)).float()  # [rows, groups, 32]
    q[:, :, 0], q[:, :, 1] = 0, 15
    d = (torch.rand(12, 4, 1) + 0.01).half().float()
    lo = torch.randn(12, 4, 1).half().float()
    w = (q * d + lo).view(12, 128)
    torch.testing.assert_close(dequantize_q4(*pack_q4(w), 12, 128), w, rtol=0, atol=1e-3)


@pytest.mark.parametrize("path", ["avx512-vnni", "avx2"])
@pytest.mark.parametrize("G,hd", [(2, 64), (7, 64), (6, 128), (9, 32)])
@pytest.mark.parametrize("lo,hi", [(0, 1), (0, 3), (0, 15), (0, 16), (3, 40), (0, 203)])
def test_attention_vector_paths_are_bitwise_the_plain_loops(path, G, hd, lo, hi):
    """The fused layer's attention (csrc/decoder_layer.cpp): attend_avx512 (16 keys' scores at a time) and
    attend_avx2 (4 keys at a time) against attend's plain loops, compared before the bf16 rounding of the output
    (which hides a one-rounding difference): weights and fp32 sums bit for bit; both close to float64 attention.
    Whole blocks of keys, keys after them, fewer than a block, a window not starting at 0, and more than 8 heads
    (two groups of sums)."""
    if path not in kernels.cpu_isas():
        pytest.skip(f"no {path} path on this CPU ({kernels.cpu_isas()})")
    g = torch.Generator().manual_seed(G * 1000 + hd + hi)
    q = (torch.randn(G, hd, generator=g) * 2).bfloat16()
    k, v = (torch.randn(hi + 2, hd, generator=g) * 2).bfloat16(), torch.randn(hi + 2, hd, generator=g).bfloat16()
    try:
        kernels.set_isa("avx2" if path == "avx2" else "auto")
        fast = kernels._C.attend_parts(q, k, v, lo, hi, True)
    finally:
        kernels.set_isa("auto")
    plain = kernels._C.attend_parts(q, k, v, lo, hi, False)
    for name, a, b in zip(("weights", "sums", "out"), fast, plain):
        assert torch.equal(a, b), name
    w64 = torch.softmax(q.double() @ k[lo:hi].double().T / hd ** 0.5, dim=-1)  # [G, S]
    torch.testing.assert_close(fast[0].double(), w64, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fast[1].double(), w64 @ v[lo:hi].double(), rtol=1e-5, atol=1e-5)


def test_attention_hook_refuses_bad_calls():
    q = torch.zeros(2, 64).bfloat16()
    with pytest.raises(RuntimeError, match="lo < hi"):
        kernels._C.attend_parts(q, q, q, 1, 1, False)
    with pytest.raises(RuntimeError, match="bf16"):
        kernels._C.attend_parts(q.float(), q, q, 0, 1, False)
