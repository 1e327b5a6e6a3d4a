"""Logits -> tokens: per-row logits processors (processors.py), the response format's grammar mask (grammar.py), the
built-in transforms' numerics (transforms.py), drawing (draw.py) and the committed tokens' log-probabilities
(logprobs.py)."""

from .draw import draw, make_generator, next_token, sample
from .grammar import GrammarMask, Grammars
from .logprobs import MAX_TOP_LOGPROBS, TokenLogprob, token_logprobs
from .processors import LogitsProcessor, PaddingMask, Prefix, ProcessorChain, row_prefixes
from .transforms import argmax, logits_to_probs, mask_logits

__all__ = ["MAX_TOP_LOGPROBS", "TokenLogprob", "token_logprobs", "GrammarMask", "Grammars", "LogitsProcessor",
           "PaddingMask", "Prefix", "ProcessorChain", "argmax", "draw", "logits_to_probs", "make_generator",
           "mask_logits", "next_token", "row_prefixes", "sample"]
