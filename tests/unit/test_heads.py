"""Draft heads (heads/): the EAGLE-3 head's files (the public EAGLE-3 / SpecForge layout, our own int8 files, the
"family" field, one-line errors), draft-vocabulary logits placed at their target ids, and the EAGLE-3 recipe's
training-time unroll against step-by-step inference on a KV cache."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from verispec.errors import VerispecError
from verispec.models.config import ModelConfig
from verispec.heads import FAMILIES, Eagle3Config, Eagle3Head, read_head, save_head, to_target_vocab
from verispec.training.recipes.eagle3 import unroll

D, I, H, HKV, HD, V, VD = 64, 128, 4, 2, 16, 264, 40
LAYERS = (0, 1, 2)


def target_config(**overrides) -> ModelConfig:
    """A tiny llama target's config (the shape of tests/tiny.py's models, built without transformers)."""
    kw = dict(model_type="llama", vocab_size=V, hidden_size=D, intermediate_size=I, num_layers=2, num_heads=H,
              num_kv_heads=HKV, head_dim=HD, rms_norm_eps=1e-6, max_position_embeddings=256, rope_theta=10000.0,
              eos_token_ids=(256,))
    kw.update(overrides)
    return ModelConfig(**kw)


def public_config(**overrides) -> dict:
    """config.json as SpecForge writes it for a LlamaForCausalLMEagle3 head."""
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
           "hidden_size": D, "intermediate_size": I, "num_attention_heads": H, "num_key_value_heads": HKV,
           "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "vocab_size": V, "draft_vocab_size": VD,
           "rope_theta": 10000.0, "max_position_embeddings": 256, "torch_dtype": "bfloat16",
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(LAYERS)}}
    cfg.update(overrides)
    return cfg


def draft_ids(seed: int = 0) -> torch.Tensor:
    """A sorted subset of VD target ids (never the identity, so a wrong d2t convention shows)."""
    g = torch.Generator().manual_seed(seed)
    return torch.sort(torch.randperm(V, generator=g)[:VD]).values


def public_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """A random head's tensors under SpecForge's names (float32)."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(shape, generator=g) * 0.1

    def norm():
        return 1 + r(D)

    ids = draft_ids(seed)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    return {
        "fc.weight": r(D, len(LAYERS) * D),
        "midlayer.input_layernorm.weight": norm(),
        "midlayer.hidden_norm.weight": norm(),
        "midlayer.post_attention_layernorm.weight": norm(),
        "midlayer.self_attn.q_proj.weight": r(H * HD, 2 * D),
        "midlayer.self_attn.k_proj.weight": r(HKV * HD, 2 * D),
        "midlayer.self_attn.v_proj.weight": r(HKV * HD, 2 * D),
        "midlayer.self_attn.o_proj.weight": r(D, H * HD),
        "midlayer.mlp.gate_proj.weight": r(I, D),
        "midlayer.mlp.up_proj.weight": r(I, D),
        "midlayer.mlp.down_proj.weight": r(D, I),
        "norm.weight": norm(),
        "lm_head.weight": r(VD, D),
        "d2t": ids - torch.arange(VD),  # public convention: target id = draft id + d2t[draft id]
        "t2d": t2d,
    }


OURS = {"midlayer.mlp.gate_proj.weight": "midlayer.gate_proj.weight",
        "midlayer.mlp.up_proj.weight": "midlayer.up_proj.weight",
        "midlayer.mlp.down_proj.weight": "midlayer.down_proj.weight"}


def write_public(path, tensors: dict, cfg: dict | None = None, fmt: str = "safetensors", prefix: str = "",
                 embed: bool = False):
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    sd = {prefix + k: v.contiguous() for k, v in tensors.items()}
    if embed:  # some published heads carry the target's embedding table: not the head's to load
        sd[prefix + "embed_tokens.weight"] = torch.randn(V, D)
    if fmt == "safetensors":
        save_file(sd, str(path / "model.safetensors"))
    else:
        torch.save(sd, path / "pytorch_model.bin")
    (path / "config.json").write_text(json.dumps(public_config() if cfg is None else cfg))
    return path


def one_line_error(path, cfg=None, name="tiny-target") -> str:
    with pytest.raises(VerispecError) as e:
        read_head(path, cfg or target_config(), name)
    msg = str(e.value)
    assert "\n" not in msg and msg.strip() == msg and msg, repr(msg)
    return msg


