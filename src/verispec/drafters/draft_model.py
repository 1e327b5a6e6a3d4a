"""A separate small model drafts K tokens autoregressively, with its own KV cache.

Each round it first catches up on the committed tokens it has not seen (the recovered or bonus
token, plus the last drafted token after a fully accepted round), in one forward, then samples K
tokens with the same temperature / top-k / top-p transform as the target. With ``early_stop`` it ends
the round before K once the draft's own confidence says one more token is not worth a draft step and a
verify row (spec/policy.py worth_another_draft); the verifier is the same whatever the draft length, so this
changes the speed, never the output distribution. A seeded sample is never stopped by this timed rule: a stop
decided by measured time would change how many random numbers its drafts draw, and so which text that seed gives.
"""

from __future__ import annotations

import time
import weakref

import numpy as np
import torch
import torch.nn.functional as F

from ..spec.policy import Calibration, worth_another_draft
from ..models.kv_cache import KVCache, PrefixCache
from ..models.llama import Transformer
from ..sampling import Prefix, draw, mask_logits
from .base import Draft, Drafter, DraftRequest, chain_of


class DraftModelDrafter(Drafter):
    name = "draft"

    def __init__(self, model: Transformer, early_stop: bool = True, calibrations: dict | None = None,
                 prefixes: PrefixCache | None = None):
        self.model = model
        self.prefixes = prefixes  # the draft cache of the last request, to start from (None: always from scratch)
        self._give_back: weakref.finalize | None = None
        self.early_stop = early_stop
        # sampling settings -> Calibration (confidence -> chance of acceptance); pass one dict to keep learning
        # across requests (LLM does)
        self.calibrations = {} if calibrations is None else calibrations
        self.calibration: Calibration | None = None  # this request's
        self.confidences: list[float] = []  # this round's, one per proposed token (early_stop only)
        self.cache: KVCache | None = None  # holds context[:cache.length]; the engine's context is the truth
        self.num_proposed = 0  # K of this round, for update()
        self.catch_up = (0, 0.0)  # (tokens, seconds) fed this round to catch up, and their cost beyond a draft step

    def lag(self, context: list[int]) -> int:
        """Tokens of ``context`` the draft cache lacks: the next round's first forward feeds them all."""
        if self.cache is not None:
            return len(context) - self.cache.length
        return len(context) - (self.prefixes.reusable(self.model, context) if self.prefixes is not None else 0)

    def propose(self, request: DraftRequest) -> Draft:
        ctx, K = request.context, request.num_tokens
        device = self.model.embed_tokens.weight.device
        if self.cache is None or self.cache.capacity < request.capacity:
            self.cache = self._new_cache(request, device)
        # 1. catch up: feed the committed tokens the draft cache lacks (all of the prompt, first time)
        tokens = torch.tensor([ctx[self.cache.length:]], device=device)  # [1, T]
        tokens_out, probs_out = [], []
        self.confidences = []
        if self.early_stop and self.calibration is None:
            p = request.params
            self.calibration = self.calibrations.setdefault((p.temperature, p.top_k, p.top_p), Calibration())
        chain = chain_of(request)
        t_draft = request.costs.draft.get(self.name) if request.costs is not None else None  # per draft step
        for i in range(K):
            t0, fed = time.perf_counter(), tokens.shape[1]
            logits = fit_vocab(self._forward(tokens), request.vocab_size, request.logit_mask)  # [1, V]
            token, probs = draw(logits, Prefix(ctx, tokens_out), chain, request.generator)  # [1], q [1, V] or None
            tokens_out.append(token)
            if probs is not None:
                probs_out.append(probs)
            tokens = token[:, None]  # [1, 1]
            # 2. the first forward carries the catch-up: its cost beyond a draft step
            if i == 0:
                self.catch_up = (fed, max(time.perf_counter() - t0 - (t_draft or 0.0), 0.0))
            # 3. early stop: is one more draft token worth its draft step and verify row?
            if self.early_stop:
                self.confidences.append(confidence(logits, probs))
                if i + 1 < K and self.stop_now(self.confidences, t_draft, request):
                    break
        self.num_proposed = len(tokens_out)
        draft_tokens = torch.stack(tokens_out, dim=1)  # [1, K]
        draft_probs = torch.stack(probs_out, dim=1) if probs_out else None  # [1, K, V] or None (greedy)
        return Draft(draft_tokens, draft_probs)

    def stop_now(self, confidences: list[float], t_draft: float | None, request: DraftRequest) -> bool:
        """End the round after the drafts so far (confidences: q's maximum at each; t_draft: the store's seconds
        per draft step)? Any rule that looks only at the draft's side keeps the output exact; this one weighs one
        more draft by the cost model, with the chances of acceptance that this pair's verdicts so far give those
        confidences."""
        p = request.params
        if not p.greedy and p.seed is not None:  # a seeded sample: a stop decided by measured time would change how
            return False  # many random numbers its drafts draw, and so the text that seed gives
        if t_draft is None or request.costs is None or not request.costs.round:
            return False  # nothing measured yet: draft K
        chances = [self.calibration(q) for q in confidences]
        return not worth_another_draft(chances, t_draft, request.costs.round)

    def _new_cache(self, request: DraftRequest, device) -> KVCache:
        """A cache for this request: from the prefix store when there is one (holding what the last request's
        context shares with this one), which gets it back, with this context, once this drafter is dropped."""
        if self.prefixes is None:
            return KVCache.for_model(self.model.config, 1, request.capacity, self.model.dtype, device)
        cache = self.prefixes.take(self.model, request.context, request.capacity, self.model.dtype, device)
        if self._give_back is not None:
            self._give_back.detach()
        self._give_back = weakref.finalize(self, self.prefixes.put, self.model, cache, request.context)
        return cache

    def _forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed tokens [1, T] at the next positions; return the last position's logits [1, V]."""
        start = self.cache.length
        positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)[None]
        logits, _ = self.model(tokens, positions, self.cache, num_logits=1)
        return logits[:, -1]

    def update(self, num_accepted: int) -> None:
        # The cache holds the context plus the first K-1 of the K proposed drafts (the last draft was never fed
        # back in); keep the context and the accepted ones. The rest is fed next round from the committed context.
        K = self.num_proposed
        if self.confidences:
            self.calibration.observe(self.confidences, num_accepted)
        self.cache.truncate(self.cache.length - (K - 1) + min(num_accepted, K - 1))


