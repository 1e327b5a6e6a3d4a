"""Machine facts a benchmark report needs: memory read bandwidth (the decode floor) and environment."""

from __future__ import annotations

import os
import platform
import time

import torch


def read_bandwidth_gbs(size_bytes: int = 1 << 30, repeats: int = 5, device: str = "cpu") -> float:
    """Best-of-N read bandwidth (GB/s) of a reduction over a buffer far larger than the caches.

    A decode step streams every weight once, so weight_bytes / this is the fastest a step can be.
    """
    x = torch.ones(size_bytes // 4, dtype=torch.float32, device=device)
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    x.sum()  # touch the pages
    sync()
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        sync()
        best = max(best, size_bytes / (time.perf_counter() - t0) / 1e9)
    return best


def environment() -> dict:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    import transformers

    from .. import __version__, kernels

    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "verispec": __version__,
        "verispec_kernels": kernels.isa(),  # the C++ kernels' instruction sets, or "none" if not built
        "python": platform.python_version(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
