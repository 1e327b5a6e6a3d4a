"""The one linear layer of the runtime, with two CPU fast paths chosen at load time.

- packed (default on CPU, bf16/fp32): the weight pre-packed once in oneDNN's blocked layout.
  F.linear on a plain bf16 weight re-lays the weight out on every call, so a decode step reads each
  weight byte about three times; packing makes a step much faster (docs/BENCHMARKS.md, "bf16 (dequantized)
  target"). In bf16 the output is bitwise F.linear's; in float32 it differs by summation order (~1e-6 relative).
- quantized (drafts only, calls of up to kernels.MAX_ROWS rows: draft steps, their catch-ups), with
  verispec's own kernels (AVX512-VNNI), each activation row quantized to int8 with its own scale:
  int8: per-output-row symmetric int8 weights (csrc/linear_int8.cpp), half the bytes of bf16;
  int4: 4-bit groups of 32 with fp16 scale and min (Q4_1's scheme, csrc/linear_q4.cpp), 5/16 of bf16.
  Outputs differ from the float ones by ~1% (int8) / ~8% (int4 weights) relative, which for a draft costs
  a little acceptance and nothing in exactness: the verifier uses whatever q the draft reports. Longer
  calls (the draft's prefill) keep the float path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from ..errors import VerispecError


# float32: a packed oneDNN call has a fixed cost that F.linear (MKL) does not, and wins only from ~1M weights on
# (measured: docs/BENCHMARKS.md, "bf16 (dequantized) target", "Float32 matrices under 2^20 weights are not
# packed"). bf16 packs at any size: there F.linear re-lays the weight out on every call.
PACK_MIN_WEIGHTS = 1 << 20


def can_pack(weight: torch.Tensor) -> bool:
    """oneDNN prepacking: CPU, float32/bfloat16, oneDNN built in (bf16 needs avx512_bf16 / AMX hardware)."""
    return (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available() and (weight.dtype != torch.bfloat16 or fast_bf16_matmul()))


def can_run_native(device, dtype) -> bool:
    """Whether GGUF matrices can stay quantized here (csrc/linear_gguf.cpp): CPU, bf16 or fp32, kernels built."""
    if torch.device(device).type != "cpu" or dtype not in (torch.bfloat16, torch.float32):
        return False
    if not kernels.available():
        kernels.warn_missing("GGUF models load dequantized")
        return False
    return True


def fast_bf16_matmul() -> bool:
    """Whether oneDNN has bf16 hardware here (avx512_bf16 / AMX). Without it a bf16 product is emulated, several
    times slower than an fp32 one (docs/BENCHMARKS.md, "Which dtype on a CPU without avx512_bf16")."""
    global _FAST_BF16
    if _FAST_BF16 is None:
        _FAST_BF16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return _FAST_BF16


_FAST_BF16 = None


def can_quantize(device) -> bool:
    """Whether the int8 kernel runs here: CPU, with verispec's C++ kernels built."""
    if torch.device(device).type != "cpu":
        return False
    if not kernels.available():
        kernels.warn_missing("draft models run in bf16 instead of int8")
        return False
    return True


TILE_ROWS, CHUNK = 4, 64  # weight rows per tile and k per chunk in both packed formats (csrc/kernels.h)