def confidence(logits: torch.Tensor, probs: torch.Tensor | None) -> float:
    """The draft's probability of its most likely token: q's maximum when sampling, softmax(logits)'s when
    greedy (logits [1, V], probs [1, V] or None)."""
    if probs is not None:
        return probs.max().item()
    logits = logits.float()
    if logits.device.type == "cpu":  # 1 / sum exp(x - max) in NumPy: faster than logsumexp (docs/BENCHMARKS.md,
        # "Draft step cost")
        x = logits[0].numpy()
        return float(1.0 / np.exp(x - x.max()).sum())
    return (logits.max() - torch.logsumexp(logits, -1)[0]).exp().item()


def fit_vocab(logits: torch.Tensor, vocab_size: int, mask: torch.Tensor | None) -> torch.Tensor:
    """Draft logits [B, Vd] -> [B, vocab_size] over the target's rows, padding rows masked out.

    Same tokenizer, different padding (e.g. 151,936 vs 152,064 embedding rows) is fine: rows past
    either model's real vocabulary are masked, so cutting or padding them changes nothing.
    """
    Vd = logits.shape[-1]
    if Vd > vocab_size:
        logits = logits[..., :vocab_size]
    elif Vd < vocab_size:
        logits = F.pad(logits, (0, vocab_size - Vd), value=float("-inf"))
    return mask_logits(logits, mask)
