"""The kernels' matrices copied into 2 MB pages (models/hugepages.py): same values, same outputs, and the
mapping really asks the kernel for huge pages."""

import mmap
import re
import sys

import pytest
import torch

from verispec import kernels
from verispec.models import hugepages, loader
from verispec.models.kv_cache import KVCache
from verispec.models.linear import Linear

needs_madvise = pytest.mark.skipif(not hugepages.available(), reason="no madvise(MADV_HUGEPAGE) here")


def tensors():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (7, 13), dtype=torch.uint8, generator=g), torch.randn(5, 3, generator=g),
            torch.empty(0, dtype=torch.int64), torch.randn(33, generator=g).half(),
            torch.arange(6, dtype=torch.int64).view(2, 3)]


@needs_madvise
def test_relocate_copies_each_tensor_exactly_into_one_aligned_mapping():
    ts = tensors()
    out = hugepages.relocate(ts)
    assert out is not ts and len(out) == len(ts)
    for a, b in zip(ts, out):
        assert b.dtype == a.dtype and b.shape == a.shape and torch.equal(a, b)
        if a.numel():  # (an empty tensor has no address)
            assert b.data_ptr() % hugepages.ALIGN == 0 and b.data_ptr() != a.data_ptr()
    base = out[0].untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == base for t in out)  # one mapping
    assert out[0].data_ptr() % hugepages.PAGE == 0  # which starts on a 2 MB boundary
    out[0][0, 0] = 255 - ts[0][0, 0]  # copies, not views of the inputs
    assert out[0][0, 0] != ts[0][0, 0]


def vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping that holds ``address`` (/proc/self/smaps)."""
    for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", open("/proc/self/smaps").read()):
        lo, hi = (int(v, 16) for v in block.split()[0].split("-"))
        if lo <= address < hi:
            return re.search(r"VmFlags:(.*)", block).group(1).split()
    raise AssertionError(f"no mapping holds {address:#x}")


@needs_madvise
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_the_mapping_is_advised_for_huge_pages():
    out = hugepages.relocate([torch.ones(3 * hugepages.PAGE, dtype=torch.uint8)])[0]
    assert "hg" in vm_flags(out.data_ptr())  # MADV_HUGEPAGE reached the kernel
    # control: the same kind of mapping without the advice has no such flag (not a torch tensor: verispec sets
    # THP_MEM_ALLOC_ENABLE=1, so torch's allocator advises its own blocks of 2 MB and more)
    plain = mmap.mmap(-1, 3 * hugepages.PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    assert "hg" not in vm_flags(torch.frombuffer(plain, dtype=torch.uint8).data_ptr())


def resident_kb(path) -> int:
    """Resident kB of this process's mappings of the file ``path``."""
    total = 0
    for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", open("/proc/self/smaps").read()):
        if block.split("\n")[0].endswith(str(path)):
            total += int(re.search(r"\nRss:\s+(\d+)", block).group(1))
    return total


@needs_madvise
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_tensors_read_from_a_mapped_file_let_go_of_its_pages(tmp_path):
    """The native-load cache is a safetensors file read through mmap: its pages stay mapped while any of its
    tensors lives (the embedding table does). Copied into huge pages, the matrices' pages are handed back."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = tmp_path / "w.safetensors"
    g = torch.Generator().manual_seed(0)
    save_file({"q": torch.randint(0, 256, (8 << 20,), dtype=torch.uint8, generator=g),
               "keep": torch.ones(1 << 20, dtype=torch.uint8)}, str(path))
    with safe_open(str(path), framework="pt") as f:
        q, keep = f.get_tensor("q"), f.get_tensor("keep")
    total = int(q.sum())  # every page of q read: resident
    before = resident_kb(path)
    assert before >= 8 << 10  # (the control: read pages of a mapped file count as resident)
    copy = hugepages.relocate([q])[0]
    assert int(copy.sum()) == total
    assert resident_kb(path) < before - (7 << 10)  # q's 8 MB left the process's resident memory
    assert int(q.sum()) == total and keep.numel() == 1 << 20  # a hint only: the file still reads the same


def test_switched_off_or_empty_it_leaves_the_tensors_where_they_are(monkeypatch):
    ts = tensors()
    assert hugepages.relocate([]) == []
    monkeypatch.setenv("VERISPEC_HUGE_PAGES", "0")
    assert not hugepages.available()
    assert hugepages.relocate(ts) is ts


@needs_madvise
@pytest.mark.skipif(not kernels.available(), reason="C++ kernels not built")
@pytest.mark.parametrize("bits", [8, 4])
def test_a_quantized_model_in_huge_pages_computes_the_same_logits(tiny_dirs, monkeypatch, bits):
    def logits(model):
        cache = KVCache.for_model(model.config, 1, 64, model.dtype)
        ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(1))
        model(ids[:, :20], torch.arange(20)[None], cache, num_logits=1)
        return torch.cat([model(ids[:, p:p + T], torch.arange(p, p + T)[None], cache)[0]  # fused layers
                          for p, T in ((20, 1), (21, 3))], dim=1)

    monkeypatch.setenv("VERISPEC_HUGE_PAGES", "0")
    plain = loader.load(str(tiny_dirs["qwen2"]), dtype=torch.bfloat16).model
    assert plain.quantize_weights(bits)
    monkeypatch.setenv("VERISPEC_HUGE_PAGES", "1")
    placed = loader.load(str(tiny_dirs["qwen2"]), dtype=torch.bfloat16).model
    assert placed.quantize_weights(bits)
    lins = [m for m in placed.modules() if isinstance(m, Linear)]
    assert lins and all(m.in_huge_pages for m in lins)
    assert not any(m.in_huge_pages for m in plain.modules() if isinstance(m, Linear))
    assert hugepages.place_model(placed) == 0  # placed once
    assert torch.equal(logits(plain), logits(placed))
