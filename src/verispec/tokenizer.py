"""Prompt encoding (plain or through the tokenizer's chat template) and text decoding."""

from __future__ import annotations

from .errors import VerispecError


class Codec:
    """Wraps a transformers tokenizer; ``None`` means the model takes token ids only."""

    def __init__(self, hf_tokenizer, vocab_size: int):
        self.tok = hf_tokenizer
        self.vocab_size = vocab_size  # rows of the embedding: valid token ids are [0, vocab_size)

    @property
    def has_tokenizer(self) -> bool:
        return self.tok is not None

    def encode(self, prompt: str | list[int], chat: bool = False, system: str | None = None) -> list[int]:
        if isinstance(prompt, str):
            if not prompt.strip():
                raise VerispecError("empty prompt")
            if self.tok is None:
                raise VerispecError("this model has no tokenizer files: pass the prompt as token ids")
            if chat:
                if not getattr(self.tok, "chat_template", None):
                    raise VerispecError("--chat: this tokenizer has no chat template")
                messages = ([{"role": "system", "content": system}] if system else []) + \
                    [{"role": "user", "content": prompt}]
                ids = self.tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
                ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
            else:
                ids = self.tok(prompt).input_ids
            return list(ids)
        if chat:
            raise VerispecError("--chat needs a text prompt, not token ids")
        try:
            ids = [int(t) for t in prompt]
        except (TypeError, ValueError):
            raise VerispecError("prompt must be a string or a list of integer token ids") from None
        if not ids:
            raise VerispecError("empty prompt")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise VerispecError(f"token id {bad[0]} outside the vocabulary [0, {self.vocab_size})")
        return ids

    def decode(self, ids: list[int]) -> str:
        if self.tok is None or not ids:
            return ""
        return self.tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