def _padded(w: torch.Tensor) -> torch.Tensor:
    """[N, K] -> float32 [N', K'] zero-padded to whole tiles and chunks."""
    N, K = w.shape
    out = torch.zeros(-(-N // TILE_ROWS) * TILE_ROWS, -(-K // CHUNK) * CHUNK)
    out[:N, :K] = w.detach()
    return out


def pack_int8(w: torch.Tensor):
    """[N, K] float weight -> (packed int8 [N/4, K/64, 4, 64], scale [N'], row sums [N']) for the kernel.

    Symmetric per output row: q = round(w / scale), scale = max|w| / 127; N and K are zero-padded.
    """
    wp = _padded(w)  # [Np, Kp]
    Np, Kp = wp.shape
    scale = (wp.abs().amax(dim=1) / 127).clamp(min=1e-12)  # [Np]
    q = torch.round(wp / scale[:, None]).clamp(-127, 127).to(torch.int8)  # [Np, Kp]
    packed = q.view(Np // TILE_ROWS, TILE_ROWS, Kp // CHUNK, CHUNK).permute(0, 2, 1, 3)
    return packed.contiguous(), scale, q.sum(dim=1, dtype=torch.int32)


Q4_GROUP = 32  # GS in csrc/linear_q4.cpp


def pack_q4(w: torch.Tensor):
    """[N, K] float weight -> (packed uint8 [N/4, K/64, 2, 64], d fp16 [N/4, K/64, 4, 2], m fp16 (same)).

    Asymmetric 4-bit per group of 32 along K (the Q4_1 scheme): w ~ d * q + m, q in 0..15, with d and m
    rounded to fp16 first so that q is chosen against the values the kernel will use. Zero padding.
    """
    wp = _padded(w)  # [Np, Kp]
    Np, Kp = wp.shape
    g = wp.view(Np, Kp // Q4_GROUP, Q4_GROUP)  # [Np, G, 32]
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)  # [Np, G]
    d = ((hi - lo) / 15).half()
    m = lo.half()
    dq = torch.where(d.float() > 0, d.float(), torch.ones_like(lo))
    q = torch.round((g - m.float()[..., None]) / dq[..., None]).clamp(0, 15).to(torch.uint8)  # [Np, G, 32]
    tiles = Np // TILE_ROWS
    q = q.view(tiles, 2, 2, Kp // CHUNK, CHUNK)  # [tile, pair, row in pair, chunk, k]
    nibbles = (q[:, :, 0] | (q[:, :, 1] << 4)).transpose(1, 2).contiguous()  # [N/4, K/64, 2, 64]

    def tiled(t):  # [Np, K/64, ...] -> [N/4, K/64, 4, ...]
        return t.view(tiles, TILE_ROWS, *t.shape[1:]).transpose(1, 2).contiguous()

    return nibbles, tiled(d.view(Np, Kp // CHUNK, 2)), tiled(m.view(Np, Kp // CHUNK, 2))


def dequantize_q4(packed, d, m, n: int, k: int) -> torch.Tensor:
    """The float weight [n, k] a pack_q4 result stands for (tests and references)."""
    tiles, chunks = packed.shape[:2]
    q = torch.stack((packed & 15, packed >> 4), dim=3).float()  # [N/4, K/64, pair, row in pair, 64]
    q = q.reshape(tiles, chunks, TILE_ROWS, 2, Q4_GROUP)  # [N/4, K/64, 4 rows, 2 groups, 32]
    w = q * d.float()[..., None] + m.float()[..., None]
    return w.permute(0, 2, 1, 3, 4).reshape(tiles * TILE_ROWS, chunks * CHUNK)[:n, :k]


QUANT_BITS = {8: (pack_int8, "linear_int8"), 4: (pack_q4, "linear_q4")}  # bits -> (packer, kernel op)


class Linear(nn.Linear):
    native = None  # gguf_native.NativeWeight: the matrix kept in its GGUF blocks (weights="native")
    packed: torch.Tensor | None = None  # oneDNN blocked-layout weight
    qop = None  # torch.ops.verispec.linear_int8 / linear_q4 when the matrix is quantized
    qweights: tuple = ()  # the op's packed weight tensors (see pack_int8 / pack_q4)
    qbias: torch.Tensor | None = None  # float32 bias for the op
    in_huge_pages = False  # qweights copied into 2 MB pages (hugepages.place_model)

    def pack(self) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 1)
        self._drop_plain_weight()

    def set_native(self, w) -> None:
        """Use a GGUF matrix as it is (every call, any number of rows); the float weight goes away."""
        self.native, self.weight = w, None
        self.qweights, self.qop = w.tensors, None

    def quantize(self, bits: int) -> None:
        """Add an int8 (bits=8) or 4-bit (bits=4) copy used for calls of up to kernels.MAX_ROWS rows
        (draft steps); longer calls (prefill) keep the float path, except in bf16 where bf16 products are
        emulated (fast_bf16_matmul() False): there they run on the kernel too, MAX_ROWS rows at a time, faster
        than emulated bf16 (docs/BENCHMARKS.md, "The draft's prompt prefill")."""
        if bits not in QUANT_BITS:
            raise ValueError(f"bits must be one of {sorted(QUANT_BITS)}, got {bits}")
        pack, op = QUANT_BITS[bits]
        self.qweights, self.qop = pack(self.dense_weight()), getattr(kernels.ops, op)
        self.in_huge_pages = False
        self.qbias = None if self.bias is None else self.bias.detach().float()

    def _drop_plain_weight(self) -> None:
        if not getattr(self, "shared_weight", False):  # tied embeddings keep theirs
            self.weight = None

    def dense_weight(self) -> torch.Tensor:
        if self.native is not None:
            raise VerispecError("this matrix holds native GGUF weights (weights='native'): no float copy to "
                                "restrict or re-quantize; load it with weights='dequantized'")
        if self.weight is not None:
            return self.weight
        return self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None:
            return kernels.ops.linear_gguf(x, *self.native.tensors, self.qbias)
        if self.qop is not None and x.numel() <= kernels.MAX_ROWS * x.shape[-1]:
            return self.qop(x, *self.qweights, self.qbias, self.out_features)
        if self.qop is not None and x.dtype == torch.bfloat16 and not fast_bf16_matmul():
            rows = x.reshape(-1, x.shape[-1])  # [T, K]
            y = torch.cat([self.qop(rows[i:i + kernels.MAX_ROWS], *self.qweights, self.qbias, self.out_features)
                           for i in range(0, rows.shape[0], kernels.MAX_ROWS)])  # [T, N]
            return y.reshape(*x.shape[:-1], self.out_features)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
