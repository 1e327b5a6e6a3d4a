"""Structured output: a JSON schema (SamplingParams.response_format) or a Lark grammar (SamplingParams.grammar: a
forced tool call's, tools.py) enforced by a grammar mask, exact under speculative decoding.

``GrammarMask`` is a logits processor of one row given its prefix (processors.py): every token the grammar forbids
after the row's output so far (the prefix from ``prompt_len`` on: committed output plus the drafts before the row)
gets logit -inf. It is a pure function of that prefix, so the verifier stays exactly AR's law under it, whoever
drafts (spec/verify.py): the per-draft-position mask, with the matcher rolled back at the first rejection.

One llguidance matcher per request follows whatever prefix it is asked about: it rolls back to the longest common
prefix with the tokens it holds and consumes the rest. In a round the drafter's q rows walk it forward one draft at a
time; the verify rows then find their masks cached (by prefix length, for the tokens held); the next round rolls
back to the first rejected draft. EOS is allowed where the output may end, and alone once it is complete (nothing
else can follow: a closed top-level object); a prefix that holds an EOS or a token the grammar refuses (a rejected
draft's: p = 0 there, so no row past it is ever chosen from) gets EOS only too, a valid distribution rather than an
exception.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np
import torch

from ..errors import ConfigError, VerispecError
from .processors import LogitsProcessor, Prefix

MASKS_KEPT = 24  # masks cached per request, by output length (a [V] bool each)


class Grammars:
    """Compiles response formats for one model: its HF tokenizer (a fast one) seen by llguidance, built once on first
    use (~1 s for a 150k vocabulary), ``vocab_size`` logit rows, and the EOS ids that end a complete output."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int]):
        self.hf, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, tuple(eos_token_ids)
        self._ll = None

    def ll_tokenizer(self):
        """llguidance's view of the tokenizer (``LLTokenizer``), made on first use."""
        if self._ll is None:
            if self.hf is None:
                raise ConfigError("response_format needs the model's tokenizer; this model takes token ids only")
            eos = [t for t in self.eos_token_ids if t < len(self.hf)]  # ids the tokenizer knows
            if not eos:
                raise ConfigError("response_format needs an EOS token to end a complete output; this model has none")
            import llguidance.hf

            try:
                self._ll = llguidance.hf.from_tokenizer(self.hf, eos_token=eos)
            except Exception as e:  # noqa: BLE001 - a slow (Python) tokenizer, or one llguidance cannot read
                raise ConfigError(f"response_format: llguidance cannot use this tokenizer "
                                  f"({(str(e).strip().splitlines() or [type(e).__name__])[0]})") from None
        return self._ll

    def mask(self, constraint: dict | str, prompt_len: int) -> GrammarMask:
        """A request's mask: its output (the tokens from ``prompt_len`` on) must match ``constraint``, a JSON schema
        (dict) or a grammar in llguidance's Lark dialect (text)."""
        from llguidance import LLMatcher

        if isinstance(constraint, dict):
            grammar, name = LLMatcher.grammar_from_json_schema(constraint), "response_format"
        else:
            grammar, name = LLMatcher.grammar_from_lark(constraint), "grammar"
        return GrammarMask(self.ll_tokenizer(), grammar, self.vocab_size, self.eos_token_ids, prompt_len, name)

    def literal(self, text: str) -> str:
        """A Lark term for ``text``: the token ``<[id]>`` when the tokenizer writes it as one token that llguidance
        sees as special (an added token, such as Qwen's ``<tool_call>``: the grammar's string would not match it),
        else the quoted string."""
        if self.hf is not None:
            ids = self.hf.encode(text, add_special_tokens=False)
            if len(ids) == 1 and self.ll_tokenizer().is_special_token(ids[0]):
                return f"<[{ids[0]}]>"
        return json.dumps(text)


class GrammarMask(LogitsProcessor):
    """Logits [V] of one row -> the same with every token the grammar forbids after the row's output at -inf."""

    def __init__(self, ll_tokenizer, grammar: str, vocab_size: int, eos_token_ids: Sequence[int], prompt_len: int,
                 name: str = "response_format"):
        from llguidance import LLMatcher

        self.matcher = LLMatcher(ll_tokenizer, grammar, log_level=0)
        if self.matcher.is_error():
            raise ConfigError(f"{name}: {_first_line(self.matcher.get_error())}")
        self.prompt_len, self.vocab_size = prompt_len, vocab_size
        self.eos = frozenset(eos_token_ids)
        self.held: list[int] = []  # the output tokens the matcher has consumed, in order
        self.masks: dict[int, torch.Tensor] = {}  # len(output) -> forbidden [V] bool, for the tokens held
        self.not_eos = torch.ones(vocab_size, dtype=torch.bool)  # [V]: everything but EOS forbidden
        self.not_eos[[t for t in self.eos if t < vocab_size]] = False

    def __call__(self, prefix: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        forbidden = self.forbidden(prefix.tail(self.prompt_len) if isinstance(prefix, Prefix)
                                   else list(prefix)[self.prompt_len:])  # [V] bool
        return logits.masked_fill(forbidden.to(logits.device), float("-inf"))  # the one [V] torch op of a row

    def allowed(self, output: list[int]) -> torch.Tensor:
        """[V] bool: the tokens that may follow ``output`` (the generated tokens before the row)."""
        return ~self.forbidden(output)

    def forbidden(self, output: list[int]) -> torch.Tensor:
        """[V] bool: the tokens that may not follow ``output`` (read-only: it may be cached)."""
        common = _common_prefix(output, self.held)
        if common == len(output) and common in self.masks:  # a verify row after the drafter's: the matcher stays
            return self.masks[common]
        n = self._follow(output, common)
        if n < len(output):  # an EOS, or a token the grammar refuses: nothing but EOS past it
            return self.not_eos
        if n not in self.masks:
            self.masks[n] = self._compute()
            for old in sorted(self.masks)[:-MASKS_KEPT]:  # a round needs K + 1 of them, K <= 16
                del self.masks[old]
        return self.masks[n]

    def _follow(self, output: list[int], common: int) -> int:
        """Bring the matcher to ``output`` (``common``: its longest common prefix with the tokens held): roll back to
        it, then consume the rest up to the first EOS or refused token -> how many tokens of ``output`` it holds."""
        if common < len(self.held):
            if not self.matcher.rollback(len(self.held) - common):
                raise VerispecError(f"grammar: rollback failed ({_first_line(self.matcher.get_error())})")
            del self.held[common:]
            for n in [n for n in self.masks if n > common]:  # masks of the tokens given back
                del self.masks[n]
        rest = output[common:]
        rest = rest[:next((i for i, t in enumerate(rest) if t in self.eos), len(rest))]
        if rest:
            taken = self.matcher.try_consume_tokens(rest)  # stops before a refused token, no error state
            self.held += rest[:taken]
        if self.matcher.is_error():
            raise VerispecError(f"grammar: {_first_line(self.matcher.get_error())}")
        return len(self.held)

    def _compute(self) -> torch.Tensor:
        """[V] bool, True = forbidden: the matcher's mask for its current state (EOS only once the grammar is
        complete). Built in numpy: on a busy CPU each parallel torch op over [V] can cost milliseconds."""
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), count=self.vocab_size,
                             bitorder="little")  # [V] 0/1: ids past llguidance's vocabulary padded with 0
        return torch.from_numpy(bits == 0) if bits.any() else self.not_eos


def _common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists (slice comparisons: C speed, O(n log n) at worst)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _first_line(text: str) -> str:
    return (text.strip().splitlines() or ["unknown error"])[0]
