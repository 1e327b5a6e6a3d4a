"""The fused C++ decoder layer (csrc/decoder_layer.cpp) computes what models/llama.py computes.

Both paths use the same int8 kernel for the matrices and the same bf16 roundings around them; only
attention sums in another order, so logits agree to bf16 noise. A wrong RoPE, mask, norm or cache write
moves them by orders of magnitude more (the negative control below breaks RoPE on purpose).
"""

import pytest
import torch

from verispec import kernels
from verispec.models import loader
from verispec.models.kv_cache import KVCache
from tiny import make_hf_dir

pytestmark = pytest.mark.skipif(not kernels.available(), reason="C++ kernels not built")


def run(model, ids, chunks, fused):
    """Prefill ids[:20] (unfused: > 16 tokens), then feed the rest in the given chunk sizes."""
    model.fused_quantized = fused
    cache = KVCache.for_model(model.config, 1, 64, model.dtype)
    model(ids[:, :20], torch.arange(20)[None], cache, num_logits=1)
    out, pos = [], 20
    for T in chunks:
        logits, _ = model(ids[:, pos:pos + T], torch.arange(pos, pos + T)[None], cache)
        out.append(logits)
        pos += T
    return torch.cat(out, dim=1), cache


def rel_diff(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def sliding_dir(tmp_path_factory):
    return make_hf_dir(tmp_path_factory.mktemp("sw") / "mistral", "mistral", sliding_window=8)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama3", "smollm2", "sliding"])
def test_fused_layer_matches_the_python_layer(arch, tiny_dirs, sliding_dir):
    path = sliding_dir if arch == "sliding" else tiny_dirs[arch]
    model = loader.load(str(path), dtype=torch.bfloat16).model
    assert model.quantize_weights()
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (1, 44))
    chunks = [1, 1, 3, 16, 2, 1]
    fused, cf = run(model, ids, chunks, True)
    plain, cp = run(model, ids, chunks, False)
    assert rel_diff(fused, plain) < 1e-3  # measured: 0.0 (bitwise equal) on every arch here
    n = cp.length
    assert rel_diff(cf.k[:, :, :, :n].float(), cp.k[:, :, :, :n].float()) < 1e-3  # same keys written
    assert rel_diff(cf.v[:, :, :, :n].float(), cp.v[:, :, :, :n].float()) < 1e-3


def test_negative_control_a_broken_rope_is_caught(tiny_dirs, monkeypatch):
    model = loader.load(str(tiny_dirs["qwen2"]), dtype=torch.bfloat16).model
    model.quantize_weights()
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (1, 44))
    plain, _ = run(model, ids, [1, 3, 16], False)
    real_rope = model.rope
    monkeypatch.setattr(model, "rope", lambda pos, dtype: real_rope(pos + 1, dtype))  # off by one position
    broken, _ = run(model, ids, [1, 3, 16], True)
    assert rel_diff(broken, plain) > 1e-2  # measured: 0.034
