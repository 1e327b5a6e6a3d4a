"""Drawing tokens: one row through a request's chain (plain decoding and the sampling drafters), and the
generators that make it reproducible."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..config import SamplingParams
from .processors import ProcessorChain
from .transforms import argmax


def draw(logits: torch.Tensor, prefix: Sequence[int] | None, chain: ProcessorChain,
         generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Choose the next token after ``prefix``. logits: [1, V] -> (token [1] int64, q [1, V] float32 or None).

    q is the distribution the token was really drawn from (the processed probabilities), None when greedy (the
    argmax of the processed logits: a deterministic draft, one-hot q to the verifier). ``prefix`` may be None for a
    prefix-independent chain, and then logits may hold any number of rows [B, V] (tokens [B], q [B, V])."""
    prefixes = None if prefix is None else [prefix]
    if chain.greedy:
        return argmax(chain.logits(prefixes, logits)), None
    q = chain.probs(prefixes, logits)
    return sample(q, generator), q


def next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """One decoding step's choice under params alone (no processors, no mask). logits: [B, V] -> tokens [B]."""
    return draw(logits, None, ProcessorChain.from_params(params), generator)[0]


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token per row: the first whose cumulative weight (float64) passes a uniform draw over the row's
    total, so weights need not sum to 1 (a verifier's residual). probs: [B, V] -> tokens [B] (int64).

    Inverting the cumulative distribution takes ~0.4 ms a 151,936-token row on 2 cores; torch.multinomial ~3.2 ms
    (docs/BENCHMARKS.md, "Request options under speculation")."""
    cdf = torch.cumsum(probs, -1, dtype=torch.float64)  # [B, V]
    u = torch.rand(probs.shape[0], 1, generator=generator, dtype=torch.float64, device=probs.device)  # [B, 1]
    return torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


def make_generator(params: SamplingParams, device) -> torch.Generator | None:
    if params.greedy:
        return None
    g = torch.Generator(device=device)
    if params.seed is None:
        g.seed()
    else:
        g.manual_seed(params.seed)
    return g