# -- 1. the public layout ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt,prefix,embed", [("safetensors", "", False), ("safetensors", "model.", True),
                                              ("bin", "", False), ("bin", "model.", True)])
def test_public_layout_loads_every_tensor(tmp_path, fmt, prefix, embed):
    tensors = public_tensors()
    write_public(tmp_path / "head", tensors, fmt=fmt, prefix=prefix, embed=embed)
    head, has_lm_head = read_head(tmp_path / "head", target_config(), "tiny")
    assert has_lm_head
    c = head.config
    assert (c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim) == (D, I, H, HKV, HD)
    assert (c.vocab_size, c.draft_vocab_size, c.layers, c.rope_theta) == (V, VD, LAYERS, 10000.0)
    sd = head.state_dict()
    expected = {OURS.get(k, k): v for k, v in tensors.items() if k not in ("d2t", "t2d")}
    assert set(sd) == set(expected)  # nothing more (embed_tokens ignored), nothing less
    for key, want in expected.items():
        assert sd[key].dtype == torch.float32
        assert torch.equal(sd[key], want), key
    # d2t: draft row i proposes target id i + d2t[i]
    assert torch.equal(head.d2t, draft_ids())
    assert torch.equal(head.d2t, torch.arange(VD) + tensors["d2t"])
    assert not torch.equal(head.d2t, torch.arange(VD))


def test_public_layout_t2d_only_and_no_lm_head(tmp_path):
    tensors = public_tensors(seed=3)
    del tensors["d2t"], tensors["lm_head.weight"]
    write_public(tmp_path / "head", tensors)
    head, has_lm_head = read_head(tmp_path / "head", target_config())
    assert not has_lm_head
    assert torch.equal(head.d2t, draft_ids(seed=3))  # from t2d's set rows, in order


def test_public_head_runs(tmp_path):
    """A loaded public head drafts: logits over the draft vocabulary, finite."""
    write_public(tmp_path / "head", public_tensors())
    head, _ = read_head(tmp_path / "head", target_config())
    head.attach_embedding(nn.Embedding(V, D))
    cache = head.new_cache(16, torch.float32, "cpu")
    out = head.step(head.fc(torch.randn(1, 5, len(LAYERS) * D)), torch.randint(0, V, (1, 5)), cache)
    logits = head.logits(out)
    assert logits.shape == (1, 5, VD) and torch.isfinite(logits).all()


def test_catch_up_is_the_last_row_of_a_step_on_fused_features(tmp_path):
    write_public(tmp_path / "head", public_tensors())
    head, _ = read_head(tmp_path / "head", target_config())
    head.attach_embedding(nn.Embedding(V, D))
    feats, tokens = torch.randn(1, 5, len(LAYERS) * D), torch.randint(0, V, (1, 5))
    a, b = head.new_cache(16, torch.float32, "cpu"), head.new_cache(16, torch.float32, "cpu")
    got = head.catch_up(feats, tokens, a)
    assert got.shape == (1, 1, D) and a.length == b.length + 5
    assert torch.equal(got, head.step(head.fc(feats), tokens, b)[:, -1:])


def test_to_target_vocab_places_draft_rows_at_their_ids():
    ids = draft_ids()
    logits = torch.randn(2, 3, VD)
    full = to_target_vocab(logits, ids, V)  # [2, 3, V]
    assert full.shape == (2, 3, V) and torch.equal(full[..., ids], logits)
    rest = torch.ones(V, dtype=torch.bool)
    rest[ids] = False
    assert torch.isneginf(full[..., rest]).all()
    assert torch.equal(to_target_vocab(logits[:, 0], ids, V), full[:, 0])  # [B, Vd] -> [B, V]


def test_family_names_the_head_class(tmp_path):
    """config.json's "family" picks the head class (absent: eagle3); an unknown one is one line naming it."""
    assert FAMILIES["eagle3"] is Eagle3Head and Eagle3Config.family == "eagle3"
    write_public(tmp_path / "head", public_tensors(), cfg=public_config(family="eagle3"))
    head, _ = read_head(tmp_path / "head", target_config())
    assert type(head) is Eagle3Head and head.feature_layers == LAYERS
    write_public(tmp_path / "other", public_tensors(), cfg=public_config(family="medusa-9"))
    msg = one_line_error(tmp_path / "other")
    assert "medusa-9" in msg and "eagle3" in msg, msg


