"""Write tiny GGUF files from a transformers model the way llama.cpp's converter does.

Independent of verispec: our own name table and un-permutation are what the tests check, so this
module has its own copy of llama.cpp's tensor names and of its Q/K row permutation. Every written
tensor also records the float32 weight a correct loader must produce (``expected``, HF layout):
for F32 the weight itself, for F16/Q8_0/Q4_0/... the round trip through that format, for the K-quants
(no quantizer in gguf-py) the dequantization of the random raw blocks written in its place.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize

# llama.cpp tensor names for the HF names (after "model."), per layer with {i}
HF_TO_GGUF = {
    "embed_tokens.weight": "token_embd.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "layers.{i}.input_layernorm.weight": "blk.{i}.attn_norm.weight",
    "layers.{i}.post_attention_layernorm.weight": "blk.{i}.ffn_norm.weight",
    "layers.{i}.self_attn.q_proj.weight": "blk.{i}.attn_q.weight",
    "layers.{i}.self_attn.q_proj.bias": "blk.{i}.attn_q.bias",
    "layers.{i}.self_attn.k_proj.weight": "blk.{i}.attn_k.weight",
    "layers.{i}.self_attn.k_proj.bias": "blk.{i}.attn_k.bias",
    "layers.{i}.self_attn.v_proj.weight": "blk.{i}.attn_v.weight",
    "layers.{i}.self_attn.v_proj.bias": "blk.{i}.attn_v.bias",
    "layers.{i}.self_attn.o_proj.weight": "blk.{i}.attn_output.weight",
    "layers.{i}.self_attn.o_proj.bias": "blk.{i}.attn_output.bias",
    "layers.{i}.self_attn.q_norm.weight": "blk.{i}.attn_q_norm.weight",
    "layers.{i}.self_attn.k_norm.weight": "blk.{i}.attn_k_norm.weight",
    "layers.{i}.mlp.gate_proj.weight": "blk.{i}.ffn_gate.weight",
    "layers.{i}.mlp.up_proj.weight": "blk.{i}.ffn_up.weight",
    "layers.{i}.mlp.down_proj.weight": "blk.{i}.ffn_down.weight",
}


def gguf_name(hf: str) -> str:
    hf = hf.removeprefix("model.")
    parts = hf.split(".")
    if parts[0] == "layers":
        i = parts[1]
        return HF_TO_GGUF["layers.{i}." + ".".join(parts[2:])].replace("{i}", i)
    return HF_TO_GGUF[hf]


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute (rows of Q or K; works on byte rows too)."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_kquant(rows: int, cols: int, qtype: Q, rng: np.random.Generator, scale: float = 1.0) -> np.ndarray:
    """Valid raw Q4_K / Q5_K / Q6_K blocks [rows, bytes]: random quants and scales, small finite fp16 scales
    (``scale`` multiplies them: larger weights)."""
    block, size = GGML_QUANT_SIZES[qtype]
    assert cols % block == 0
    n = rows * (cols // block)
    raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    if qtype in (Q.Q4_K, Q.Q5_K):  # d (f16), dmin (f16), scales[12], [Q5_K: qh[32]], qs[128]
        raw[:, 0:2] = (scale * rng.uniform(1e-4, 3e-4, n)).astype(np.float16).view(np.uint8).reshape(n, 2)
        raw[:, 2:4] = (scale * rng.uniform(1e-3, 3e-3, n)).astype(np.float16).view(np.uint8).reshape(n, 2)
    elif qtype == Q.Q6_K:  # ql[128], qh[64], scales[16] (int8), d (f16)
        raw[:, -2:] = (scale * rng.uniform(1e-5, 3e-5, n)).astype(np.float16).view(np.uint8).reshape(n, 2)
    else:
        raise ValueError(qtype)
    return raw.reshape(rows, cols // block * size)


def encode(w: np.ndarray, qtype: Q, rng: np.random.Generator,
           kquant_scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """(array to write, HF-layout float32 weight it stands for), both un-permuted."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    if qtype == Q.F32:
        return w, w.copy()
    if qtype == Q.F16:
        data = w.astype(np.float16)
        return data, data.astype(np.float32)
    if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        data = random_kquant(w.shape[0], w.shape[1], qtype, rng, kquant_scale)
        return data, dequantize(data, qtype).reshape(w.shape).astype(np.float32)
    data = quantize(w, qtype)
    return data, dequantize(data, qtype).reshape(w.shape).astype(np.float32)


