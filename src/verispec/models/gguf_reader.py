"""A GGUF file's metadata and tensor index, read in well under a second.

The ``gguf`` package's ``GGUFReader`` builds a numpy view for every part of every metadata value, slow for a
Qwen2.5 file (151,936 tokens and 151,387 merges; timed against ``GGUFIndex``: docs/BENCHMARKS.md, "Load time"). Here the
header is walked once with ``struct`` over a memory map, string arrays are decoded with one slice each, and
numeric arrays are one ``np.frombuffer``. Tensor data stays on disk: each tensor's ``data`` is a read-only
memmap view, shaped as ``GGUFReader`` shapes it (so ``gguf.quants.dequantize`` takes it as it is):
elements for F32/F16/F64/I8-I64, otherwise bytes, [..., rows, bytes per row].

Layout (GGUF v2/v3, little-endian): magic "GGUF", version u32, tensor count u64, key/value count u64;
key/value pairs (key: u64 length + UTF-8; value type u32; value); tensor infos (name, dims count u32, dims
u64 each, innermost first; type u32; offset u64 from the data section); data section at the next multiple of
``general.alignment`` (default 32).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

# GGUF value type -> struct format of one scalar (8: string, 9: array)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_ELEMENT_TYPES = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
                  GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                  GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                  GGMLQuantizationType.I64: np.int64}


@dataclass(frozen=True)
class Tensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray  # [n_dims] uint64, innermost (k) first, as in the file
    n_elements: int
    n_bytes: int
    data: np.ndarray  # memmap view (see the module docstring)


class GGUFIndex:
    """``fields``: {key: int | float | bool | str | list[str] | np.ndarray}; ``tensors``: [Tensor] in file order.
    Raises ValueError (or struct.error) on a malformed or truncated file."""

    def __init__(self, path: str):
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf, self._pos = self._map, 0
        if buf[:4] != b"GGUF":
            raise ValueError("bad magic")
        self._pos = 4
        version = self._scalar("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (supported: 2, 3; big-endian files are not)")
        n_tensors, n_kv = self._scalar("<Q"), self._scalar("<Q")
        self.fields: dict[str, object] = {}
        for _ in range(n_kv):
            key = self._string()
            self.fields[key] = self._value(self._scalar("<I"))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            dims = np.array([self._scalar("<Q") for _ in range(self._scalar("<I"))], dtype=np.uint64)
            infos.append((name, GGMLQuantizationType(self._scalar("<I")), dims, self._scalar("<Q")))
        align = int(self.fields.get("general.alignment", 32))
        start = -(-self._pos // align) * align
        self.tensors = [self._tensor(start, *info) for info in infos]
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise ValueError("duplicated tensor names")

    def _scalar(self, fmt: str):
        (v,) = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += struct.calcsize(fmt)
        return v

    def _string(self) -> str:
        n = self._scalar("<Q")
        end = self._pos + n
        if end > len(self._map):
            raise ValueError("a string runs past the end of the file")
        s = self._map[self._pos:end].decode("utf-8", errors="replace")
        self._pos = end
        return s

    def _value(self, vtype: int):
        if vtype == _STRING:
            return self._string()
        if vtype in _SCALARS:
            return self._scalar(_SCALARS[vtype])
        if vtype != _ARRAY:
            raise ValueError(f"unknown metadata value type {vtype}")
        itype, count = self._scalar("<I"), self._scalar("<Q")
        if itype == _STRING:
            return [self._string() for _ in range(count)]
        if itype in _SCALARS:
            dt = np.dtype(_SCALARS[itype])
            end = self._pos + count * dt.itemsize
            if end > len(self._map):
                raise ValueError("an array runs past the end of the file")
            arr = np.frombuffer(self._map, dtype=dt, count=count, offset=self._pos).copy()
            self._pos = end
            return arr
        return [self._value(itype) for _ in range(count)]  # arrays of arrays

    def _tensor(self, start: int, name: str, ttype: GGMLQuantizationType, dims: np.ndarray, offset: int) -> Tensor:
        n = int(np.prod(dims, dtype=np.uint64)) if len(dims) else 1
        block, size = GGML_QUANT_SIZES[ttype]
        if n % block or (len(dims) and int(dims[0]) % block):
            raise ValueError(f"tensor {name}: {n} elements do not fill {ttype.name} blocks of {block}")
        n_bytes = n // block * size
        at = start + offset
        if at + n_bytes > len(self._map):
            raise ValueError(f"tensor {name} runs past the end of the file")
        shape = tuple(int(d) for d in reversed(dims.tolist()))
        if ttype in _ELEMENT_TYPES:
            data = np.frombuffer(self._map, dtype=_ELEMENT_TYPES[ttype], count=n, offset=at).reshape(shape)
        else:
            byte_shape = (*shape[:-1], shape[-1] // block * size) if shape else (n_bytes,)
            data = np.frombuffer(self._map, dtype=np.uint8, count=n_bytes, offset=at).reshape(byte_shape)
        return Tensor(name, ttype, dims, n, n_bytes, data)
