"""An EAGLE-3 draft head: one decoder layer that reads the target's own hidden states (Li et al. 2024/2025).

Per position r the head takes the target's residual stream after three of its layers (low / middle / high,
concatenated: 3D) projected by ``fc`` to D, and the embedding of the token that follows (the target's own
table, frozen). One decoder layer of the target's shape whose q/k/v read [norm(embedding), norm(hidden)] (2D
wide), a final norm and an LM head over a reduced draft vocabulary; ``d2t`` maps a draft row to a target id.
Its output hidden state is the next step's input in place of the target's features.

The tensors are named as the EAGLE authors and SpecForge publish them (``fc``, ``midlayer.*``, ``norm``,
``lm_head``, ``d2t``, ``t2d``), so a public head for a supported target loads (read_head). Our own files may
leave ``lm_head`` out (the target's rows for the draft vocabulary, frozen: EAGLE-1 style, a smaller file) and
store matrices as int8 with a per-row scale (``NAME.weight`` int8 + ``NAME.weight_scale``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import VerispecError
from .config import ModelConfig
from .kv_cache import KVCache
from .linear import Linear, can_quantize
from .llama import (
    MASKED,
    SMALL_T,
    RMSNorm,
    grouped_attention,
    rope_inv_freq,
    rotate_half,
)

HEAD_FILE = "model.safetensors"


@dataclass(frozen=True)
class HeadConfig:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int  # the target's
    draft_vocab_size: int
    layers: tuple[int, ...]  # target residual streams read: 0 = embeddings, i = after layer i
    rope_theta: float = 10000.0
    attention_bias: bool = False
    max_position_embeddings: int = 32768

    @classmethod
    def for_target(cls, cfg: ModelConfig, layers: tuple[int, ...] | None, draft_vocab_size: int) -> HeadConfig:
        """A head of the target's shape. layers default: EAGLE-3's low / middle / high (2, L/2, L-3)."""
        L = cfg.num_layers
        layers = tuple(layers) if layers else default_layers(L)
        bad = [i for i in layers if not 0 <= i <= L]
        if bad:
            raise VerispecError(f"--layers {bad[0]} outside the target's 0..{L}")
        return cls(cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                   cfg.rms_norm_eps, cfg.vocab_size, min(draft_vocab_size, cfg.vocab_size), layers, cfg.rope_theta,
                   cfg.qkv_bias, cfg.max_position_embeddings)

    def check_target(self, cfg: ModelConfig, name: str, target: str) -> None:
        """One line naming both when the head cannot run on this target."""
        pairs = [("hidden_size", self.hidden_size, cfg.hidden_size), ("vocab_size", self.vocab_size, cfg.vocab_size)]
        for key, mine, theirs in pairs:
            if mine != theirs:
                raise VerispecError(f"draft head {name} does not fit target {target}: {key} {mine} != {theirs}")
        if max(self.layers) > cfg.num_layers:
            raise VerispecError(f"draft head {name} does not fit target {target}: it reads layer "
                                f"{max(self.layers)}, the target has {cfg.num_layers}")


def default_layers(num_layers: int) -> tuple[int, ...]:
    L = num_layers
    return tuple(sorted({min(2, L), max(L // 2, 1), max(L - 3, 1)}))


class HeadAttention(nn.Module):
    def __init__(self, c: HeadConfig):
        super().__init__()
        self.h, self.hkv, self.hd = c.num_heads, c.num_kv_heads, c.head_dim
        D2, bias = 2 * c.hidden_size, c.attention_bias
        self.q_proj = Linear(D2, self.h * self.hd, bias=bias)
        self.k_proj = Linear(D2, self.hkv * self.hd, bias=bias)
        self.v_proj = Linear(D2, self.hkv * self.hd, bias=bias)
        self.o_proj = Linear(self.h * self.hd, c.hidden_size, bias=False)

    def qkv(self, x, cos, sin):
        """x: [B, T, 2D]; cos, sin: [B, 1, T, hd] -> q [B, H, T, hd], k, v [B, Hkv, T, hd] (RoPE applied)."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.h, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.hkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.hkv, self.hd).transpose(1, 2)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def out(self, o):
        """o: [B, H, T, hd] -> [B, T, D]."""
        B, _, T, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.h * self.hd))


class MidLayer(nn.Module):
    def __init__(self, c: HeadConfig):
        super().__init__()
        D, I = c.hidden_size, c.intermediate_size
        self.input_layernorm = RMSNorm(D, c.rms_norm_eps)  # on the token embedding
        self.hidden_norm = RMSNorm(D, c.rms_norm_eps)  # on the fused target features (or the head's own output)
        self.self_attn = HeadAttention(c)
        self.post_attention_layernorm = RMSNorm(D, c.rms_norm_eps)
        self.gate_proj = Linear(D, I, bias=False)  # public layout: mlp.gate_proj / up_proj / down_proj
        self.up_proj = Linear(D, I, bias=False)
        self.down_proj = Linear(I, D, bias=False)

    def mlp(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def inputs(self, emb, hidden):
        return torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)  # [B, T, 2D]

    def finish(self, hidden, attn_out):
        h = hidden + attn_out
        return h + self.mlp(self.post_attention_layernorm(h))