# -- 2. save_head -> read_head ----------------------------------------------------------------------------------

def random_head(seed: int = 0, layers=LAYERS, bias: bool = False, depth: int = 1) -> Eagle3Head:
    torch.manual_seed(seed)
    c = Eagle3Config(D, I, H, HKV, HD, 1e-6, V, VD, tuple(layers), 10000.0, bias, 256, depth)
    head = Eagle3Head(c)
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.copy_(torch.randn(p.shape) * 0.1 + (1.0 if "norm" in name else 0.0))
    head.d2t = draft_ids(seed)
    head.attach_embedding(nn.Embedding(V, D))
    return head


@pytest.mark.parametrize("with_lm_head,depth", [(True, 1), (False, 1), (False, 2)])
def test_save_read_full_precision(tmp_path, with_lm_head, depth):
    """int8=False stores bfloat16: a head whose weights are bf16 values comes back bit for bit (a deeper head too:
    its layers after the first are ``extra.{i}.*``, ``num_hidden_layers`` its depth)."""
    head = random_head(bias=True, depth=depth)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    save_head(head, tmp_path / "h", int8=False, with_lm_head=with_lm_head, extra={"note": "x"})
    cfg = json.loads((tmp_path / "h" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["note"] == "x" and cfg["family"] == "eagle3"
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(LAYERS)
    assert cfg["num_hidden_layers"] == depth and any(k.startswith("extra.0.") for k in head.state_dict()) == (depth > 1)
    back, has_lm_head = read_head(tmp_path / "h", target_config(qkv_bias=True))
    assert has_lm_head == with_lm_head
    assert back.config == head.config
    assert torch.equal(back.d2t, head.d2t)
    for key, t in head.state_dict().items():
        if key == "lm_head.weight" and not with_lm_head:
            continue
        assert torch.equal(back.state_dict()[key], t), key


def test_save_read_int8_public_names(tmp_path):
    from safetensors.torch import load_file

    head = random_head(seed=1)
    save_head(head, tmp_path / "h", int8=True, with_lm_head=True)
    raw = load_file(str(tmp_path / "h" / "model.safetensors"))
    # the public names, matrices as int8 + a per-row scale, d2t as offsets, t2d a bool mask
    assert raw["midlayer.mlp.gate_proj.weight"].dtype == torch.int8
    assert raw["midlayer.mlp.gate_proj.weight_scale"].shape == (I,)
    assert raw["fc.weight"].dtype == torch.int8 and raw["fc.weight"].shape == (D, 3 * D)
    assert "midlayer.gate_proj.weight" not in raw
    assert torch.equal(raw["d2t"] + torch.arange(VD), head.d2t)
    assert raw["t2d"].dtype == torch.bool and int(raw["t2d"].sum()) == VD and raw["t2d"][head.d2t].all()
    back, has_lm_head = read_head(tmp_path / "h", target_config())
    assert has_lm_head and torch.equal(back.d2t, head.d2t)
    for key, t in head.state_dict().items():
        got = back.state_dict()[key]
        if t.dim() == 2:  # int8 rounding: half a step of each row's scale
            step = t.abs().amax(dim=1, keepdim=True) / 127
            assert (got - t).abs().le(step / 2 * (1 + 1e-3) + 1e-7).all(), key
            assert not torch.equal(got, t)  # it was quantized
        else:  # vectors in bf16
            assert torch.allclose(got, t, rtol=2 ** -8, atol=0), key


# -- 3. one-line errors -----------------------------------------------------------------------------------------

def test_error_hidden_size_mismatch(tmp_path):
    write_public(tmp_path / "head", public_tensors())
    msg = one_line_error(tmp_path / "head", target_config(hidden_size=96, head_dim=24), "tiny-96")
    assert "hidden_size" in msg and "64" in msg and "96" in msg and "tiny-96" in msg, msg


def test_error_vocab_mismatch(tmp_path):
    write_public(tmp_path / "head", public_tensors())
    msg = one_line_error(tmp_path / "head", target_config(vocab_size=300))
    assert "vocab_size" in msg and "264" in msg and "300" in msg, msg


def test_error_layer_past_target(tmp_path):
    write_public(tmp_path / "head", public_tensors(), cfg=public_config(
        eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 5]}))
    msg = one_line_error(tmp_path / "head")
    assert "5" in msg and "layer" in msg, msg


