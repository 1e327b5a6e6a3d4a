"""Load a model from a name, an HF directory (config.json + *.safetensors) or a GGUF file.

HF tensor names map onto ours in one table (HF_FUSED plus a prefix strip); GGUF names map onto HF
names in gguf.py. Every failure a user can cause ends in a one-line VerispecError.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import kernels
from ..config import WEIGHTS, env_flag
from ..errors import VerispecError
from ..tokenizer import load_tokenizer
from . import hugepages
from .config import ModelConfig
from .gguf_native import NativePart, NativeWeight
from .linear import Linear
from .llama import Transformer, rope_inv_freq

# Our fused parameters <- the HF parameters concatenated along the output dimension, in order.
HF_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
_PART_OF = {part: (fused, i) for fused, parts in HF_FUSED.items() for i, part in enumerate(parts)}
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)\.(weight|bias)$")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


@dataclass
class LoadedModel:
    model: Transformer
    config: ModelConfig
    tokenizer: object | None  # transformers tokenizer, or None (token ids only)
    source: str  # what was loaded, for messages and benchmark reports


def load(source: str, dtype: torch.dtype = torch.bfloat16, device: str = "cpu",
         progress: bool = True, weights: str = "dequantized") -> LoadedModel:
    """Load a named default model, an HF directory or a .gguf file.

    weights="native": a GGUF model's quantized matrices stay in their GGUF blocks and run on
    csrc/linear_gguf.cpp (CPU, bf16 or fp32, kernels built); a named model is then read from its GGUF file.
    "auto": native on CPU in bf16 with a vectorized kernel (AVX512-VNNI or AVX2: fewer bytes per token,
    exact speculation), else dequantized. Other sources, and
    matrices of types without a native kernel, load dequantized."""
    from . import registry

    native = native_weights(source, weights, dtype, device)
    if source in registry.REGISTRY:
        if native:
            path = registry.gguf_path(source, progress=progress)
            tokenizer_dir = registry.model_dir(source) if registry.is_cached(source) else None
            return load_gguf(path, dtype, device, progress=progress, native=True, name=source,
                             tokenizer_dir=tokenizer_dir)
        return load_hf_dir(registry.pull(source, progress=progress), dtype, device, name=source)
    path = Path(source).expanduser()
    if path.is_dir():
        return load_hf_dir(path, dtype, device)
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return load_gguf(path, dtype, device, progress=progress, native=native)
        raise VerispecError(f"unsupported model file {source!r}: expected a directory with config.json "
                            f"and *.safetensors, or a .gguf file")
    if os.sep in source or source.endswith(".gguf") or source.startswith("."):
        raise VerispecError(f"model path not found: {source}")
    raise VerispecError(f"unknown model {source!r}: not a known name ({', '.join(registry.REGISTRY)}), "
                        f"directory or .gguf file")


def native_weights(source: str, weights: str, dtype: torch.dtype, device: str) -> bool:
    """Whether ``load(source, dtype, device, weights=weights)`` keeps GGUF matrices quantized. "auto": for a
    GGUF source (a .gguf file or a named model) on CPU in bf16 where the kernels are vectorized (AVX512-VNNI
    or AVX2; the portable path is plain C++)."""
    from . import registry
    from .linear import can_run_native

    if weights not in WEIGHTS:
        raise VerispecError(f"weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    if weights != "auto":
        return weights == "native"
    gguf = source in registry.REGISTRY or str(source).lower().endswith(".gguf")
    return gguf and dtype == torch.bfloat16 and can_run_native(device, dtype) and kernels.fast()


def auto_dtype(source: str, weights: str, device: str, draft: str | None = None) -> torch.dtype:
    """``dtype="auto"``: bf16 on a GPU, on a CPU with bf16 matrix hardware (avx512_bf16 / AMX), and for a
    target whose matrices run on the native GGUF kernels (they take bf16 activations). Else float32: without
    that hardware a bf16 product over several rows is emulated, several times an fp32 one, so a verify pass
    costs far more in bf16 and speculation gains less (measured on a Zen 1 CPU: docs/BENCHMARKS.md, "Which dtype
    on a CPU without avx512_bf16"). Unless the float32 weights of target and draft would take over half the
    available memory: then bf16, which fits."""
    from .linear import fast_bf16_matmul

    if torch.device(device).type != "cpu" or fast_bf16_matmul():
        return torch.bfloat16
    if native_weights(source, weights, torch.bfloat16, device):
        return torch.bfloat16
    need = sum(float32_bytes(s) for s in (source, draft) if s)
    free = available_memory()
    return torch.bfloat16 if free is not None and need > free // 2 else torch.float32


def float32_bytes(source: str) -> int:
    """An estimate of a model's weights in float32, from its files' headers (0 if it cannot be told yet)."""
    from . import registry

    entry = registry.REGISTRY.get(source)
    if entry is not None:  # GGUF Q4_K_M: ~5 bits a weight on disk
        return entry.gguf_bytes * 32 // 5
    path = Path(source).expanduser()
    try:
        if path.is_dir():
            return 4 * sum(_safetensors_numel(f) for f in path.glob("*.safetensors"))
        if path.is_file() and path.suffix.lower() == ".gguf":
            from .gguf_reader import GGUFIndex

            return 4 * sum(t.n_elements for t in GGUFIndex(str(path)).tensors)
    except Exception:  # noqa: BLE001 - a bad file is reported by load() itself, with its own message
        return 0
    return 0


def _safetensors_numel(path: Path) -> int:
    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    numel = 0
    for key, info in header.items():
        if key != "__metadata__":
            n = 1
            for d in info["shape"]:
                n *= d
            numel += n
    return numel


def available_memory() -> int | None:
    """MemAvailable from /proc/meminfo in bytes (None where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def load_hf_dir(path: Path, dtype: torch.dtype, device: str, name: str | None = None) -> LoadedModel:
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise VerispecError(f"{path} has no config.json: not an HF model directory")
    try:
        raw = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise VerispecError(f"cannot parse {cfg_path}: {e}") from None
    gen_path = path / "generation_config.json"
    if gen_path.is_file():
        try:
            gen_eos = json.loads(gen_path.read_text()).get("eos_token_id")
        except (OSError, ValueError) as e:
            raise VerispecError(f"cannot parse {gen_path}: {e}") from None
        raw = {**raw, "eos_token_id": _merge_ids(raw.get("eos_token_id"), gen_eos)}
    cfg = ModelConfig.from_hf(raw)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        hint = " (only .bin weights found: convert them to safetensors)" if list(path.glob("*.bin")) else ""
        raise VerispecError(f"no *.safetensors weights in {path}{hint}")
    model = build_model(cfg, _read_safetensors(files, dtype), dtype, device)
    tokenizer = load_tokenizer(path) if any((path / f).is_file() for f in TOKENIZER_FILES) else None
    return LoadedModel(model, cfg, tokenizer, name or str(path))


def load_gguf(path: Path, dtype: torch.dtype, device: str, progress: bool = False, native: bool = False,
              name: str | None = None, tokenizer_dir: Path | None = None) -> LoadedModel:
    """``tokenizer_dir``: a directory holding the file's tokenizer already converted (a pulled named model's):
    transformers takes far longer to build a 150k-token tokenizer from GGUF metadata than to read it back
    (docs/BENCHMARKS.md, "Load time")."""
    from .linear import can_run_native
    from .registry import cache_lock

    native = native and can_run_native(device, dtype)
    cache = native_cache_dir(path, dtype) if native else None
    if cache is not None and (cache / DONE).is_file():
        try:
            return _load_native_cache(cache, dtype, device, name or str(path))
        except Exception:  # noqa: BLE001 - any damage (safetensors raises its own kinds): rebuild it
            shutil.rmtree(cache, ignore_errors=True)  # stale or damaged: rebuilt from the GGUF file below
    if cache is None:
        return _load_gguf(path, dtype, device, progress, native, name, None, tokenizer_dir)
    with cache_lock(cache.name):  # one process builds the cache; one started meanwhile waits, then reads it
        if (cache / DONE).is_file():
            return _load_native_cache(cache, dtype, device, name or str(path))
        return _load_gguf(path, dtype, device, progress, native, name, cache, tokenizer_dir)


def _load_gguf(path: Path, dtype: torch.dtype, device: str, progress: bool, native: bool, name: str | None,
               cache: Path | None, tokenizer_dir: Path | None = None) -> LoadedModel:
    from .gguf import GGUFFile
    from .registry import progress_bar

    gf = GGUFFile(str(path))
    raw = gf.hf_config()
    cfg = ModelConfig.from_hf(raw)
    total = sum(int(t.n_bytes) for t in gf.tensors.values())
    with progress_bar(total, f"{'load' if native else 'dequantize'} {path.name}", progress) as bar:
        model = build_model(cfg, gf.hf_tensors(dtype, progress=bar, native=native), dtype, device)
    if tokenizer_dir is not None:
        tokenizer = load_tokenizer(tokenizer_dir)
    elif "tokenizer.ggml.tokens" in gf.fields:
        tokenizer = load_tokenizer(path.parent, gguf_file=path.name)
    else:
        tokenizer = None
    if cache is not None:
        _save_native_cache(cache, raw, model, tokenizer)
    return LoadedModel(model, cfg, tokenizer, name or str(path))


DONE = "verispec-native.json"


def native_cache_dir(path: Path, dtype: torch.dtype) -> Path | None:
    """Where a native load of ``path`` keeps its re-laid-out blocks (parsing and re-ordering a 1.5B GGUF takes
    far longer than reading them back: docs/BENCHMARKS.md, "Load time"). Keyed by the file's name, size and
    mtime, the dtype of the other tensors and the kernel's layout version (a cache of an older layout is not
    read). VERISPEC_NATIVE_CACHE=0 turns it off."""
    from .gguf_native import LAYOUT
    from .registry import cache_dir

    if not env_flag("VERISPEC_NATIVE_CACHE"):
        return None
    st = path.stat()
    return cache_dir() / "native" / f"{path.stem}-{st.st_size}-{st.st_mtime_ns}-{str(dtype).split('.')[-1]}-l{LAYOUT}"


def _older_layouts(cache: Path) -> list[Path]:
    """native_cache_dir's entries for the same file and dtype in older layouts (layout 1 had no suffix)."""
    from .gguf_native import LAYOUT

    key = cache.name.removesuffix(f"-l{LAYOUT}")
    return [cache.with_name(key)] + [cache.with_name(f"{key}-l{n}") for n in range(2, LAYOUT)]


def _save_native_cache(cache: Path, raw_config: dict, model: Transformer, tokenizer) -> None:
    from safetensors.torch import save_file

    tmp = cache.with_name(cache.name + ".tmp")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        tensors = {f"model.{k}": t.contiguous() for k, t in model.dense_state_dict().items()
                   if not (k == "lm_head.weight" and model.config.tie_word_embeddings)}
        for k, m in model.named_modules():
            if isinstance(m, Linear) and m.native is not None:
                for part, t in zip(("q", "s", "meta"), m.native.tensors):
                    tensors[f"native.{k}.{part}"] = t
        save_file(tensors, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(raw_config))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        (tmp / DONE).write_text(json.dumps({"format": 1}))
        shutil.rmtree(cache, ignore_errors=True)
        tmp.replace(cache)
        for old in _older_layouts(cache):  # the same file and dtype in an older layout: no longer read
            shutil.rmtree(old, ignore_errors=True)
    except OSError:  # a read-only or full cache only costs the next load its speed
        shutil.rmtree(tmp, ignore_errors=True)


def _load_native_cache(cache: Path, dtype: torch.dtype, device: str, source: str) -> LoadedModel:
    from safetensors import safe_open

    cfg = ModelConfig.from_hf(json.loads((cache / "config.json").read_text()))

    def tensors():
        with safe_open(str(cache / "model.safetensors"), framework="pt") as sf:
            keys = list(sf.keys())
            for k in keys:
                if k.startswith("model."):
                    yield k, sf.get_tensor(k)
            for k in keys:
                if k.startswith("native.") and k.endswith(".q"):
                    base = k[len("native."):-len(".q")]
                    yield f"model.{base}.weight", NativeWeight(
                        sf.get_tensor(k), sf.get_tensor(f"native.{base}.s"), sf.get_tensor(f"native.{base}.meta"))

    model = build_model(cfg, tensors(), dtype, device)
    tokenizer = load_tokenizer(cache) if any((cache / f).is_file() for f in TOKENIZER_FILES) else None
    return LoadedModel(model, cfg, tokenizer, source)


def _read_safetensors(files: list[Path], dtype: torch.dtype) -> Iterable[tuple[str, torch.Tensor]]:
    for f in files:
        try:
            yield from _safetensors_tensors(f, dtype)
        except VerispecError:
            raise
        except Exception as e:
            msg = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            raise VerispecError(f"corrupt or truncated safetensors file {f}: {msg}") from None


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool}


def _safetensors_tensors(path: Path, dtype: torch.dtype) -> Iterable[tuple[str, torch.Tensor]]:
    """Each tensor of one safetensors file, read into memory of its own and cast to ``dtype``, one at a time.

    Plain reads, not a memory map: pages of a mapped file stay resident while it is open, so a bf16 file cast to
    float32 through a map held the whole file (3.5 GB for the 1.5B target) beside the 7 GB of float32 weights at
    the peak of the load. A read keeps one tensor's bytes at a time."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise ValueError("file shorter than its 8-byte header length")
        n = int.from_bytes(head, "little")
        if n > size - 8:
            raise ValueError(f"header of {n} bytes in a file of {size}")
        header = json.loads(fh.read(n))
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
        base = 8 + n
        for key, info in header.items():
            if key == "__metadata__":
                continue
            if info.get("dtype") not in _SAFETENSORS_DTYPES:
                raise ValueError(f"tensor {key!r}: unsupported dtype {info.get('dtype')!r}")
            dt, shape = _SAFETENSORS_DTYPES[info["dtype"]], [int(d) for d in info["shape"]]
            lo, hi = (int(o) for o in info["data_offsets"])
            numel = 1
            for d in shape:
                numel *= d
            if not 0 <= lo <= hi <= size - base or hi - lo != numel * dt.itemsize:
                raise ValueError(f"tensor {key!r}: data offsets {lo}..{hi} do not fit its shape or the file")
            buf = bytearray(hi - lo)
            fh.seek(base + lo)
            if fh.readinto(buf) != len(buf):
                raise ValueError(f"tensor {key!r}: file ends inside its data")
            t = torch.frombuffer(buf, dtype=dt) if buf else torch.empty(0, dtype=dt)
            yield key, t.reshape(shape).to(dtype)


def _merge_ids(a, b) -> list[int]:
    as_list = lambda x: [] if x is None else (list(x) if isinstance(x, (list, tuple)) else [x])  # noqa: E731
    return list(dict.fromkeys(as_list(a) + as_list(b)))


def _fused_rows(cfg: ModelConfig, fused: str) -> tuple[int, ...]:
    """Output rows of each HF part of a fused parameter, in HF_FUSED order."""
    if fused == "self_attn.qkv_proj":
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        return (q, kv, kv)
    return (cfg.intermediate_size, cfg.intermediate_size)


def _fuse(parts: list) -> object:
    """Parts of a fused matrix -> one tensor, or a NativePart list when every part stayed quantized (a mix
    dequantizes the native parts: one matrix, one kind of kernel)."""
    native = [isinstance(p, NativePart) for p in parts]
    if all(native):
        return parts
    if any(native):
        parts = [p.dequantized() if n else p.float() for p, n in zip(parts, native)]
    return torch.cat(parts, dim=0)


def build_model(cfg: ModelConfig, hf_tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype,
                device: str) -> Transformer:
    """Instantiate the runtime without initializing weights, then assign HF-named tensors (fusing)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    expected = dict(model.state_dict())
    sd: dict[str, object] = {}  # tensors, or gguf_native.NativePart lists for matrices kept quantized
    pending: dict[str, list] = {}
    for name, t in hf_tensors:
        ours = name.removeprefix("model.")
        m = _LAYER.match(ours)
        if m and m.group(2) in _PART_OF:
            fused, idx = _PART_OF[m.group(2)]
            key = f"layers.{m.group(1)}.{fused}.{m.group(3)}"
            if key not in expected:  # e.g. a q_proj.bias for a config without attention bias
                raise VerispecError(f"unexpected tensor {name!r} for a {cfg.model_type} model")
            want = (_fused_rows(cfg, fused)[idx], *expected[key].shape[1:])
            if tuple(t.shape) != want:  # check each part: torch.cat would fail with a raw RuntimeError
                raise VerispecError(f"tensor {name!r} has shape {tuple(t.shape)}, config implies {want}")
            parts = pending.setdefault(key, [None] * len(HF_FUSED[fused]))
            parts[idx] = t
            if all(p is not None for p in parts):
                sd[key] = _fuse(pending.pop(key))
            continue
        if ours not in expected:
            if ours == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            if ours.endswith("rotary_emb.inv_freq"):
                continue
            raise VerispecError(f"unexpected tensor {name!r} for a {cfg.model_type} model")
        sd[ours] = [t] if isinstance(t, NativePart) else t  # a NativeWeight (cached load) as it is
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
        expected.pop("lm_head.weight", None)
    missing = []  # in HF names: the absent parts of a fused tensor, not our fused name
    for k in expected:
        if k in sd:
            continue
        m = _LAYER.match(k)
        if m and m.group(2) in HF_FUSED:
            got = pending.get(k, [None] * len(HF_FUSED[m.group(2)]))
            missing += [f"layers.{m.group(1)}.{part}.{m.group(3)}" for part, t in zip(HF_FUSED[m.group(2)], got)
                        if t is None]
        else:
            missing.append(k)
    if missing:
        raise VerispecError(f"model weights incomplete: missing {missing[0]!r} and {len(missing) - 1} more")
    native = {k: v if isinstance(v, NativeWeight) else NativeWeight.from_parts(v) for k, v in sd.items()
              if isinstance(v, (list, NativeWeight))}
    for k, t in sd.items():
        shape = (native[k].out_features, native[k].in_features) if k in native else tuple(t.shape)
        if shape != tuple(expected[k].shape):
            raise VerispecError(f"tensor {k!r} has shape {shape}, config implies {tuple(expected[k].shape)}")
    model.load_state_dict({k: t for k, t in sd.items() if k not in native}, strict=False, assign=True)
    sd.clear()  # the model holds its tensors alone now: packing below frees each plain weight as it packs it
    t = None
    if cfg.tie_word_embeddings:
        model.tie_weights()
    for k, w in native.items():
        model.get_submodule(k.removesuffix(".weight")).set_native(w)
    model = model.to(device=device, dtype=dtype).eval()
    for m in model.modules():  # biases were cast with the model
        if isinstance(m, Linear) and m.native is not None and m.bias is not None:
            m.qbias = m.bias.detach().float()
    layer_linears = [m for layer in model.layers for m in layer.modules() if isinstance(m, Linear)]
    model.fused_quantized = bool(native) and all(m.native is not None for m in layer_linears)
    model.inv_freq = rope_inv_freq(cfg).to(device)  # built on meta above
    model.pack_weights()
    hugepages.place_model(model)  # native matrices: streamed every step
    return model
