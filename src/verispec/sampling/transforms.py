"""The numerics of the built-in transforms: logits -> probabilities (temperature, top-k, top-p), the padding
mask, and argmax.

The ONLY place these exist: autoregressive decoding, the drafters and the speculative verifier all reach them
through a :class:`~verispec.sampling.processors.ProcessorChain`, so "the target's distribution" means the same
thing everywhere. Order of filters as in transformers: temperature, then top-k, then top-p.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from ..config import SamplingParams


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits: [..., V] -> probabilities [..., V] (float32).

    Greedy params (temperature below SAMPLING_EPS, 0 included) give the one-hot of the argmax (first index on
    ties), so greedy decoding is a special case of sampling and a verifier needs no separate greedy path.
    """
    logits = logits.float()
    if params.greedy:
        return torch.zeros_like(logits).scatter_(-1, argmax(logits)[..., None], 1.0)
    logits = logits / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        probs = probs.masked_fill(top_p_drop(probs, params.top_p), 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


TOP_P_CANDIDATES = 1024  # tokens top-p looks at first: a stable sort of 151,936 takes ~13 ms, top-k of 1,024 ~0.7


def top_p_drop(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """probs [..., V] -> the tokens top-p drops, bool [..., V]: all but the smallest prefix of the tokens in order
    of probability (ties: the lower id first, as argmax) whose mass reaches ``top_p``. A token is dropped when the
    mass before it already reaches top_p. The order is a stable sort's, so the AR sampler and a verifier keep the
    very same set on every device and batch shape."""
    drop = _top_p_drop_among_candidates(probs, top_p)
    if drop is not None:
        return drop
    sorted_p, idx = probs.sort(dim=-1, descending=True, stable=True)  # [..., V] each
    drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p
    drop[..., 0] = False
    return torch.zeros_like(drop).scatter(-1, idx, drop)


def _top_p_drop_among_candidates(probs: torch.Tensor, top_p: float) -> torch.Tensor | None:
    """top_p_drop from the TOP_P_CANDIDATES most likely tokens alone, put in the whole sort's order; None where
    that cannot be told from them. It stands when every row's prefix ends before the candidates' smallest
    probability: every token above it is a candidate, in the same place and with the same running sum as in the
    sort of the whole row."""
    if TOP_P_CANDIDATES >= probs.shape[-1]:
        return None
    vals, ids = torch.topk(probs, TOP_P_CANDIDATES, dim=-1)  # [..., C] each
    ids, by_id = ids.sort(-1)  # the candidates by id, then a stable sort by probability: ties by the lower id
    vals, order = vals.gather(-1, by_id).sort(dim=-1, descending=True, stable=True)
    ids = ids.gather(-1, order)
    drop = (vals.cumsum(-1) - vals) >= top_p  # [..., C]
    drop[..., 0] = False
    last_kept = vals.masked_fill(drop, float("inf")).amin(-1)  # [...]
    if not bool((drop[..., -1] & (last_kept > vals[..., -1])).all()):
        return None
    return torch.ones_like(probs, dtype=torch.bool).scatter(-1, ids, drop)


def mask_logits(logits: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Padding rows of the embedding (mask [V], True = not a real token) can never be chosen. The same result as
    masked_fill, written only at the mask's positions: several times faster on 151,936-logit rows
    (docs/BENCHMARKS.md, "Draft step cost")."""
    return logits if mask is None else logits.index_fill(-1, _masked_ids(mask), float("-inf"))


@functools.lru_cache(maxsize=16)
def _masked_ids(mask: torch.Tensor) -> torch.Tensor:
    """[P] the positions of a mask's True entries (a tensor hashes by identity: one lookup per mask object; masks
    are made once and never changed)."""
    return mask.nonzero()[:, 0]


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """The largest logit's index per row, the first on ties: [..., V] -> [...] (int64), Tensor.argmax's result
    (NaN counts as the largest, as there). Float32 CPU rows go through NumPy's vectorized argmax, faster than
    torch.max and Tensor.argmax; other rows take torch.max, on bf16 CPU rows faster than Tensor.argmax
    (docs/BENCHMARKS.md, "Draft step cost")."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.as_tensor(np.asarray(logits.detach().numpy().argmax(-1), dtype=np.int64))
    return torch.max(logits, -1).indices
