"""Where generation ends: EOS, stop strings, max_new_tokens; and the text so far, detokenised incrementally.

Tokens are fed one at a time, so a speculative step that commits several tokens at once stops at
exactly the token where autoregressive decoding would have stopped. The EOS token is kept in
``token_ids`` but not in ``text``; a stop string ends the text just before it (the token that
completed it stays in ``token_ids``, as in vLLM).

Text is decoded incrementally (vLLM / TGI ``detokenize_incrementally``): only a window of recent tokens is
decoded again, so a step costs O(its new tokens), not O(the output).
"""

from __future__ import annotations

from .config import SamplingParams
from .errors import VerispecError
from .tokenizer import Codec

REPLACEMENT = "\ufffd"  # what a decoder gives for bytes that are not (yet) a whole UTF-8 character
SPLIT_TRIES = 8  # token boundaries tried when the text keeps ending in an unfinished character


class Detokenizer:
    """The text of a growing list of token ids, decoding only ``ids[prefix:]`` on each update.

    ``ids[:read]`` are settled: their text (``_settled``, in chunks) never changes. ``ids[prefix:read]`` are decoded
    again as context, so that the tokenizer renders ``ids[read:]`` as it would in place (a SentencePiece token's
    leading space, bytes of a character split across tokens): the new text is ``decode(ids[prefix:])`` past
    ``decode(ids[prefix:read])``. ``ids[read:]`` settle once their text no longer ends in U+FFFD (a character
    that may still be completing); their text so far is ``tail``. The whole text is what ``codec.decode(ids)``
    gives, for any tokenizer whose decoding of a sequence depends only on the neighbouring tokens.
    """

    def __init__(self, codec: Codec):
        self.codec = codec
        self.ids: list[int] = []
        self._settled: list[str] = []  # the text of ids[:read], in chunks
        self.settled_len = 0  # its length
        self._prefix = self._read = 0
        self._context = ""  # decode(ids[prefix:read])
        self.tail = ""  # the text of ids[read:] at the last update
        self._decoded = 0  # len(ids) at the last update

    def __len__(self) -> int:
        """Characters of text at the last update."""
        return self.settled_len + len(self.tail)

    @property
    def text(self) -> str:
        return "".join(self._settled) + self.tail

    def since(self, start: int) -> str:
        """``text[start:]``, joining only the chunks it needs."""
        parts, begin, i = [self.tail], self.settled_len, len(self._settled)
        while begin > start and i:
            i -= 1
            begin -= len(self._settled[i])
            parts.append(self._settled[i])
        return "".join(reversed(parts))[max(start - begin, 0):]

    def update(self) -> None:
        """Decode the tokens added since the last update."""
        n = len(self.ids)
        if n == self._decoded:
            return
        self._decoded = n
        new = self._decode(n)
        if not new.endswith(REPLACEMENT):
            self._settle(n, new, "")
        elif n - self._read > SPLIT_TRIES:
            # A run of tokens whose text keeps ending in U+FFFD (bytes that are not UTF-8): settle at the latest
            # boundary where decoding the two sides apart gives the same text (not inside a character), so the
            # window stays short.
            for j in range(n - 1, max(self._read, n - SPLIT_TRIES), -1):
                head, rest = self._decode(j), self.codec.decode(self.ids[j:])
                if head + rest == new:
                    self._settle(j, head, rest)
                    return
            self.tail = new
        else:
            self.tail = new

    def _decode(self, end: int) -> str:
        """The text of ids[read:end] in the context of ids[prefix:read]."""
        return self.codec.decode(self.ids[self._prefix:end])[len(self._context):]

    def _settle(self, end: int, text: str, tail: str) -> None:
        if text:
            self._settled.append(text)
            self.settled_len += len(text)
        no_context = self._prefix == self._read  # (the first time) text is then decode(ids[read:end]) itself
        self._prefix, self._read = self._read, end
        self._context = text if no_context else self.codec.decode(self.ids[self._prefix:end])
        self.tail = tail


class StopChecker:
    def __init__(self, params: SamplingParams, eos_ids: tuple[int, ...], codec: Codec):
        if params.stop and not codec.has_tokenizer:
            raise VerispecError("stop strings need a tokenizer; this model takes token ids only")
        self.params, self.codec = params, codec
        self.eos_ids = set() if params.ignore_eos else set(eos_ids)
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None  # "eos" | "stop" | "length"
        self._detok = Detokenizer(codec)  # token_ids, EOS excluded, and their text before any stop-string cut
        self._longest = max((len(s) for s in params.stop), default=0)
        self._stop_at: int | None = None  # index in the text where a stop string begins
        self._searched = 0  # text length at the previous stop-string search
        # what a stream was handed: text[:_streamed_len]; text[:_base] can no longer change (settled), the rest
        # of it is _streamed_rest
        self._streamed_len = self._base = 0
        self._streamed_rest = ""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        text = self._detok.text
        return text if self._stop_at is None else text[: self._stop_at]

    def append(self, tokens: list[int]) -> int:
        """Feed committed tokens in order; return how many were consumed before finishing."""
        for n, tok in enumerate(tokens, start=1):
            self.token_ids.append(int(tok))
            if tok in self.eos_ids:
                self.finish_reason = "eos"
                return n
            self._detok.ids.append(int(tok))
            if self.params.stop:
                self._detok.update()
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
        end = len(self._detok)
        lo = max(0, min(self._searched, end) - self._longest - 8)
        self._searched = end
        text = self._detok.since(lo)
        hits = [lo + i for i in (text.find(s) for s in self.params.stop) if i >= 0]
        self._stop_at = min(hits) if hits else None

    def finalize(self) -> str:
        """The final text."""
        self._detok.update()
        return self.text

    def stream_piece(self) -> str:
        """New text that is safe to show: complete characters, and not a possible start of a stop string.

        Only the text past ``_base`` (what may still change) and a stop string's length before it are looked at.
        """
        detok = self._detok
        detok.update()
        lo = max(0, self._base - self._longest)
        end = len(detok) if self._stop_at is None else self._stop_at
        text = detok.since(lo)[: max(end - lo, 0)]  # text[lo:end]
        if not self.finished:
            if text.endswith(REPLACEMENT):  # a multi-byte character split across tokens
                text = text.rstrip(REPLACEMENT)
            if lo + len(text) <= self._streamed_len:
                return ""  # (text before lo is all streamed: what is held back there changes nothing)
            text = text[: len(text) - self._stop_prefix_len(text)]
        end = lo + len(text)
        if end <= self._streamed_len or not text.startswith(self._streamed_rest, self._base - lo):
            return ""
        piece = text[self._streamed_len - lo:]
        self._streamed_len, self._base = end, min(detok.settled_len, end)
        self._streamed_rest = text[self._base - lo:]
        return piece

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of some stop string."""
        best = 0
        for s in self.params.stop:
            i = text.find(s[0], max(len(text) - len(s) + 1, 0))
            while i >= 0 and len(text) - i > best:
                if s.startswith(text[i:]):
                    best = len(text) - i
                    break
                i = text.find(s[0], i + 1)
        return best
