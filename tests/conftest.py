import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
DEFAULT_THREADS = torch.get_num_threads()
# tests write GGUF files of their own: no native-load cache entries for them in the user's cache
# (tests/models/test_gguf_native.py turns it on, in a temporary cache, where it tests it)
os.environ.setdefault("VERISPEC_NATIVE_CACHE", "0")


@pytest.fixture(autouse=True)
def threads(request):
    """Tiny models: one intra-op thread is faster and, on a shared 2-core box, far steadier.
    Real-weight (slow) tests get torch's default."""
    torch.set_num_threads(DEFAULT_THREADS if request.node.get_closest_marker("slow") else 1)
    yield


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """One tiny HF directory per architecture, built once per session: {arch: path}."""
    from tiny import ARCH_EXTRA, make_hf_dir

    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_hf_dir(root / arch, arch) for arch in ARCH_EXTRA}
