"""Tiny random models and a byte-level tokenizer for CPU tests (float32, seeded, built in seconds).

``make_hf_dir`` writes a real HF directory (config.json + model.safetensors [+ tokenizer files]) with
transformers' own model classes, so our loader and runtime are checked against the reference.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

EOS_ID = 256  # the byte tokenizer's "<|end|>"
VOCAB = 264  # 256 bytes + 2 specials + padding rows, like real checkpoints
PAD_IDS = list(range(259, VOCAB))  # rows past the tokenizer: verispec never samples them (suppress in HF too)
CHAT_TEMPLATE = (  # tool calls as Qwen2.5's template writes them; tools by name only (a short context)
    "{% if tools %}<|start|>system\n<tools>{% for t in tools %} {{ t['function']['name'] }}{% endfor %}</tools>"
    "<|end|>\n"
    "{% endif %}"
    "{% for m in messages %}<|start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>\n"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}\n</tool_call>"
    "{% endfor %}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant\n{% endif %}"
)

BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=EOS_ID, tie_word_embeddings=False)

ARCH_EXTRA = {
    "llama": dict(rope_theta=10000.0),
    "llama3": dict(rope_theta=500000.0, rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                          high_freq_factor=4.0,
                                                          original_max_position_embeddings=64)),
    "qwen2": dict(rope_theta=1000000.0),
    "qwen3": dict(rope_theta=1000000.0, head_dim=32, attention_bias=False),
    "mistral": dict(rope_theta=10000.0, sliding_window=None),
    "smollm2": dict(rope_theta=10000.0, tie_word_embeddings=True),
}
MODEL_TYPE = {"llama3": "llama", "smollm2": "llama"}


def hf_config(arch: str, **overrides):
    import transformers

    model_type = MODEL_TYPE.get(arch, arch)
    kwargs = {**BASE, **ARCH_EXTRA[arch], **overrides}
    return transformers.AutoConfig.for_model(model_type, **kwargs)


def byte_tokenizer():
    """A byte-level BPE tokenizer with no merges: ids 0..255 are bytes, 256 = <|end|>, 257 = <|start|>,
    258 = <|endoftext|> (which transformers' Qwen2Tokenizer would otherwise add on load): 259 tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_map = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(byte_map, key=_byte_of))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|end|>", "<|start|>", "<|endoftext|>"])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _byte_of(ch: str) -> int:
    """The byte a ByteLevel alphabet character stands for (GPT-2's bytes_to_unicode, inverted)."""
    return {v: k for k, v in _bytes_to_unicode().items()}[ch]


def _bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def make_hf_model(arch: str, seed: int = 0, **overrides):
    import transformers

    torch.manual_seed(seed)
    cfg = hf_config(arch, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # larger random weights than the default init: sharper, more varied outputs
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
            elif "bias" in name:
                p.normal_(0, 0.1)
            else:
                p.uniform_(0.8, 1.2)
    return model


def make_hf_dir(path: Path, arch: str = "qwen2", seed: int = 0, tokenizer: bool = True, noise: float = 0.0,
                **overrides) -> Path:
    """Save a tiny random model of ``arch`` as an HF directory; return the path. ``noise``: add that much
    Gaussian noise (seeded 1) to every matrix, e.g. a "near" draft of the seed's model."""
    path = Path(path)
    model = make_hf_model(arch, seed, **overrides)
    if noise:
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.add_(noise * torch.randn(p.shape, generator=g))
    model.save_pretrained(str(path), safe_serialization=True)
    if tokenizer:
        byte_tokenizer().save_pretrained(str(path))
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == MODEL_TYPE.get(arch, arch)
    return path