def write_gguf(path: Path, arch: str, hf_model, types: dict[str, Q] | None = None, seed: int = 0,
               rope_freqs: np.ndarray | None = None, eos_token_id: int | None = 256,
               extra_kv=None, drop: tuple[str, ...] = (),
               extra_tensors: dict[str, np.ndarray] | None = None,
               tokens: list[str] | None = None, kquant_scale: float = 1.0) -> dict[str, np.ndarray]:
    """Write ``hf_model`` as GGUF ``arch``; return {HF name: expected float32 weight}.

    types: GGUF tensor name suffix (e.g. "attn_q.weight" or "blk.0.ffn_down.weight") -> type; the
    longest matching suffix wins; default F32 for 1-D tensors and F16 for matrices.
    kquant_scale: multiplies the fp16 scales of the random K-quant blocks (random_kquant).
    """
    types = types or {}
    cfg = hf_model.config
    rng = np.random.default_rng(seed)
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads

    w = GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    if head_dim != cfg.hidden_size // heads:  # llama.cpp writes these when config.json has head_dim
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    if eos_token_id is not None:
        w.add_eos_token_id(eos_token_id)
    if tokens is not None:  # a byte-level BPE vocabulary, as llama.cpp writes Qwen2's ("gpt2" model)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2")
        w.add_token_list(tokens)
        w.add_token_types([1 if len(t) == 1 else 3 for t in tokens])  # 1 normal, 3 control
        w.add_token_scores([0.0] * len(tokens))
        w.add_token_merges([])
    for key, val in (extra_kv or {}).items():
        if isinstance(val, str):
            w.add_string(key, val)
        elif isinstance(val, float):
            w.add_float32(key, val)
        else:
            w.add_uint32(key, val)

    expected = {}
    state = {k: v.detach().float().numpy() for k, v in hf_model.state_dict().items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for hf, tensor in state.items():
        name = gguf_name(hf)
        if name in drop:
            continue
        default = Q.F32 if tensor.ndim == 1 else Q.F16
        matches = [s for s in types if name.endswith(s)]
        qtype = types[max(matches, key=len)] if matches else default
        data, exp = encode(tensor, qtype, rng, kquant_scale)
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):  # as llama.cpp does
            data = llama_cpp_permute(data, heads if ".attn_q." in name else kv_heads)
        if qtype in (Q.F32, Q.F16):
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_dtype=qtype)
        expected[hf] = exp
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    for name, data in (extra_tensors or {}).items():
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def fake_registry(monkeypatch, tmp_path, data: bytes, sha256: str | None = None, num_parts: int = 3):
    """Register 'tiny-test' whose part modules (fake, in sys.modules) hold ``data`` in num_parts chunks."""
    import hashlib
    import sys
    import types

    from verispec.models import registry

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    step = -(-len(data) // num_parts)
    for i in range(1, num_parts + 1):
        part = tmp_path / f"part{i}.bin"
        part.write_bytes(data[(i - 1) * step:i * step])
        mod = types.ModuleType(f"verispec_test_fake_part{i}")
        mod.get_part_path = (lambda p=part: str(p))
        monkeypatch.setitem(sys.modules, mod.__name__, mod)
    entry = registry.RegistryEntry(
        "tiny-test", "test model", "verispec_test_fake_part", "verispec-test-fake-part", "0.0.1", num_parts,
        sha256 or hashlib.sha256(data).hexdigest(), len(data), (256, 7), "test")
    monkeypatch.setitem(registry.REGISTRY, "tiny-test", entry)
    return entry
