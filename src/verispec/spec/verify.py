"""Lossless acceptance of a draft: speculative sampling (Leviathan et al. 2022, arXiv:2211.17192,
Algorithm 1; Chen et al. 2023, arXiv:2302.01318). Variable names follow the papers.

Given the target's distributions p_1..p_{K+1} (one forward over the last committed token and the K
drafted tokens) and the draft's q_1..q_K:

- accept drafted x_i with probability min(1, p_i(x_i) / q_i(x_i)), left to right;
- at the first rejection, emit a *recovered* token drawn from norm(max(0, p_i - q_i)) and stop;
- if all K are accepted, emit a *bonus* token drawn from p_{K+1}.

Every output token is then distributed exactly as under autoregressive sampling from p, whatever the logits
processors, provided that:

- p_i is the *processed* target distribution given row i's own prefix, context + x_1..x_{i-1}: exactly what an
  autoregressive step would compute after committing x_1..x_{i-1} (the chain applied to row i with that prefix;
  a processor given the committed context alone would judge x_2.. against the wrong distribution);
- q_i is what x_i was really drawn from (the drafter's own processed distribution, or one-hot for a
  deterministic draft). The proof only needs q_i to be the law x_i came from, so the draft may use other
  processors than the target, or none.

Greedy decoding (temperature below SAMPLING_EPS) is the same rule with one-hot p: x_i is accepted iff it is
argmax p_i, and the recovered/bonus token is argmax p. A deterministic draft (q = None) is one-hot q.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..sampling import ProcessorChain, argmax, row_prefixes, sample

PLACEHOLDER_TOKEN_ID = -1  # pads output rows past their accepted run (vLLM's name)


@dataclass
class Verdict:
    tokens: torch.Tensor  # [B, K+1]: accepted drafts, then the recovered or bonus token, then PLACEHOLDER
    num_accepted: torch.Tensor  # [B] int64, in [0, K]


def verify(target_logits: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
           chain: ProcessorChain, generator: torch.Generator | None,
           contexts: Sequence[Sequence[int]] | None = None) -> Verdict:
    """target_logits: [B, K+1, V] as the model gave them; draft_tokens: [B, K] (K >= 0); draft_probs: [B, K, V] or
    None; contexts: B committed contexts (the tokens before row 0), needed when the chain reads prefixes."""
    B, K = draft_tokens.shape
    # p_i given its own prefix context + x_1..x_{i-1} (prefixes built only for a chain that reads them)
    prefixes = None if chain.prefix_independent or contexts is None else row_prefixes(contexts, draft_tokens)
    p = chain.probs(prefixes, target_logits)  # [B, K+1, V]
    x = draft_tokens[..., None]  # [B, K, 1]
    p_x = p[:, :K].gather(-1, x).squeeze(-1)  # [B, K]
    q_x = torch.ones_like(p_x) if draft_probs is None else draft_probs.gather(-1, x).squeeze(-1)  # [B, K]

    # Accept x_i iff u_i < p(x_i) / q(x_i), u_i ~ U[0, 1). Greedy: u = 0, so accept iff p(x_i) > 0.
    if chain.greedy:
        u = torch.zeros_like(p_x)
    else:
        u = torch.rand(p_x.shape, generator=generator, device=p_x.device)
    accepted = u * q_x < p_x  # [B, K]
    num_accepted = accepted.long().cumprod(dim=-1).sum(dim=-1)  # [B]: length of the accepted prefix

    # Where to draw the extra token from: norm(max(0, p - q)) at the first rejection, p_{K+1} if none.
    rows = torch.arange(B, device=p.device)
    rejected = num_accepted < K  # [B]
    at = num_accepted.clamp(max=K - 1)  # [B]: the rejected position (any valid index for bonus rows)
    p_n = p[rows, num_accepted]  # [B, V]
    if K == 0:  # nothing drafted: the extra token is the bonus, drawn from p_1
        q_n = torch.zeros_like(p_n)
    elif draft_probs is None:
        q_n = F.one_hot(draft_tokens[rows, at], p.shape[-1]).to(p.dtype)  # [B, V]
    else:
        q_n = draft_probs[rows, at]  # [B, V]
    q_n = q_n * rejected[:, None]  # bonus rows: q = 0, so the residual is p_{K+1} itself
    residual = (p_n - q_n).clamp_(min=0)  # [B, V]
    mass = residual.sum(-1, keepdim=True)  # [B, 1]
    # If p == q up to rounding the residual can vanish (a rejection is then all but impossible): use p.
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_n)
    extra = argmax(residual) if chain.greedy else sample(residual, generator)  # [B]

    tokens = torch.full((B, K + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.long, device=p.device)
    keep = torch.arange(K, device=p.device)[None] < num_accepted[:, None]  # [B, K]
    tokens[:, :K] = torch.where(keep, draft_tokens, PLACEHOLDER_TOKEN_ID)
    tokens[rows, num_accepted] = extra
    return Verdict(tokens, num_accepted)
