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


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(items):
    """With xdist workers (``-n 2 --dist loadgroup``, README) the real-weight tests all go to one of them, in turn,
    so that only one worker loads the default models at a time."""
    for item in items:
        if item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.xdist_group("real-weights"))


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
