"""Where generation ends: EOS, stop strings, max_new_tokens.

Tokens are fed one at a time, so a speculative step that commits several tokens at once stops at
exactly the token where autoregressive decoding would have stopped. The EOS token is kept in
``token_ids`` but not in ``text``; a stop string ends the text just before it (the token that
completed it stays in ``token_ids``, as in vLLM).
"""

from __future__ import annotations

from .config import SamplingParams
from .errors import VerispecError
from .tokenizer import Codec


class StopChecker:
    def __init__(self, params: SamplingParams, eos_ids: tuple[int, ...], codec: Codec):
        if params.stop and not codec.has_tokenizer:
            raise VerispecError("stop strings need a tokenizer; this model takes token ids only")
        self.params, self.codec = params, codec
        self.eos_ids = set() if params.ignore_eos else set(eos_ids)
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None  # "eos" | "stop" | "length"
        self._text = ""  # decoded text of token_ids (EOS excluded), before any stop-string cut
        self._stop_at: int | None = None  # index in _text where a stop string begins
        self._searched = 0  # len(_text) at the previous stop-string search
        self._streamed = ""  # text already handed to a stream

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return self._text if self._stop_at is None else self._text[: self._stop_at]

    def append(self, tokens: list[int]) -> int:
        """Feed committed tokens in order; return how many were consumed before finishing."""
        for n, tok in enumerate(tokens, start=1):
            self.token_ids.append(int(tok))
            if tok in self.eos_ids:
                self.finish_reason = "eos"
                return n
            if self.params.stop:
                self._text = self.codec.decode(self.token_ids)
                self._find_stop()
            if self._stop_at is not None:
                self.finish_reason = "stop"
                return n
            if len(self.token_ids) >= self.params.max_new_tokens:
                self.finish_reason = "length"
                return n
        return len(tokens)

    def _find_stop(self) -> None:
        # Search only what the new token can have completed: from just before the previously searched
        # end (a stop string may straddle tokens; the slack covers a trailing U+FFFD that became a
        # character). A token may add many characters (runs of spaces in BPE vocabularies).
        longest = max(len(s) for s in self.params.stop)
        lo = max(0, min(self._searched, len(self._text)) - longest - 8)
        self._searched = len(self._text)
        hits = [i for i in (self._text.find(s, lo) for s in self.params.stop) if i >= 0]
        self._stop_at = min(hits) if hits else None

    def finalize(self) -> str:
        """The final text (decoded once more when stop strings did not require it per token)."""
        if not self.params.stop:
            ids = self.token_ids[:-1] if self.finish_reason == "eos" else self.token_ids
            self._text = self.codec.decode(ids)
        return self.text

    def stream_piece(self) -> str:
        """New text that is safe to show: complete characters, and not a possible start of a stop string."""
        if not self.params.stop:
            ids = self.token_ids[:-1] if self.finish_reason == "eos" else self.token_ids
            self._text = self.codec.decode(ids)
        text = self.text
        if not self.finished:
            if text.endswith("\ufffd"):  # a multi-byte character split across tokens
                text = text.rstrip("\ufffd")
            text = text[: len(text) - self._stop_prefix_len(text)]
        if len(text) <= len(self._streamed) or not text.startswith(self._streamed):
            return ""
        piece, self._streamed = text[len(self._streamed):], text
        return piece

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of some stop string."""
        best = 0
        for s in self.params.stop:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best