def test_error_wrong_shape(tmp_path):
    tensors = public_tensors()
    tensors["midlayer.self_attn.k_proj.weight"] = torch.randn(HKV * HD, D)  # EAGLE-1 width, not 2D
    write_public(tmp_path / "head", tensors)
    msg = one_line_error(tmp_path / "head")
    assert "k_proj" in msg and "(32, 64)" in msg and "(32, 128)" in msg, msg


def test_error_missing_tensor(tmp_path):
    tensors = public_tensors()
    del tensors["midlayer.mlp.up_proj.weight"]
    write_public(tmp_path / "head", tensors)
    msg = one_line_error(tmp_path / "head")
    assert "up_proj" in msg and "missing" in msg, msg


def test_error_corrupt_safetensors(tmp_path):
    write_public(tmp_path / "head", public_tensors())
    (tmp_path / "head" / "model.safetensors").write_bytes(torch.randint(0, 256, (4096,), dtype=torch.uint8,
                                                                        generator=torch.Generator().manual_seed(0))
                                                          .numpy().tobytes())
    msg = one_line_error(tmp_path / "head")
    assert "unreadable weights" in msg and str(tmp_path / "head") in msg, msg


def test_error_no_weights(tmp_path):
    write_public(tmp_path / "head", public_tensors())
    (tmp_path / "head" / "model.safetensors").unlink()
    msg = one_line_error(tmp_path / "head")
    assert "safetensors" in msg, msg


def test_error_missing_config(tmp_path):
    write_public(tmp_path / "head", public_tensors())
    (tmp_path / "head" / "config.json").unlink()
    msg = one_line_error(tmp_path / "head")
    assert "config.json" in msg and str(tmp_path / "head") in msg, msg
    msg = one_line_error(tmp_path / "nowhere")
    assert "config.json" in msg, msg


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"hidden_size": 64}', ""])
def test_error_config_not_json(tmp_path, text):
    write_public(tmp_path / "head", public_tensors())
    (tmp_path / "head" / "config.json").write_text(text)
    msg = one_line_error(tmp_path / "head")
    assert "config.json" in msg, msg


def test_error_d2t_out_of_range(tmp_path):
    tensors = public_tensors()
    tensors["d2t"] = tensors["d2t"].clone()
    tensors["d2t"][-1] = V  # target id past the vocabulary
    write_public(tmp_path / "head", tensors)
    msg = one_line_error(tmp_path / "head")
    assert "d2t" in msg, msg


# -- 4. training-time unroll == step-by-step inference ----------------------------------------------------------

def chain_by_steps(head: Eagle3Head, feats, tokens, r: int, steps: int, wrong_at: int | None = None):
    """Inference as the drafter runs it: prefill rows 0..r (fc(features), each with the token that follows), then
    the chain from row r, each step feeding its own output hidden and the next token. -> per step logits
    (step 0: every row 0..r [r+1, Vd]; step j > 0: row r's [1, Vd])."""
    cache = head.new_cache(64, torch.float32, "cpu")
    with torch.inference_mode():
        h = head.step(head.fc(feats[:, :r + 1]), tokens[:, 1:r + 2], cache)
        out = [head.logits(h)[0]]
        last = h[:, -1:]
        for j in range(1, steps):
            tok = tokens[:, r + j + 1:r + j + 2]
            if j == wrong_at:
                tok = (tok + 1) % V
            last = head.step(last, tok, cache)
            out.append(head.logits(last)[0])
    return out


@pytest.mark.parametrize("r,depth", [(6, 1), (20, 1), (20, 3)])  # the grouped float32 attention (<= 16 rows), SDPA
def test_unroll_matches_step_inference(r, depth):
    steps, T = 3, 28
    head = random_head(seed=2, layers=(1, 2), bias=True, depth=depth)
    g = torch.Generator().manual_seed(5)
    feats = torch.randn(1, T, 2 * D, generator=g)
    tokens = torch.randint(0, V, (1, T), generator=g)
    with torch.no_grad():
        unrolled = unroll(head, feats, tokens, steps)
    assert len(unrolled) == steps and unrolled[0].shape == (1, T, VD)
    ref = chain_by_steps(head, feats, tokens, r, steps)
    torch.testing.assert_close(ref[0], unrolled[0][0, :r + 1], rtol=1e-5, atol=1e-5)  # step 0, every row
    for j in range(1, steps):
        torch.testing.assert_close(ref[j], unrolled[j][0, r:r + 1], rtol=1e-5, atol=1e-5)
    # negative controls: the comparison sees a wrong token, and a row that is not the chain's
    bad = chain_by_steps(head, feats, tokens, r, steps, wrong_at=1)
    assert torch.equal(bad[0], ref[0])
    for j in range(1, steps):
        assert (bad[j] - unrolled[j][0, r:r + 1]).abs().max() > 1e-3
    assert (ref[2] - unrolled[2][0, r - 1:r]).abs().max() > 1e-3


