"""The request front end shared by ``LLM``, the CLI and the server: the method check, the context check, and turning
committed tokens into text (incremental detokenisation, EOS, stop strings, max_new_tokens).

Tokens are fed in commit order, so a speculative step that commits several tokens at once stops at exactly the token
where autoregressive decoding would have stopped; a step's text is split by origin (the accepted drafts' text, then
the target's own token's) for callers that show it (the server's chat page).
"""

from __future__ import annotations

from typing import NamedTuple

from .drafters import AR, check_method
from .errors import VerispecError
from .stopping import StopChecker

__all__ = ["AR", "Piece", "check_method", "fit_context", "feed"]


def fit_context(prompt_tokens: int, max_new_tokens: int | None, context: int, room: int | None = None,
                name: str = "max_new_tokens") -> int:
    """The new tokens a request may generate: ``max_new_tokens``, or when None all the room the context (and
    ``room``: the most tokens a KV cache holds) leaves; a one-line VerispecError when the prompt does not fit.
    ``name``: the caller's name for the field (the server's is max_tokens)."""
    if prompt_tokens >= context:
        raise VerispecError(f"the prompt is {prompt_tokens} tokens; the model's context is {context}")
    limit = context if room is None else min(context, room)
    max_new = limit - prompt_tokens if max_new_tokens is None else max_new_tokens
    if max_new < 1 or prompt_tokens + max_new > limit:
        raise VerispecError(f"the prompt ({prompt_tokens} tokens) + {name} ({max_new}) exceeds the model's context of "
                            f"{limit} tokens: shorten the prompt or lower {name}")
    return max_new


class Piece(NamedTuple):
    """Streamed text of one origin: ``draft`` if accepted draft tokens made it, else the target's own token."""

    text: str
    draft: bool


def feed(stopper: StopChecker, tokens: list[int], num_draft: int = 0) -> tuple[Piece, ...]:
    """Feed one step's committed tokens to ``stopper``: the first ``num_draft`` (accepted drafts), then the rest (the
    target's token); their streamable text by origin. Text a token leaves incomplete goes out with a later piece,
    and nothing is fed once the stopper has finished, so the pieces of all steps concatenate to the whole text."""
    pieces = []
    for part, draft in ((tokens[:num_draft], True), (tokens[num_draft:], False)):
        if part and not stopper.finished:
            stopper.append(part)
            if text := stopper.stream_piece():
                pieces.append(Piece(text, draft))
    return tuple(pieces)
