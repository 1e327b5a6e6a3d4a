"""The matrices the C++ kernels stream, copied once into 2 MB pages.

A decode step reads every weight byte once. In 4 KB pages that is a TLB miss every 4 KB, and the CPU's
stream prefetchers stop at every page boundary. Linux backs memory with 2 MB pages (transparent huge pages)
where a mapping asks for them with madvise(MADV_HUGEPAGE), which is what most distributions' default
("madvise") needs. On the 1.5B native target this makes verify passes, and less so one-token steps, faster
(measured: docs/BENCHMARKS.md, "2 MB pages").

verispec's import already sets THP_MEM_ALLOC_ENABLE=1, so PyTorch's allocator advises its own blocks of
2 MB and more; it does not reach these: the native blocks come from numpy or from the mapped cache file, and
most q/k/v and output matrices are under 2 MB.

``place_model`` copies the kernels' tensors (GGUF native blocks, the draft's int8 / 4-bit copies) side by side
into one such mapping, 64-byte aligned, and points the layers at the copies; the values are unchanged. Where
madvise is missing (another OS) or refused, or ``VERISPEC_HUGE_PAGES=0``, the tensors stay where they are.
Copies read from a mapped file (the native-load cache) let go of the file's pages (MADV_PAGEOUT): otherwise
they would stay in the process's resident memory next to the copies, a second copy of the weights
(docs/BENCHMARKS.md, "2 MB pages").
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import sys

import torch

from ..config import env_flag

PAGE = 2 << 20  # bytes in a huge page
ALIGN = 64  # each tensor starts on a cache line


@functools.cache
def _libc() -> ctypes.CDLL:
    """This process's C library (OSError where there is none to open)."""
    return ctypes.CDLL(None, use_errno=True)


def available() -> bool:
    return hasattr(mmap, "MADV_HUGEPAGE") and env_flag("VERISPEC_HUGE_PAGES")


def relocate(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of ``tensors`` (CPU) in one anonymous mapping advised for huge pages, starting on a 2 MB
    boundary; ``tensors`` itself (the same list) where that is not available."""
    if not tensors or not available() or any(t.device.type != "cpu" for t in tensors):
        return tensors
    sizes = [t.numel() * t.element_size() for t in tensors]
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += -(-n // ALIGN) * ALIGN
    try:
        area = mmap.mmap(-1, total + PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        area.madvise(mmap.MADV_HUGEPAGE)  # before the first touch: the copies below fault in 2 MB pages
    except (OSError, ValueError):
        return tensors
    base = torch.frombuffer(area, dtype=torch.uint8)  # keeps the mapping alive while any view of it lives
    start = (-base.data_ptr()) % PAGE
    out = []
    for t, at, n in zip(tensors, offsets, sizes):
        copy = base[start + at:start + at + n].view(t.dtype).view(t.shape)
        copy.copy_(t)
        out.append(copy)
    page_out_file_sources(tensors)
    return out


MADV_PAGEOUT = 21  # Linux >= 5.4: reclaim these pages now (contents kept: a later read faults them back in)


def page_out_file_sources(tensors: list[torch.Tensor]) -> None:
    """Ask the kernel to drop the resident pages of those ``tensors`` that lie in file mappings (a safetensors
    file read with mmap keeps them mapped while any tensor of the file lives). Anonymous memory is left alone:
    paging it out could mean writing it to swap just before it is freed."""
    if not sys.platform.startswith("linux"):
        return
    try:
        files = []
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].startswith("/"):
                    lo, hi = (int(v, 16) for v in parts[0].split("-"))
                    files.append((lo, hi))
        libc = _libc()
    except OSError:
        return
    for t in tensors:
        a, n = t.data_ptr(), t.numel() * t.element_size()
        lo, hi = -(-a // mmap.PAGESIZE) * mmap.PAGESIZE, (a + n) // mmap.PAGESIZE * mmap.PAGESIZE
        if hi > lo and any(f_lo <= a and a + n <= f_hi for f_lo, f_hi in files):
            libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), MADV_PAGEOUT)  # a hint: errors ignored


def place_model(model) -> int:
    """Move the kernel tensors of every quantized or native matrix of ``model`` not placed yet into huge
    pages (the fused layers' weight lists are rebuilt on next use); how many bytes moved."""
    from .linear import Linear

    linears = [m for m in model.modules()
               if isinstance(m, Linear) and m.qweights and not getattr(m, "in_huge_pages", False)]
    flat = [t for m in linears for t in m.qweights]
    moved = relocate(flat)
    if moved is flat:
        return 0
    it = iter(moved)
    for m in linears:
        m.qweights = tuple(next(it) for _ in m.qweights)
        if m.native is not None:
            m.native.q, m.native.s, m.native.meta = m.qweights
        m.in_huge_pages = True
    for layer in model.layers:
        layer._fused = None
    del flat
    _trim_heap()
    return sum(t.numel() * t.element_size() for m in linears for t in m.qweights)


def _trim_heap() -> None:
    """glibc keeps freed blocks of up to 32 MB in the heap: hand the ones the originals left back to the system
    (the 4-bit 0.5B draft: ~200 MB)."""
    try:
        _libc().malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # mallopt's parameters (glibc's malloc.h)


def keep_freed_memory() -> bool:
    """Let glibc's malloc keep the memory a process frees rather than hand it back to the kernel.

    Each block of 2 MB and more is its own mapping (glibc maps large blocks; THP_MEM_ALLOC_ENABLE=1 gives them
    2 MB pages): freeing a tensor unmaps its pages and the next tensor of that size faults and zeroes them again.
    A training step frees and re-makes its activations and gradients every step; without this, train-head on 2
    cores spends a third of its CPU time in the kernel doing so (docs/BENCHMARKS.md, "The shipped heads and their recipes").
    M_MMAP_MAX = 0 serves large blocks from the heap, a high M_TRIM_THRESHOLD keeps its freed top; resident
    memory then stays near the process's peak. False where this is not glibc or VERISPEC_KEEP_FREED=0."""
    if not env_flag("VERISPEC_KEEP_FREED") or not sys.platform.startswith("linux"):
        return False
    try:
        libc = _libc()
        return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 1 << 30))
    except (OSError, AttributeError):  # not glibc
        return False
