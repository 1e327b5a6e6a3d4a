"""ModelConfig: the handful of numbers our Llama-family runtime needs, read from an HF config.json.

One table (ARCHITECTURES) says which HF ``model_type`` values we run and how they differ; anything
else is rejected with "unsupported architecture X".
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import VerispecError


@dataclass(frozen=True)
class ArchTraits:
    qkv_bias: bool | None  # None: read config["attention_bias"]
    o_bias: bool | None  # None: read config["attention_bias"]
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    hf_class: str  # for the config.json we write when converting


ARCHITECTURES: dict[str, ArchTraits] = {
    # Llama 2/3 and SmolLM2 (model_type "llama"); Mistral differs only by the optional sliding window.
    "llama": ArchTraits(qkv_bias=None, o_bias=None, qk_norm=False, hf_class="LlamaForCausalLM"),
    "mistral": ArchTraits(qkv_bias=False, o_bias=False, qk_norm=False, hf_class="MistralForCausalLM"),
    "qwen2": ArchTraits(qkv_bias=True, o_bias=False, qk_norm=False, hf_class="Qwen2ForCausalLM"),
    "qwen3": ArchTraits(qkv_bias=None, o_bias=None, qk_norm=True, hf_class="Qwen3ForCausalLM"),
}

MASKED_TOKENS_KEY = "verispec_masked_token_ids"  # config.json key we add: padding rows of the vocabulary
ROPE_TYPES = ("default", "linear", "llama3", "freq_factors")  # freq_factors: GGUF rope_freqs tensor


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "llama3"|"linear", ...}
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default=())
    masked_token_ids: tuple[int, ...] = field(default=())  # vocabulary rows that are padding, not tokens

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        """Build from the dict in an HF config.json (transformers 4.x or 5.x layouts)."""
        mt = cfg.get("model_type")
        traits = ARCHITECTURES.get(mt)
        if traits is None:
            arch = (cfg.get("architectures") or [mt])[0]
            raise VerispecError(f"unsupported architecture {arch!r} (model_type {mt!r}); "
                                f"supported model types: {', '.join(ARCHITECTURES)}")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise VerispecError(f"unsupported architecture {mt!r} variant: hidden_act {act!r} (only silu)")
        try:
            hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
            rope = dict(cfg.get("rope_parameters") or {})
            legacy = cfg.get("rope_scaling") or {}
            rope.update({k: v for k, v in legacy.items() if k not in rope})
            rope_type = rope.get("rope_type") or rope.get("type") or "default"
            if rope_type not in ROPE_TYPES:
                raise VerispecError(f"unsupported RoPE scaling {rope_type!r} (supported: {', '.join(ROPE_TYPES)})")
            theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
            window = cfg.get("sliding_window")
            if mt in ("qwen2", "qwen3") and cfg.get("use_sliding_window"):
                raise VerispecError(f"unsupported architecture variant: {mt} with use_sliding_window=true")
            if mt in ("qwen2", "qwen3", "llama"):
                window = None  # their sliding_window fields are inert unless use_sliding_window is set
            eos = cfg.get("eos_token_id")
            eos = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
            attn_bias = bool(cfg.get("attention_bias", False))
            return cls(
                model_type=mt,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                rope_theta=theta,
                rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                qkv_bias=attn_bias if traits.qkv_bias is None else traits.qkv_bias,
                o_bias=attn_bias if traits.o_bias is None else traits.o_bias,
                mlp_bias=bool(cfg.get("mlp_bias", False)),
                qk_norm=traits.qk_norm,
                sliding_window=int(window) if window else None,
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=tuple(int(e) for e in eos),
                masked_token_ids=tuple(int(i) for i in cfg.get(MASKED_TOKENS_KEY) or ()),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise VerispecError(f"invalid model config: missing or malformed field {e}") from None

    def to_hf(self) -> dict:
        """The config.json transformers needs to load the same weights (used when converting)."""
        out = {
            "architectures": [ARCHITECTURES[self.model_type].hf_class],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
            "torch_dtype": "bfloat16",
        }
        if self.rope_scaling:
            out["rope_scaling"] = dict(self.rope_scaling)
        if self.masked_token_ids:
            out[MASKED_TOKENS_KEY] = list(self.masked_token_ids)
        if self.model_type in ("llama", "qwen3"):
            out["attention_bias"] = self.qkv_bias
        if self.model_type == "llama":
            out["mlp_bias"] = self.mlp_bias
        if self.model_type == "mistral":
            out["sliding_window"] = self.sliding_window
        return out

    def weight_bytes(self, bytes_per_param: int = 2) -> int:
        """Bytes of weights one decode step reads (embedding rows excluded, lm_head included)."""
        h, i, hd = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * (self.num_heads + 2 * self.num_kv_heads) * hd + self.num_heads * hd * h
        mlp = 3 * h * i
        per_layer = attn + mlp + 2 * h
        return bytes_per_param * (self.num_layers * per_layer + h + self.vocab_size * h)
