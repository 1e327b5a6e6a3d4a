"""GGUF-quantized matrices kept quantized: llama.cpp's blocks re-laid out for csrc/linear_gguf.cpp.

``weights="native"`` loads each Q8_0 / Q4_0 / Q5_0 / Q4_K / Q5_K / Q6_K matrix of a GGUF file as its
integer values and its own fp16 / 6-bit / 8-bit scale fields, re-ordered for the kernel once at load time;
no value changes (``dequantize`` below gives back, in float64, exactly the weights llama.cpp's dequantization
gives). A matrix is read at 4.5-8.5 bits per weight instead of bf16's 16.

Each format is decoded to ``(q, scales)``: q the unsigned integer per weight, [N, K] uint8 in the file's
element order, and scales uint8, the scale fields in k order: [N, K/256, 20] (Q4_K/Q5_K: d, dmin, sc[8],
mn[8]), [N, K/256, 18] (Q6_K: d, sc[16]) or [N, K/32, 2] (Q8_0/Q4_0/Q5_0: d); see the table at the top of
linear_gguf.cpp. ``pack`` then re-orders q in the kernel's blocks (``blocks(K)``) and tiles both.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .. import kernels

NR = 4  # weight rows per tile (csrc/linear_gguf.cpp)
NT = 16  # weight rows per tile of the Q4_K / Q6_K layout (csrc/linear_kquant.cpp)
TILED = ("Q4_K", "Q6_K")
LAYOUT = kernels.GGUF_LAYOUT  # version of the layout written here (a cached load of another is rebuilt)
LANES = 16

# GGML type name -> (kernel kind, bytes per GGUF block, weights per GGUF block, bits stored per q: 4 (nibbles),
# 6 (nibbles, then the top 2 bits) or 8 (bytes))
KINDS = {
    "Q8_0": (0, 34, 32, 8),
    "Q4_0": (1, 18, 32, 4),
    "Q5_0": (2, 22, 32, 8),
    "Q4_K": (3, 144, 256, 4),
    "Q5_K": (4, 176, 256, 8),
    "Q6_K": (5, 210, 256, 6),
}
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")
SYMMETRIC_SHIFT = {"Q8_0": 128, "Q4_0": 8, "Q5_0": 16, "Q6_K": 32}  # w = s * (q - c)


def blocks(K: int) -> list[tuple[int, int]]:
    """(first k, size) of the kernel's blocks along K (Blocks in the kernel): 512s, then 256 and 128 for the
    rest. Activations are quantized to int8 with one scale per block."""
    out, k = [], 0
    while k < K:
        b = 512 if K - k >= 512 else (256 if K - k >= 256 else 128)
        out.append((k, b))
        k += b
    return out


def supported(type_name: str, K: int) -> bool:
    """Whether a [N, K] matrix of this GGML type can run natively."""
    if type_name not in KINDS or K % 128:
        return False
    return type_name not in K_QUANTS or K % 256 == 0


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., n] bytes -> [..., 2n]: the n low nibbles, then the n high nibbles (Q4_0 / Q5_0 / K-quant order)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 packed scale bytes of a Q4_K / Q5_K block -> (sc [.., 8], mn [.., 8]), 6-bit each."""
    d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def decode(raw: np.ndarray, type_name: str, N: int, K: int) -> tuple[np.ndarray, np.ndarray]:
    """A GGUF tensor's bytes ([N, K] weights in ``type_name``) -> (q [N, K] uint8, scales uint8, as in the
    module docstring)."""
    if type_name not in KINDS:
        raise ValueError(f"no native kernel for {type_name}")
    _, nbytes, per, _ = KINDS[type_name]
    blk = np.asarray(raw, dtype=np.uint8).reshape(N, K // per, nbytes)  # [N, nb, bytes]
    if type_name in ("Q8_0", "Q4_0", "Q5_0"):
        d = blk[..., 0:2]  # [N, nb, 2] fp16 bytes
        if type_name == "Q8_0":
            q = blk[..., 2:] ^ 0x80  # int8 -> q + 128
        elif type_name == "Q4_0":
            q = _nibbles(blk[..., 2:])
        else:
            qh = blk[..., 2:6].copy().view("<u4")  # [N, nb, 1]
            hi = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # [N, nb, 32]
            q = _nibbles(blk[..., 6:]) | (hi << 4)
        scales = d  # [N, K/32, 2]
    elif type_name in ("Q4_K", "Q5_K"):
        d, dmin, sc12 = blk[..., 0:2], blk[..., 2:4], blk[..., 4:16]
        sc, mn = _k_scale_min(sc12)
        qs = blk[..., -128:].reshape(N, K // 256, 4, 32)
        q = _nibbles(qs)  # [N, nb, 4, 64]: groups 2i (low) and 2i + 1 (high)
        if type_name == "Q5_K":
            qh = blk[..., 16:48]  # [N, nb, 32]: bit g = high bit of group g's element
            hi = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [N, nb, 8, 32]
            q = q | (hi.reshape(N, K // 256, 4, 64) << 4)
        scales = np.concatenate([d, dmin, sc, mn], axis=-1)  # [N, nb, 20]
    elif type_name == "Q6_K":
        ql, qh, sc, d = blk[..., 0:128], blk[..., 128:192], blk[..., 192:208], blk[..., 208:210]
        ql = ql.reshape(N, -1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)  # [N, nb, 2, 2, 64]
        qh = qh.reshape(N, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)  # [N, nb, 2, 4, 32]
        q = (ql & 0x0F).reshape(N, -1, 256) | ((qh & 0x03).reshape(N, -1, 256) << 4)
        scales = np.concatenate([d, sc], axis=-1)  # [N, nb, 18]
    return np.ascontiguousarray(q.reshape(N, K), dtype=np.uint8), np.ascontiguousarray(scales, dtype=np.uint8)


def dequantize(q: np.ndarray, scales: np.ndarray, type_name: str) -> np.ndarray:
    """(q, scales) from decode -> the float64 weights [N, K] they stand for (tests, references)."""
    N, K = q.shape
    B = 32 if type_name not in K_QUANTS else 256  # one scale record per B weights
    qf = q.astype(np.float64).reshape(N, K // B, B)
    if type_name in ("Q4_K", "Q5_K"):
        d = scales[..., 0:2].copy().view(np.float16).astype(np.float64)  # [N, nb, 1]
        dmin = scales[..., 2:4].copy().view(np.float16).astype(np.float64)
        s = np.repeat(d * scales[..., 4:12], 32, axis=-1)
        m = np.repeat(dmin * scales[..., 12:20], 32, axis=-1)
        w = s * qf - m
    elif type_name == "Q6_K":
        d = scales[..., 0:2].copy().view(np.float16).astype(np.float64)
        s = np.repeat(d * scales[..., 2:18].view(np.int8), 16, axis=-1)
        w = s * (qf - 32)
    else:
        d = scales.copy().view(np.float16).astype(np.float64)  # [N, K/32, 1]
        w = d * (qf - SYMMETRIC_SHIFT[type_name])
    return w.reshape(N, K)


def _lane_order(q: np.ndarray, bits: int) -> np.ndarray:
    """[N, K] -> [N, K * bits / 8] block after block: in a block of B, chunk c lane l byte j <- k = (B/16) l +
    4c + j; 4 bits: chunk 2v in the low and 2v + 1 in the high half of each byte; 6 bits: the low 4 bits so
    (B/2 bytes), then the top 2 bits, chunk 4u + i's in bits 2i, 2i + 1 of the u-th 64 bytes (B/4 bytes)."""
    N, K = q.shape
    out = []
    for k0, B in blocks(K):
        C = B // 64
        x = q[:, k0:k0 + B].reshape(N, LANES, C, 4).transpose(0, 2, 1, 3).reshape(N, C, 64)  # [N, C, 64]
        if bits == 6:
            top = (x >> 4).reshape(N, C // 4, 4, 64)
            top = top[:, :, 0] | (top[:, :, 1] << 2) | (top[:, :, 2] << 4) | (top[:, :, 3] << 6)  # [N, C/4, 64]
            x = x & 0x0F
        if bits in (4, 6):
            x = x.reshape(N, C // 2, 2, 64)
            x = x[:, :, 0] | (x[:, :, 1] << 4)
        out.append(x.reshape(N, -1))
        if bits == 6:
            out.append(top.reshape(N, -1))
    return np.concatenate(out, axis=1)


def _tiles(a: np.ndarray) -> np.ndarray:
    """[N, X] -> [N'/NR, NR, X], rows zero-padded to whole tiles."""
    N = a.shape[0]
    pad = -N % NR
    if pad:
        a = np.concatenate([a, np.zeros((pad, *a.shape[1:]), dtype=a.dtype)])
    return a.reshape(-1, NR, a.shape[1])


@dataclass
class Segment:
    type_name: str
    rows: int
    q: np.ndarray  # [tiles, bytes per tile] uint8: block after block, NR rows each
    s: np.ndarray  # [tiles, NR * scale bytes per row] uint8


def _pack_tiled(q: np.ndarray, scales: np.ndarray, type_name: str) -> Segment:
    """Q4_K / Q6_K -> tiles of NT rows, super-block after super-block (the layout at the top of
    csrc/linear_kquant.cpp): in each 64 bytes lane n holds 4 consecutive q of row n; quads 2p and 2p + 1 share
    the bytes of packed p as low and high nibbles (Q6_K: its top 2 bits follow, quads 4u .. 4u + 3 in the u-th
    64 bytes); the scale fields regrouped so that 16 rows' values of one field sit together."""
    N, K = q.shape
    pad, S = -N % NT, K // 256
    if pad:
        q = np.concatenate([q, np.zeros((pad, K), np.uint8)])
        scales = np.concatenate([scales, np.zeros((pad, *scales.shape[1:]), np.uint8)])
    T = q.shape[0] // NT
    x = q.reshape(T, NT, S, 64, 4).transpose(0, 2, 3, 1, 4)  # [T, S, quad, row, 4]
    low = x & 0x0F
    parts = [(low[:, :, 0::2] | (low[:, :, 1::2] << 4)).reshape(T, S, 2048)]
    if type_name == "Q6_K":
        top = (x >> 4).reshape(T, S, 16, 4, NT, 4)
        parts.append((top[:, :, :, 0] | (top[:, :, :, 1] << 2) | (top[:, :, :, 2] << 4) | (top[:, :, :, 3] << 6))
                     .reshape(T, S, 1024))
    sc = scales.reshape(T, NT, S, -1).transpose(0, 2, 1, 3)  # [T, S, row, field bytes]
    fields = [sc[..., 0:2].reshape(T, S, 32)]  # d
    if type_name == "Q4_K":
        fields += [sc[..., 2:4].reshape(T, S, 32), sc[..., 4:12].transpose(0, 1, 3, 2).reshape(T, S, 128),
                   sc[..., 12:20].reshape(T, S, NT, 4, 2).transpose(0, 1, 3, 2, 4).reshape(T, S, 128)]
    else:
        fields.append(sc[..., 2:18].transpose(0, 1, 3, 2).reshape(T, S, 256))
    qt = np.ascontiguousarray(np.concatenate(parts, axis=2).reshape(T, -1))
    st = np.ascontiguousarray(np.concatenate(fields, axis=2).reshape(T, -1))
    return Segment(type_name, N, qt, st)


def pack(q: np.ndarray, scales: np.ndarray, type_name: str) -> Segment:
    """decode's (q, scales) -> one kernel segment."""
    N, K = q.shape
    if not supported(type_name, K):
        raise ValueError(f"no native kernel for a {type_name} matrix with K = {K} (K-quants need K % 256 == 0, "
                         "the others K % 128 == 0)")
    if type_name in TILED:
        return _pack_tiled(q, scales, type_name)
    bits = KINDS[type_name][3]
    lanes = _tiles(_lane_order(q, bits))  # [tiles, NR, K * bits / 8]
    parts, at = [], 0
    for _, B in blocks(K):  # per block: its NR rows together
        width = B * bits // 8
        parts.append(lanes[:, :, at:at + width].reshape(lanes.shape[0], -1))
        at += width
    qt = np.ascontiguousarray(np.concatenate(parts, axis=1))
    st = np.ascontiguousarray(_tiles(scales.reshape(N, -1)).reshape(qt.shape[0], -1))
    return Segment(type_name, N, qt, st)


@dataclass
class NativePart:
    """One GGUF matrix, decoded: what a loader holds before fusing parts (q/k/v, gate/up) into one matrix."""
    type_name: str
    q: np.ndarray  # [N, K] uint8
    scales: np.ndarray  # uint8, decode's layout

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantized(self) -> torch.Tensor:
        return torch.from_numpy(dequantize(self.q, self.scales, self.type_name).astype(np.float32))


class NativeWeight:
    """One matrix as kernel segments stacked along N: (q, s, meta) tensors for torch.ops.verispec.linear_gguf."""

    @classmethod
    def from_parts(cls, parts: list[NativePart]) -> NativeWeight:
        return cls.from_segments([pack(p.q, p.scales, p.type_name) for p in parts], parts[0].shape[1])

    @classmethod
    def from_segments(cls, segments: list[Segment], in_features: int) -> NativeWeight:
        meta, qo, so = [], 0, 0
        for s in segments:
            meta.append([KINDS[s.type_name][0], s.rows, s.q.shape[0], qo, so, in_features])
            qo, so = qo + s.q.size, so + s.s.size
        return cls(torch.from_numpy(np.concatenate([s.q.reshape(-1) for s in segments])),
                   torch.from_numpy(np.concatenate([s.s.reshape(-1) for s in segments])),
                   torch.tensor(meta, dtype=torch.int64))

    def __init__(self, q: torch.Tensor, s: torch.Tensor, meta: torch.Tensor):
        """q, s: [bytes] uint8, every segment's tiles; meta: int64 [segments, 6] (kind, rows, tiles, q offset,
        s offset, K): what the op takes, and all that describes the matrix (a cached load passes them back)."""
        self.q, self.s, self.meta = q, s, meta
        names = {v[0]: k for k, v in KINDS.items()}
        self.types = [names[int(k)] for k in meta[:, 0]]
        self.out_features, self.in_features = int(meta[:, 1].sum()), int(meta[0, 5])

    @property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.q, self.s, self.meta

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.s.numel()
