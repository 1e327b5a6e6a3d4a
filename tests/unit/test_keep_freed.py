"""keep_freed_memory (train-head): freed large tensors stay in malloc's heap, so a step that re-makes a tensor of
the same size does not fault its pages in again; VERISPEC_KEEP_FREED=0 leaves malloc as it is. Each case runs in
its own process (mallopt settings last for the process)."""

import os
import subprocess
import sys

import pytest

PROBE = """
import resource, torch
from verispec.models.hugepages import keep_freed_memory
kept = keep_freed_memory()
torch.set_num_threads(1)
x, w = torch.randn(64, 256), torch.randn(131072, 256)
y = x @ w.T  # [64, 131072] float32: 32 MiB
del y
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    y = x @ w.T
    del y
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(keep: str) -> tuple[bool, int]:
    env = {**os.environ, "VERISPEC_KEEP_FREED": keep}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True).stdout
    kept, n = out.split()
    return kept == "True", int(n)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_blocks_are_reused_without_faulting_again():
    kept, n_kept = faults("1")
    left, n_left = faults("0")
    assert kept and not left
    assert n_left >= 10 and n_kept * 4 < n_left, (n_kept, n_left)  # each 32 MiB block faulted in again when unmapped
