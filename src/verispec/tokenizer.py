"""Tokenizers: loading one (transformers, from a directory or a GGUF file), prompt encoding (plain or through the
chat template) and text decoding."""

from __future__ import annotations

from pathlib import Path

from .errors import VerispecError


def load_tokenizer(path: Path, gguf_file: str | None = None):
    """A transformers tokenizer from a directory, or from the metadata of ``gguf_file`` in it."""
    import transformers

    transformers.logging.set_verbosity_error()
    try:
        return transformers.AutoTokenizer.from_pretrained(str(path), gguf_file=gguf_file)
    except Exception as e:
        raise VerispecError(f"cannot load the tokenizer from {Path(path) / (gguf_file or '')}: "
                            f"{str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__}"
                            ) from None


class Codec:
    """Wraps a transformers tokenizer; ``None`` means the model takes token ids only."""

    def __init__(self, hf_tokenizer, vocab_size: int):
        self.tok = hf_tokenizer
        self.vocab_size = vocab_size  # rows of the embedding: valid token ids are [0, vocab_size)

    @property
    def has_tokenizer(self) -> bool:
        return self.tok is not None

    def encode(self, prompt: str | list[int] | list[dict], chat: bool = False, system: str | None = None,
               tools: list[dict] | None = None) -> list[int]:
        """Text (through the chat template when ``chat``), token ids, or a conversation: a list of
        {"role": "system" | "user" | "assistant" | "tool", "content": str} messages (an assistant's may hold
        ``tool_calls``, as chat templates take them: tools.template_message) ending with a user's or a tool's, always
        through the chat template, which renders ``tools`` (OpenAI's function definitions) when given."""
        if is_conversation(prompt):
            if system is not None:
                raise VerispecError("system: give a conversation's system prompt as its first message")
            return self._template(check_messages(prompt), tools)
        if tools:
            raise VerispecError("tools need a conversation (a list of messages)")
        if isinstance(prompt, str):
            if not prompt.strip():
                raise VerispecError("empty prompt")
            if self.tok is None:
                raise VerispecError("this model has no tokenizer files: pass the prompt as token ids")
            if chat:
                return self._template(([{"role": "system", "content": system}] if system else []) +
                                      [{"role": "user", "content": prompt}])
            return list(self.tok(prompt).input_ids)
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

    def _template(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        if self.tok is None:
            raise VerispecError("this model has no tokenizer files: pass the prompt as token ids")
        if not getattr(self.tok, "chat_template", None):
            raise VerispecError("this tokenizer has no chat template (--chat and conversations need one)")
        ids = self.tok.apply_chat_template(messages, tools=tools or None, tokenize=True, add_generation_prompt=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def decode(self, ids: list[int]) -> str:
        if self.tok is None or not ids:
            return ""
        return self.tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


ROLES = ("system", "user", "assistant", "tool")
OPTIONAL_KEYS = {"assistant": {"tool_calls"}, "tool": {"tool_call_id", "name"}}  # besides role and content


def is_conversation(prompt) -> bool:
    return isinstance(prompt, (list, tuple)) and any(isinstance(m, dict) for m in prompt)


def check_messages(messages) -> list[dict]:
    """A conversation as the chat template takes it, or a one-line error."""
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not {"role", "content"} <= set(m):
            raise VerispecError(f"message {i}: expected {{'role': ..., 'content': ...}}, got {m!r:.80}")
        if m["role"] not in ROLES or not isinstance(m["content"], str):
            raise VerispecError(f"message {i}: role must be one of {', '.join(ROLES)} and content a string")
        extra = set(m) - {"role", "content"} - OPTIONAL_KEYS.get(m["role"], set())
        if extra:
            raise VerispecError(f"message {i}: unexpected key {sorted(extra)[0]!r} in a {m['role']} message")
    last = messages[-1]
    if last["role"] not in ("user", "tool") or (last["role"] == "user" and not last["content"].strip()):
        raise VerispecError("a conversation must end with a non-empty user message or a tool result")
    return [dict(m) for m in messages]
