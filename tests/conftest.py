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
# train-head keeps freed memory in malloc for the rest of its process; tests call it in the workers, which
# should hand memory back between tests (tests/unit/test_keep_freed.py tests it in processes of its own)
os.environ.setdefault("VERISPEC_KEEP_FREED", "0")


REAL_WEIGHTS = "tests/slow/"  # the only tests that load the default models (6 GB float32 target and more)
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """``-n 2`` (README): every real-weight test goes to one worker, first, as one unit, while the other runs the
    tiny-model modules; so at most one process holds the default models (11.1 GB in use, not 17.9). Other modes
    (``--dist loadfile`` ...) are left to xdist."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class RealWeightsFirst(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:  # a tiny-model module is a unit; all real-weight tests are one
            return REAL_WEIGHTS if nodeid.startswith(REAL_WEIGHTS) else nodeid.split("::", 1)[0]

        def schedule(self) -> None:
            if self.collection is None and self.collection_is_completed:
                nodeids = next(iter(self.registered_collections.values()))  # the longest unit starts first
                real = {n: False for n in nodeids if n.startswith(REAL_WEIGHTS)}
                if real:
                    self.workqueue[REAL_WEIGHTS] = real
            super().schedule()

    return RealWeightsFirst(config, log)


@pytest.fixture(autouse=True)
def threads(request):
    """Tiny models: one intra-op thread is faster and, on a shared 2-core box, far steadier.
    Real-weight (slow) tests get torch's default, shared out among xdist workers."""
    slow = request.node.get_closest_marker("slow")
    torch.set_num_threads(max(1, DEFAULT_THREADS // WORKERS) if slow else 1)
    yield


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """One tiny HF directory per architecture, built once per session: {arch: path}."""
    from tiny import ARCH_EXTRA, make_hf_dir

    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_hf_dir(root / arch, arch) for arch in ARCH_EXTRA}
