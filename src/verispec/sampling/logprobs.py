"""Log-probabilities of the tokens a request commits, from the target's own rows (OpenAI's ``logprobs``).

A committed token's row is the target row that chose it: the verify row of an accepted draft, of the recovered or
bonus token, or the one row of a plain step, so they are the target's numbers whatever drafted. They are the model's
log-probabilities (``log_softmax`` of its logits, padding rows masked out), before temperature, top-k or top-p, as
OpenAI and vLLM's default report them. Each row is reduced alone: a row's result never depends on how many rows its
forward had (bitwise, with batch-invariant native weights), so speculation and plain decoding report the same bits.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .transforms import mask_logits

MAX_TOP_LOGPROBS = 20  # the most alternatives a token reports (OpenAI's limit)


class TokenLogprob(NamedTuple):
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the ``n`` likeliest tokens and theirs, likeliest first


def token_logprobs(rows: torch.Tensor, tokens: list[int], n: int, mask: torch.Tensor | None) -> list[TokenLogprob]:
    """rows [len(tokens), V] (row i chose tokens[i]) -> each token's log-probability and the top ``n`` of its row."""
    out = []
    for row, token in zip(rows, tokens):
        lp = torch.log_softmax(mask_logits(row[None].float(), mask)[0], dim=-1)  # [V], one row at a time
        top = lp.topk(n) if n else None
        pairs = tuple(zip(top.indices.tolist(), top.values.tolist())) if n else ()
        out.append(TokenLogprob(token, lp[token].item(), pairs))
    return out
