"""GGUF files -> (HF-style config dict, HF-named float tensors), dequantizing K-quants on the way.

The GGUF -> HF tensor-name table lives here, in one place. llama.cpp's converter permutes the rows
of Q and K for the "llama" architecture (interleaved RoPE layout); we undo that on load.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
import torch

from ..errors import VerispecError
from .config import MASKED_TOKENS_KEY

# GGUF architecture -> HF model_type
GGUF_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

# GGUF tensor name -> HF tensor name ("{i}" is the layer index)
GGUF_TO_HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.attn_output.bias": "model.layers.{i}.self_attn.o_proj.bias",
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}
_PATTERNS = [(re.compile("^" + re.escape(g).replace(r"\{i\}", r"(\d+)") + "$"), h) for g, h in GGUF_TO_HF.items()]
ROPE_FREQS = "rope_freqs.weight"
UNUSED_TOKEN_TYPE = 5  # llama.cpp's LLAMA_TOKEN_TYPE_UNUSED: "[PAD151665]" and the like  # llama3-style per-frequency divisors


def hf_name(gguf_name: str) -> str | None:
    for pat, hf in _PATTERNS:
        m = pat.match(gguf_name)
        if m:
            return hf.replace("{i}", m.group(1)) if m.groups() else hf
    return None


class GGUFFile:
    """A parsed GGUF file: metadata, an HF-style config dict, and dequantized tensors on demand."""

    def __init__(self, path: str):
        from .gguf_reader import GGUFIndex

        self.path = path
        try:
            with open(path, "rb") as f:
                magic = f.read(4)
            if magic != b"GGUF":
                raise VerispecError(f"not a GGUF file (bad magic {magic!r}): {path}")
            index = GGUFIndex(path)
        except VerispecError:
            raise
        except OSError as e:
            raise VerispecError(f"cannot read GGUF file {path}: {e.strerror or e}") from None
        except Exception as e:  # struct / ValueError / the gguf enums on truncated or corrupt input
            raise VerispecError(f"corrupt or truncated GGUF file {path}: {_one_line(e)}") from None
        self.fields = index.fields  # {key: value}; numeric arrays as numpy arrays
        self.tensors = {t.name: t for t in index.tensors}

    def field(self, key: str, default=None):
        value = self.fields.get(key, default)
        return value.tolist() if isinstance(value, np.ndarray) else value

    @property
    def arch(self) -> str:
        return self.field("general.architecture", "?")

    def hf_config(self) -> dict:
        arch = self.arch
        if arch not in GGUF_ARCHS:
            raise VerispecError(f"unsupported architecture {arch!r} in GGUF file "
                                f"(supported: {', '.join(GGUF_ARCHS)})")
        a = arch
        needed = ("attention.head_count", "embedding_length", "block_count", "feed_forward_length")
        absent = [f"{a}.{k}" for k in needed if self.field(f"{a}.{k}") is None]
        absent += [t for t in ("token_embd.weight",) if t not in self.tensors]
        if absent:
            raise VerispecError(f"GGUF file {self.path} lacks the model metadata or tensors it needs: "
                                f"{', '.join(absent)}")
        try:
            return self._hf_config(arch)
        except (TypeError, ValueError, ZeroDivisionError) as e:  # e.g. a per-layer array where a count belongs
            raise VerispecError(f"malformed GGUF metadata in {self.path}: {_one_line(e)}") from None

    def _hf_config(self, arch: str) -> dict:
        a = arch
        heads = self.field(f"{a}.attention.head_count")
        hidden = self.field(f"{a}.embedding_length")
        tokens = self.fields.get("tokenizer.ggml.tokens")
        vocab = int(self.tensors["token_embd.weight"].shape[-1])
        eos = [self.field(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
        cfg = {
            "model_type": GGUF_ARCHS[arch],
            "vocab_size": vocab,
            "hidden_size": int(hidden),
            "intermediate_size": int(self.field(f"{a}.feed_forward_length")),
            "num_hidden_layers": int(self.field(f"{a}.block_count")),
            "num_attention_heads": int(heads),
            "num_key_value_heads": int(self.field(f"{a}.attention.head_count_kv", heads)),
            "head_dim": int(self.field(f"{a}.attention.key_length", int(hidden) // int(heads))),
            "rms_norm_eps": float(self.field(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
            "max_position_embeddings": int(self.field(f"{a}.context_length", 2048)),
            "rope_theta": float(self.field(f"{a}.rope.freq_base", 10000.0)),
            "tie_word_embeddings": "output.weight" not in self.tensors,
            "attention_bias": "blk.0.attn_q.bias" in self.tensors,
            "bos_token_id": self.field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": list(dict.fromkeys(int(e) for e in eos if e is not None)),
            "hidden_act": "silu",
        }
        types = self.field("tokenizer.ggml.token_type")
        unused = [i for i, t in enumerate(types or ()) if t == UNUSED_TOKEN_TYPE]
        if tokens is not None and len(tokens) < vocab:
            unused += range(len(tokens), vocab)
        if unused:  # padding rows of the embedding: never to be sampled or drafted
            cfg[MASKED_TOKENS_KEY] = unused
        if self.field(f"{a}.rope.scaling.type") == "linear":
            cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(self.field(f"{a}.rope.scaling.factor"))}
        if ROPE_FREQS in self.tensors:
            factors = self._dequantize(self.tensors[ROPE_FREQS]).reshape(-1).tolist()
            cfg["rope_scaling"] = {"rope_type": "freq_factors", "factors": factors}
        return cfg

    def _dequantize(self, t) -> np.ndarray:
        from gguf.quants import dequantize

        try:
            arr = dequantize(t.data, t.tensor_type)
        except Exception as e:
            raise VerispecError(f"cannot decode tensor {t.name} ({t.tensor_type.name}) in {self.path}: "
                                f"{_one_line(e)}") from None
        return arr.reshape(tuple(int(d) for d in reversed(t.shape.tolist())))

    def hf_tensors(self, dtype: torch.dtype, progress=None, native: bool = False) -> Iterator[tuple[str, object]]:
        """Yield (HF name, tensor) for every weight, dequantized to float32 then cast to ``dtype``.

        native: matrices in a type the native kernel runs (gguf_native.supported) come as a
        gguf_native.NativePart instead, their blocks decoded but not dequantized (the embedding table
        is always dequantized: it is looked up, not multiplied)."""
        from . import gguf_native

        cfg = self.hf_config()
        permute = self.arch == "llama"
        for name, t in self.tensors.items():
            hf = hf_name(name)
            if hf is None:
                if name != ROPE_FREQS:
                    raise VerispecError(f"unexpected tensor {name!r} in GGUF file {self.path}")
                continue
            type_name, dims = t.tensor_type.name, [int(d) for d in t.shape.tolist()]
            if native and len(dims) == 2 and hf != "model.embed_tokens.weight" and gguf_native.supported(type_name, dims[0]):
                yield hf, self._native_part(t, type_name, dims, cfg, permute)
                if progress is not None:
                    progress.update(t.n_bytes)
                continue
            arr = np.ascontiguousarray(self._dequantize(t), dtype=np.float32)
            w = torch.from_numpy(arr if arr.flags.writeable else arr.copy())
            if permute and ".attn_q." in name:
                w = _unpermute(w, cfg["num_attention_heads"])
            elif permute and ".attn_k." in name:
                w = _unpermute(w, cfg["num_key_value_heads"])
            if progress is not None:
                progress.update(t.n_bytes)
            yield hf, w.to(dtype)


    def _native_part(self, t, type_name: str, dims: list[int], cfg: dict, permute: bool):
        from . import gguf_native

        K, N = dims
        try:
            q, scales = gguf_native.decode(np.asarray(t.data), type_name, N, K)
        except (ValueError, TypeError) as e:
            raise VerispecError(f"cannot decode tensor {t.name} ({type_name}) in {self.path}: {_one_line(e)}") from None
        if permute and ".attn_q." in t.name:
            q, scales = (np.ascontiguousarray(_unpermute(a, cfg["num_attention_heads"])) for a in (q, scales))
        elif permute and ".attn_k." in t.name:
            q, scales = (np.ascontiguousarray(_unpermute(a, cfg["num_key_value_heads"])) for a in (q, scales))
        return gguf_native.NativePart(type_name, q, scales)


def _unpermute(w, n_head: int):
    """Undo llama.cpp's Q/K row permutation: per head, rows stored as [hd/2, 2] go back to [2, hd/2].
    A torch tensor or a numpy array (the rows of decoded native blocks: a row is whole weights either way)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _one_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return f"{type(e).__name__}: {s[0] if s else ''}"[:300]
