"""The runtime's Linear: the packed path equals F.linear, the int8 path is really int8 (draft-step sized calls only)."""

import pytest
import torch
import torch.nn.functional as F

from verispec import kernels
from verispec.models.linear import Linear, can_pack, can_quantize, fast_bf16_matmul


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_equals_f_linear(dtype):
    torch.manual_seed(0)
    lin = Linear(96, 80, bias=True).to(dtype)
    if not can_pack(lin.weight):
        pytest.skip("oneDNN packing unavailable for this dtype here")
    w, b = lin.weight.detach().clone(), lin.bias.detach().clone()
    lin.pack()
    assert lin.weight is None and torch.equal(lin.dense_weight(), w)
    for rows in (1, 3, 17):
        x = torch.randn(2, rows, 96, dtype=dtype)
        if dtype == torch.bfloat16:  # the same oneDNN kernel F.linear uses, minus the per-call re-layout
            assert torch.equal(lin(x), F.linear(x, w, b)), rows
        else:  # float32: another summation order than MKL's sgemm
            torch.testing.assert_close(lin(x), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_runs_for_draft_step_sized_calls_only(dtype):
    assert can_quantize("cpu")  # the C++ kernels are built by the README's install command
    torch.manual_seed(1)
    lin = Linear(200, 70, bias=True).to(dtype)  # neither K nor N a multiple of the kernel's tiles
    w, b = lin.weight.detach().clone(), lin.bias.detach().clone()
    if can_pack(lin.weight):  # bf16 packing needs avx512_bf16 / AMX (not on an AVX2-only CPU)
        lin.pack()
    lin.quantize(8)
    for rows in range(1, kernels.MAX_ROWS + 1):  # draft steps and their catch-ups
        x = torch.randn(1, rows, 200, dtype=dtype)
        ref = F.linear(x.double(), w.double(), b.double())
        rel = ((lin(x).double() - ref).norm() / ref.norm()).item()
        assert 1e-4 < rel < 0.03, (rows, rel)  # int8 ran (not the float result) and is close
    many = torch.randn(1, 2 * kernels.MAX_ROWS + 3, 200, dtype=dtype)  # a prefill: the float path
    if dtype == torch.bfloat16 and not fast_bf16_matmul():  # ... except where bf16 products are emulated
        parts = [lin(many[:, i:i + kernels.MAX_ROWS]) for i in range(0, many.shape[1], kernels.MAX_ROWS)]
        assert torch.equal(lin(many), torch.cat(parts, dim=1))
        return
    tol = 1e-5 if dtype == torch.float32 else 0
    torch.testing.assert_close(lin(many), F.linear(many, w, b), rtol=tol, atol=tol)


def test_small_float32_matrices_stay_unpacked(tiny_dirs, monkeypatch):
    """float32: a packed oneDNN call costs more than F.linear below PACK_MIN_WEIGHTS (~60-80 us a call on a
    2-core Zen 1, most of a tiny model's step), so only matrices of at least that many weights are packed."""
    from verispec.models import llama
    from verispec.models.loader import load

    model = load(str(tiny_dirs["qwen2"]), torch.float32, "cpu").model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    if not can_pack(linears[0].dense_weight()):
        pytest.skip("oneDNN packing unavailable here")
    assert all(m.packed is None for m in linears)  # every matrix of the tiny model is below the bar
    sizes = sorted(m.weight.numel() for m in linears)
    monkeypatch.setattr(llama, "PACK_MIN_WEIGHTS", sizes[len(sizes) // 2])
    assert model.pack_weights()
    for m in linears:
        assert (m.packed is not None) == (m.dense_weight().numel() >= sizes[len(sizes) // 2])
    assert any(m.packed is None for m in linears)