@pytest.mark.parametrize("depth,first_hidden", [(1, False), (2, True)])
def test_peagle_unroll_matches_parallel_inference(depth, first_hidden):
    """P-EAGLE: the unroll's steps 1.. (mask rows) give what the drafter's one parallel pass of K-1 mask rows gives
    after the catch-up (heads/peagle.py); a mask row that read its real token instead would differ."""
    from dataclasses import replace

    from verispec.heads import PEagleConfig, PEagleHead

    torch.manual_seed(3)
    c = PEagleConfig(D, I, H, HKV, HD, 1e-6, V, VD, (1, 2), 10000.0, True, 256, depth, first_hidden)
    head = PEagleHead(c)
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.copy_(torch.randn(p.shape) * 0.1 + (1.0 if "norm" in name else 0.0))
    head.d2t = draft_ids(3)
    head.attach_embedding(nn.Embedding(V, D))
    steps, T, r = 4, 24, 9
    g = torch.Generator().manual_seed(8)
    feats, tokens = torch.randn(1, T, 2 * D, generator=g), torch.randint(0, V, (1, T), generator=g)
    with torch.no_grad():
        unrolled = unroll(head, feats, tokens, steps)
    cache = head.new_cache(64, torch.float32, "cpu")
    with torch.inference_mode():
        first = head.step(head.fc(feats[:, :r + 1]), tokens[:, 1:r + 2], cache)[:, -1:]  # the catch-up
        rows = head.parallel(steps - 1, cache, first)  # [1, steps - 1, D]
        got = head.logits(rows)[0]
    torch.testing.assert_close(head.logits(first)[0, 0], unrolled[0][0, r], rtol=1e-5, atol=1e-5)
    for j in range(1, steps):
        torch.testing.assert_close(got[j - 1], unrolled[j][0, r], rtol=1e-5, atol=1e-5)
    assert (got[0] - unrolled[1][0, r - 1]).abs().max() > 1e-3  # negative control: another row's
    assert PEagleConfig.from_json(c.to_json(), target_config()) == c
    other = PEagleHead(replace(c, first_hidden=not first_hidden))  # the same weights, the other mask input
    other.load_state_dict(head.state_dict())
    other.d2t = head.d2t
    other.attach_embedding(head.embed)
    with torch.no_grad():
        assert (unroll(other, feats, tokens, steps)[1][0, r] - unrolled[1][0, r]).abs().max() > 1e-3


def test_unroll_batch_rows_independent():
    """Sequences of a batch do not see each other: batched unroll == each sequence alone."""
    head = random_head(seed=4, layers=(2,))
    g = torch.Generator().manual_seed(6)
    feats, tokens = torch.randn(2, 12, D, generator=g), torch.randint(0, V, (2, 12), generator=g)
    with torch.no_grad():
        both = unroll(head, feats, tokens, 3)
        for b in range(2):
            alone = unroll(head, feats[b:b + 1], tokens[b:b + 1], 3)
            for j in range(3):
                torch.testing.assert_close(alone[j][0], both[j][b], rtol=1e-5, atol=1e-5)


def test_the_heads_that_ship_are_one_a_family_and_small():
    """Each shipped head's directory is named for its family, says so in config.json, and stays small (the repository
    carries every replaced version in its history)."""
    import json

    from verispec.models.registry import DEFAULT_HEADS, DEFAULT_TARGET

    shipped = DEFAULT_HEADS[DEFAULT_TARGET]
    families = [json.loads((d / "config.json").read_text())["family"] for d in shipped]
    assert families == [d.name.rsplit(".", 1)[1] for d in shipped] and len(set(families)) == len(families)
    size = {f: sum(p.stat().st_size for p in d.iterdir()) for f, d in zip(families, shipped)}
    assert size["medusa"] <= 15e6 and size["eagle3"] <= 60e6, size
