"""The runtime's Linear: the packed path equals F.linear, the int8 path is really int8 (draft-step sized calls only)."""

import pytest
import torch
import torch.nn.functional as F

from verispec.models.linear import INT8_MAX_ROWS, Linear, can_pack, can_quantize


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


def test_int8_runs_for_draft_step_sized_calls_only():
    assert can_quantize("cpu")  # x86 with oneDNN, as on CI
    torch.manual_seed(1)
    lin = Linear(256, 64, bias=True)
    w, b = lin.weight.detach().clone(), lin.bias.detach().clone()
    lin.pack()
    lin.quantize_int8()
    for rows in range(1, INT8_MAX_ROWS + 1):  # a draft step, or its catch-up after a fully accepted round
        x = torch.randn(1, rows, 256)
        ref = F.linear(x, w, b)
        rel = ((lin(x) - ref).norm() / ref.norm()).item()
        assert 1e-5 < rel < 0.03, (rows, rel)  # int8 ran (not bitwise the float result) and is close
    many = torch.randn(1, INT8_MAX_ROWS + 1, 256)
    torch.testing.assert_close(lin(many), F.linear(many, w, b), rtol=1e-5, atol=1e-5)  # float path
