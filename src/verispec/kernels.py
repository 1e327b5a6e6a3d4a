"""verispec's compiled CPU kernels (src/verispec/csrc, built at install time as ``verispec._C``).

The ops register as ``torch.ops.verispec.*``. When the extension was not built (an install without
``--no-build-isolation``, or a platform without a C++ compiler) ``available()`` is False and the callers
keep PyTorch's own operators.
"""

from __future__ import annotations

import warnings

import torch  # before the extension: it links against libtorch

# The block layout linear_gguf.cpp reads (kGgufLayout in csrc/kernels.h; models/gguf_native.py writes it). 3:
# Q4_K and Q6_K in tiles of 16 rows (csrc/linear_kquant.cpp). An extension built from an older source (an editable install updated without a rebuild)
# would read the new blocks wrongly: it is not used.
GGUF_LAYOUT = 3

try:
    from . import _C
except ImportError:  # pragma: no cover - depends on the install
    _C = None
_STALE = _C is not None and getattr(_C, "gguf_layout", lambda: 1)() != GGUF_LAYOUT
if _STALE:  # pragma: no cover - depends on the install
    _C = None

ops = torch.ops.verispec  # linear_int8, linear_q4 (registered by _C)

MAX_ROWS = 16  # kMaxRows in csrc/kernels.h: the kernels take decode and verify calls of 1..16 rows
_warned = False


def available() -> bool:
    return _C is not None


def warn_missing(what: str) -> None:
    """Say once that a fast path is off because the kernels were not built."""
    global _warned
    if not _warned:
        _warned = True
        state = "were built from an older source" if _STALE else "are not built"
        warnings.warn(f"verispec's C++ kernels {state}, so {what}; reinstall with "
                      "`pip install --no-build-isolation -e .` (see README)", RuntimeWarning, stacklevel=3)


def isa() -> str:
    """The instruction sets in use: 'int8:avx512-vnni', 'int8:avx2', 'int8:portable', or 'none' if not built."""
    return _C.isa() if _C is not None else "none"


def cpu_isas() -> list[str]:
    """The kernel paths this CPU can run, fastest first: ['avx512-vnni', 'avx2', 'portable'] or a tail of it."""
    return list(_C.cpu_isas()) if _C is not None else []


def fast() -> bool:
    """Whether the quantized kernels run vectorized here (AVX512-VNNI or AVX2), not the plain C++ path."""
    return isa().endswith(("vnni", "avx2"))


def int8_peak_macs() -> float:
    """One core's measured int8 multiply-accumulates a second on the instruction the kernels use now (vpdpbusd,
    or vpmaddubsw on AVX2), about 0.1 s of timing; 0.0 on the portable path or without the kernels."""
    return _C.int8_peak_macs() if _C is not None else 0.0


def set_isa(name: str) -> None:
    """Use one path: 'auto' (the fastest this CPU has), 'avx2' or 'portable' (tests compare them)."""
    _C.set_isa(name)


def force_portable(on: bool = True) -> None:
    """Use the plain C++ paths instead of AVX512 / AVX2 (tests compare the two)."""
    set_isa("portable" if on else "auto")
