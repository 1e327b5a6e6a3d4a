"""A draft head with its own KV cache (heads/: EAGLE-3, P-EAGLE, an MTP module) drafts from the target's own hidden
states; methods "eagle", "peagle" and "mtp".

The engine hands over the target's features of every committed position (``feature_layers`` asks for them; see
DraftRequest.features). Each round the head first catches up on the committed positions it has not read (the
whole prompt the first time; after a verify pass the accepted rows), each row pairing the target's features at
position r with the token at r + 1, then drafts K tokens in a chain, each step feeding its own output hidden state
and the token it just proposed. Its KV cache keeps the committed rows only: the chain's rows are dropped at the
start of the next round (a counter change). q is the head's distribution over its draft vocabulary, mapped to
target ids (zero elsewhere), after the same temperature / top-k / top-p transform as the target's p.
"""

from __future__ import annotations

import time

import torch

from ..heads.base import DraftHead, to_target_vocab
from ..models.kv_cache import KVCache
from ..sampling import Prefix, draw, mask_logits
from .base import Draft, Drafter, DraftRequest, chain_of


class HeadDrafter(Drafter):
    name = "eagle"
    adaptive_by_default = True

    def __init__(self, head: DraftHead):
        self.head = head
        self.feature_layers = head.feature_layers  # the target residual streams the engine must hand over
        self.cache: KVCache | None = None
        self.fed = 0  # committed rows in the head's cache: pairs (features at r, token at r + 1) for r < fed
        self.catch_up = (0, 0.0)  # (rows, seconds) of this round's catch-up

    def lag(self, context: list[int]) -> int:
        """Committed rows the head has not read: the next round's catch-up feeds them all."""
        return len(context) - 1 - (self.fed if self.cache is not None else 0)

    def propose(self, request: DraftRequest) -> Draft:
        ctx, K, head = request.context, request.num_tokens, self.head
        n = len(ctx) - 1  # committed positions whose features the target has computed
        feats = request.features  # [>= n, F]
        dtype, device = head.dtype, feats.device
        if self.cache is None or self.cache.capacity < request.capacity:
            self.cache, self.fed = head.new_cache(request.capacity, dtype, device), 0
        # 1. catch up: the committed rows the head has not read (dropping last round's chain rows)
        t0 = time.perf_counter()
        self.cache.truncate(self.fed)
        rows = feats[self.fed:n][None].to(dtype)  # [1, T, F]
        tokens = torch.tensor([ctx[self.fed + 1:n + 1]], device=device)  # [1, T]
        hidden = head.catch_up(rows, tokens, self.cache)  # [1, 1, D]
        self.catch_up = (n - self.fed, time.perf_counter() - t0)
        self.fed = n
        # 2. draft: K tokens (the chain on the head's own hidden states, or the family's way)
        tokens_out, probs_out, chain = [], [], chain_of(request)
        for hidden in self.hiddens(hidden, K):
            logits = self._target_logits(hidden, request)  # [1, V]
            token, probs = draw(logits, Prefix(ctx, tokens_out), chain, request.generator)
            tokens_out.append(token)  # [1]; probs: q [1, V] or None (greedy)
            if probs is not None:
                probs_out.append(probs)
            self.last_token = token
        draft_probs = torch.stack(probs_out, dim=1) if probs_out else None  # [1, K, V] or None (greedy)
        return Draft(torch.stack(tokens_out, dim=1), draft_probs)

    def hiddens(self, hidden: torch.Tensor, K: int):
        """Yield the K hidden states [1, 1, D] the drafts are drawn from: the catch-up's, then each step's on the
        token just drawn (``last_token``)."""
        for i in range(K):
            yield hidden
            if i + 1 < K:
                hidden = self.head.step(hidden, self.last_token[:, None], self.cache)  # [1, 1, D]

    def _target_logits(self, hidden: torch.Tensor, request: DraftRequest) -> torch.Tensor:
        """The head's logits over its draft vocabulary [1, Vd] placed at their target ids: [1, V], -inf elsewhere."""
        with torch.inference_mode():
            draft = self.head.logits(hidden)[:, -1]  # [1, Vd]
        return mask_logits(to_target_vocab(draft, self.head.d2t, request.vocab_size), request.logit_mask)

    def update(self, num_accepted: int) -> None:
        pass  # the chain's rows are dropped at the next catch-up (truncate to the committed rows)


class PEagleDrafter(HeadDrafter):
    """A P-EAGLE head (heads/peagle.py): the first draft from the catch-up's row, the other K-1 from one pass of mask
    rows (each q independent of the drafts before it: any q keeps the verifier exact)."""

    name = "peagle"

    def hiddens(self, hidden: torch.Tensor, K: int):
        yield hidden
        if K > 1:
            rows = self.head.parallel(K - 1, self.cache, hidden)  # [1, K-1, D]
            for i in range(K - 1):
                yield rows[:, i:i + 1]


class MtpDrafter(HeadDrafter):
    """An MTP module (heads/mtp.py) drafts as an EAGLE head does: catch up, then a chain on its own outputs."""

    name = "mtp"