class EagleHead(nn.Module):
    def __init__(self, c: HeadConfig):
        super().__init__()
        self.config = c
        D = c.hidden_size
        self.fc = Linear(len(c.layers) * D, D, bias=False)
        self.midlayer = MidLayer(c)
        self.norm = RMSNorm(D, c.rms_norm_eps)
        self.lm_head = Linear(D, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.arange(c.draft_vocab_size), persistent=False)  # [Vd] target ids
        self.inv_freq = rope_inv_freq(_rope_cfg(c))  # [hd/2] float32 (a plain attribute: never rounded)
        self.embed: nn.Embedding | None = None  # the target's table (attach_embedding)

    # -- shared pieces ------------------------------------------------------------------------------------------
    def rope(self, positions: torch.Tensor, dtype):
        freqs = positions[..., None].float() * self.inv_freq.to(positions.device)  # [B, T, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]  # [B, 1, T, hd]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, T, D] -> draft-vocabulary logits [B, T, Vd] float32."""
        return self.lm_head(self.norm(hidden)).float()

    # -- inference: one sequence, its own KV cache ---------------------------------------------------------------
    @torch.inference_mode()
    def step(self, hidden: torch.Tensor, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Feed T rows at the cache's next positions: hidden [1, T, D] (fc(features) or the head's own output),
        tokens [1, T] (the token each row's next-token input is) -> output hidden [1, T, D]."""
        T, start = tokens.shape[1], cache.reserve(tokens.shape[1])
        positions = torch.arange(start, start + T, device=tokens.device)[None]
        m = self.midlayer
        x = m.inputs(self.embed(tokens).to(hidden.dtype), hidden)  # [1, T, 2D]
        cos, sin = self.rope(positions, x.dtype)
        q, k, v = m.self_attn.qkv(x, cos, sin)
        k_all, v_all = cache.update(0, k, v)  # [1, Hkv, S, hd]
        mask = None
        if T > 1:
            S = start + T
            mask = (torch.arange(S, device=x.device)[None] <= torch.arange(start, S, device=x.device)[:, None])[None, None]
        if T <= SMALL_T:
            o = grouped_attention(q, k_all, v_all, mask)
        else:
            add = None if mask is None else torch.zeros(mask.shape, dtype=q.dtype).masked_fill_(~mask, MASKED)
            o = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=add, enable_gqa=m.self_attn.h != m.self_attn.hkv)
        cache.advance(T)
        return m.finish(hidden, m.self_attn.out(o))

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    def new_cache(self, capacity: int, dtype, device) -> KVCache:
        c = self.config
        return KVCache(1, 1, c.num_kv_heads, capacity, c.head_dim, dtype, device)

    def forward(self, features: torch.Tensor, tokens: torch.Tensor, steps: int) -> list[torch.Tensor]:
        return self.unroll(features, tokens, steps)

    def attach_embedding(self, embed: nn.Embedding) -> None:
        """The target's embedding table, used as it is (not a submodule: never saved with the head)."""
        self.__dict__["embed"] = embed

    # -- training: the chain unrolled on its own outputs (EAGLE-3's training-time test) -------------------------
    def unroll(self, features: torch.Tensor, tokens: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """features [B, T, F] (target positions 0..T-1), tokens [B, T] (the token at each position).

        Step j's row r sits at position r + j, reads token x_{r+j+1} and (j = 0) fc(f_r) or (j > 0) its own
        step j-1 output, and attends to step 0's rows at positions <= r plus its own chain (steps 1..j at r),
        as the drafter's cache holds them. Returns per step the logits [B, T, Vd]; step j row r predicts
        token x_{r+j+2} (rows past the end read padding: the caller masks them)."""
        B, T, _ = features.shape
        m, a = self.midlayer, self.midlayer.self_attn
        pad = torch.zeros(B, steps, dtype=tokens.dtype, device=tokens.device)
        next_tokens = torch.cat([tokens[:, 1:], pad, pad[:, :1]], dim=1)  # [B, T + steps]: x_{r+1}, 0 past the end
        hidden = self.fc(features)  # [B, T, D]
        causal = torch.ones(T, T, dtype=torch.bool, device=features.device).tril()  # [T, T]
        keys, out = [], []
        G = a.h // a.hkv
        for j in range(steps):
            positions = torch.arange(j, T + j, device=features.device)[None].expand(B, T)
            cos, sin = self.rope(positions, hidden.dtype)
            x = m.inputs(self.embed(next_tokens[:, j:j + T]).to(hidden.dtype), hidden)  # [B, T, 2D]
            q, k, v = a.qkv(x, cos, sin)  # [B, H, T, hd], [B, Hkv, T, hd]
            keys.append((k, v))
            qg = q.view(B, a.hkv, G, T, a.hd)
            k0, v0 = keys[0]
            scores = [torch.einsum("bkgtd,bksd->bkgts", qg, k0).masked_fill(~causal, MASKED)]  # [B, Hkv, G, T, T]
            scores += [torch.einsum("bkgtd,bktd->bkgt", qg, ki)[..., None] for ki, _ in keys[1:]]  # [.., T, 1] each
            probs = torch.softmax(torch.cat(scores, dim=-1).float() * a.hd ** -0.5, dim=-1).to(q.dtype)
            o = torch.einsum("bkgts,bksd->bkgtd", probs[..., :T], v0)
            for i, (_, vi) in enumerate(keys[1:]):
                o = o + probs[..., T + i, None] * vi[:, :, None]
            hidden = m.finish(hidden, a.out(o.reshape(B, a.h, T, a.hd)))
            out.append(self.logits(hidden))
        return out

    # -- kernels ------------------------------------------------------------------------------------------------
    def quantize(self, bits: int = 8) -> bool:
        """int8 / 4-bit matrices on verispec's CPU kernels for draft steps (not the frozen LM head if it is the
        target's native rows); whether it did."""
        if not can_quantize(self.fc.weight.device if self.fc.weight is not None else "cpu"):
            return False
        for mod in self.modules():
            if isinstance(mod, Linear) and mod.weight is not None and mod.native is None:
                mod.quantize(bits)
        return True


def frozen_rows(lm_head: Linear, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of a target's LM head as a dense float32 [len(ids), D], whatever its format. A head kept in GGUF
    blocks is read through its own kernel: unit vectors in, one column of the matrix out each (a one-hot row
    quantizes to int8 without loss, so the columns are the dequantized weights)."""
    ids = ids.long()
    if lm_head.native is None:
        return lm_head.dense_weight().detach()[ids.to(lm_head.dense_weight().device)].float().cpu()
    D = lm_head.in_features
    cols = []
    for i in range(0, D, 256):
        eye = torch.zeros(min(256, D - i), D, dtype=torch.bfloat16)
        eye[torch.arange(eye.shape[0]), torch.arange(i, i + eye.shape[0])] = 1
        with torch.inference_mode():
            cols.append(lm_head(eye)[:, ids].float())  # [chunk, len(ids)]
    return torch.cat(cols).t().contiguous()  # [len(ids), D]


def _rope_cfg(c: HeadConfig) -> ModelConfig:
    return ModelConfig("llama", c.vocab_size, c.hidden_size, c.intermediate_size, 1, c.num_heads, c.num_kv_heads,
                       c.head_dim, c.rms_norm_eps, c.max_position_embeddings, c.rope_theta)


# ---------------------------------------------------------------------------------------------------------------
# Files: config.json + model.safetensors in the public EAGLE-3 layout
# ---------------------------------------------------------------------------------------------------------------

PUBLIC_NAMES = {f"midlayer.{m}.": f"midlayer.mlp.{m}." for m in ("gate_proj", "up_proj", "down_proj")}  # ours -> public


def save_head(head: EagleHead, out: Path, int8: bool = True, with_lm_head: bool = False, extra: dict | None = None):
    """Write config.json + model.safetensors (public names). int8: matrices as int8 + per-row scale."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    sd = {}
    for name, t in head.state_dict().items():
        if name.startswith("lm_head") and not with_lm_head:
            continue
        key = name
        for ours, public in PUBLIC_NAMES.items():
            key = key.replace(ours, public)
        t = t.detach().float()
        if int8 and t.dim() == 2:
            scale = (t.abs().amax(dim=1) / 127).clamp(min=1e-12)  # [out]
            sd[key] = torch.round(t / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
            sd[key + "_scale"] = scale.contiguous()
        else:
            sd[key] = t.to(torch.bfloat16).contiguous()
    c = head.config
    Vd, V = c.draft_vocab_size, c.vocab_size
    d2t = head.d2t.detach().cpu()
    sd["d2t"] = (d2t - torch.arange(Vd)).contiguous()  # public convention: target id = draft id + d2t[draft id]
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[d2t] = True
    sd["t2d"] = t2d
    save_file(sd, str(out / HEAD_FILE))
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
           "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
           "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
           "rms_norm_eps": c.rms_norm_eps, "vocab_size": V, "draft_vocab_size": Vd, "rope_theta": c.rope_theta,
           "attention_bias": c.attention_bias, "max_position_embeddings": c.max_position_embeddings,
           "num_hidden_layers": 1, "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(c.layers)},
           **(extra or {})}
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def read_head(path: str | Path, target_cfg: ModelConfig, target_name: str = "the target") -> tuple[EagleHead, bool]:
    """A head directory (config.json + model.safetensors or pytorch_model.bin) -> (head on CPU in float32,
    whether the file carries its own lm_head). One line for a missing, corrupt or mismatched head."""
    path = Path(path)
    name = str(path)
    if not (path / "config.json").is_file():
        raise VerispecError(f"draft head {name}: no config.json there")
    try:
        raw = json.loads((path / "config.json").read_text())
        c = _config_from_json(raw, target_cfg)
    except (ValueError, KeyError, TypeError) as e:
        raise VerispecError(f"draft head {name}: unreadable config.json ({type(e).__name__}: {e})") from None
    c.check_target(target_cfg, name, target_name)
    sd = _read_tensors(path, name)
    sd = {k.removeprefix("model."): v for k, v in sd.items()}
    head = EagleHead(c)
    own = {}
    for key, t in sd.items():
        if key.endswith("_scale") or key in ("d2t", "t2d") or key.startswith("embed_tokens"):
            continue
        ours = key
        for mine, public in PUBLIC_NAMES.items():
            ours = ours.replace(public, mine)
        if key + "_scale" in sd:
            t = t.float() * sd[key + "_scale"].float()[:, None]
        own[ours] = t.float()
    expected = {k: v.shape for k, v in head.state_dict().items()}
    has_lm_head = "lm_head.weight" in own
    for key, shape in expected.items():
        if key == "lm_head.weight" and not has_lm_head:
            continue
        if key not in own:
            raise VerispecError(f"draft head {name}: tensor {key} missing")
        if tuple(own[key].shape) != tuple(shape):
            raise VerispecError(f"draft head {name} does not fit target {target_name}: {key} is "
                                f"{tuple(own[key].shape)}, the target needs {tuple(shape)}")
    unknown = sorted(set(own) - set(expected))
    if unknown:
        raise VerispecError(f"draft head {name}: unexpected tensor {unknown[0]}")
    with torch.no_grad():
        for key, param in head.state_dict().items():
            if key in own:
                param.copy_(own[key])
    Vd = c.draft_vocab_size
    if "d2t" in sd:
        d2t = sd["d2t"].long() + torch.arange(Vd)
    elif "t2d" in sd:
        d2t = torch.nonzero(sd["t2d"].bool())[:, 0]
    else:
        d2t = torch.arange(Vd)
    if d2t.shape != (Vd,) or d2t.min() < 0 or d2t.max() >= c.vocab_size:
        raise VerispecError(f"draft head {name}: d2t does not map {Vd} draft rows into the target's {c.vocab_size}")
    head.d2t = d2t
    return head, has_lm_head


def _config_from_json(raw: dict, target_cfg: ModelConfig) -> HeadConfig:
    D = int(raw["hidden_size"])
    H = int(raw["num_attention_heads"])
    eagle = raw.get("eagle_config") or {}
    layers = eagle.get("eagle_aux_hidden_state_layer_ids")
    L = target_cfg.num_layers
    if layers is None:  # vLLM's ids name the residual stream entering layer i: our "after i layers", the same
        layers = default_layers(L)
    return HeadConfig(D, int(raw["intermediate_size"]), H, int(raw.get("num_key_value_heads", H)),
                      int(raw.get("head_dim") or D // H), float(raw.get("rms_norm_eps", 1e-6)),
                      int(raw.get("vocab_size", target_cfg.vocab_size)),
                      int(raw.get("draft_vocab_size") or raw.get("vocab_size", target_cfg.vocab_size)),
                      tuple(int(i) for i in layers), float(raw.get("rope_theta", 10000.0)),
                      bool(raw.get("attention_bias", False)),
                      int(raw.get("max_position_embeddings", target_cfg.max_position_embeddings)))


def _read_tensors(path: Path, name: str) -> dict[str, torch.Tensor]:
    st, bins = sorted(path.glob("*.safetensors")), sorted(path.glob("*.bin"))
    if not st and not bins:
        raise VerispecError(f"draft head {name}: no *.safetensors or *.bin file")
    sd = {}
    try:
        if st:
            from safetensors.torch import load_file
            for f in st:
                sd.update(load_file(str(f)))
        else:
            for f in bins:
                sd.update(torch.load(str(f), map_location="cpu", weights_only=True))
    except Exception as e:  # noqa: BLE001 - any unreadable file is one line
        raise VerispecError(f"draft head {name}: unreadable weights ({type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''})") from None
    return sd
