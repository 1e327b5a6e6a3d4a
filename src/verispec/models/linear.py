"""The one linear layer of the runtime, with two CPU fast paths chosen at load time.

- packed (default on CPU, bf16/fp32): the weight pre-packed once in oneDNN's blocked layout.
  F.linear on a plain bf16 weight re-lays the weight out on every call, so a decode step reads each
  weight byte about three times; packing makes a step ~2x faster here. In bf16 the output is bitwise
  F.linear's; in float32 it differs by summation order (~1e-6 relative).
- int8 (drafts only, calls of up to INT8_MAX_ROWS rows: draft steps and their catch-ups): per-output-channel
  symmetric int8 weights, the activation rows quantized per call (asymmetric uint8, one scale), oneDNN's
  VNNI kernel. Half the weight bytes of bf16. The
  outputs differ from the float ones by ~1% (relative), which for a draft model costs a little
  acceptance and nothing in exactness: the verifier uses whatever q the draft reports.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn


def can_pack(weight: torch.Tensor) -> bool:
    """oneDNN prepacking: CPU, float32/bfloat16, oneDNN built in (bf16 needs avx512_bf16 / AMX hardware)."""
    return (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available()
            and (weight.dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()))


_INT8_OK: bool | None = None
INT8_MAX_ROWS = 2  # a draft step (1 row) or its catch-up after a fully accepted round (2 rows)


def can_quantize(device) -> bool:
    """Whether oneDNN's int8 linear runs here (probed once on a tiny matrix)."""
    global _INT8_OK
    if torch.device(device).type != "cpu":
        return False
    if _INT8_OK is None:
        try:
            probe = Linear(32, 16, bias=True)
            probe.quantize_int8()
            _INT8_OK = bool(torch.isfinite(probe(torch.randn(1, 32))).all())  # one row: the int8 path
        except (RuntimeError, AttributeError, NotImplementedError):
            _INT8_OK = False
    return _INT8_OK


def _quantize_activations(x2: torch.Tensor):
    """[M, K] float -> (uint8 [M, K], scale, zero point): one asymmetric scale for the whole tensor."""
    with warnings.catch_warnings():  # quantized tensor *types* are deprecated; we only borrow the kernel
        warnings.simplefilter("ignore")
        q = torch.quantize_per_tensor_dynamic(x2, torch.quint8, False)
    return q.int_repr(), q.q_scale(), q.q_zero_point()


class Linear(nn.Linear):
    packed: torch.Tensor | None = None  # oneDNN blocked-layout weight
    q8: torch.Tensor | None = None  # oneDNN-prepacked int8 weight

    def pack(self) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 1)
        self._drop_plain_weight()

    def quantize_int8(self) -> None:
        """Add an int8 copy used for calls of up to INT8_MAX_ROWS rows (draft steps); longer calls (prefill)
        keep the float path, where one activation scale over many rows would cost precision."""
        w = self.dense_weight().detach().float()  # [out, in]
        self.q8_scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)  # [out]
        q = torch.round(w / self.q8_scale[:, None]).clamp(-127, 127).to(torch.int8)
        self.q8 = torch.ops.onednn.qlinear_prepack(q, [1, w.shape[1]])
        self.q8_zero = torch.zeros(w.shape[0], dtype=torch.long)
        self.q8_bias = None if self.bias is None else self.bias.detach().float()

    def _drop_plain_weight(self) -> None:
        if not getattr(self, "shared_weight", False):  # tied embeddings keep theirs
            self.weight = None

    def dense_weight(self) -> torch.Tensor:
        if self.weight is not None:
            return self.weight
        return self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.q8 is not None and x.numel() <= INT8_MAX_ROWS * x.shape[-1]:
            qx, scale, zero = _quantize_activations(x.reshape(-1, x.shape[-1]).float())
            y = torch.ops.onednn.qlinear_pointwise(qx, scale, zero, self.q8, self.q8_scale, self.q8_zero,
                                                   self.q8_bias, 1.0, 0, x.dtype, "none", [], "")
            return y.reshape(*x.shape[:-1], y.shape[-1])
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
