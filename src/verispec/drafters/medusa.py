"""A Medusa head (heads/medusa.py) drafts all its tokens from one row of the target's features; method "medusa".

The target's last residual stream at the last committed row it computed (position n - 1, the row that chose the
newest token x_n) goes through the target's final norm and each head's ResBlocks: head k proposes x_{n+k+1}. The K
drafts (at most the head count) come from one pass over that row, with no state to keep between rounds. Each is drawn
from its head's distribution (q: the draft vocabulary at its target ids, zero elsewhere) after the request's
processors given the drafts before it, as the verifier applies them to p; q does not depend on those drafts, which the
rejection rule allows: any q the draft was really drawn from keeps the output exactly the target's.
"""

from __future__ import annotations

import torch

from ..heads.base import to_target_vocab
from ..heads.medusa import MedusaHead
from ..sampling import Prefix, draw, mask_logits
from .base import Draft, Drafter, DraftRequest, chain_of


class MedusaDrafter(Drafter):
    name = "medusa"
    adaptive_by_default = True

    def __init__(self, head: MedusaHead):
        self.head = head
        self.feature_layers = head.feature_layers  # the target's last residual stream

    def propose(self, request: DraftRequest) -> Draft:
        ctx, head = request.context, self.head
        K = min(request.num_tokens, head.config.num_heads)
        row = request.features[len(ctx) - 2][None, None].to(head.dtype)  # [1, 1, D]: the row that chose ctx[-1]
        with torch.inference_mode():
            per_head = head.head_logits(head.fuse(row), K)  # K x [1, 1, Vd]: only the heads drafting
        chain, tokens, probs = chain_of(request), [], []
        for logits in per_head:
            logits = mask_logits(to_target_vocab(logits[:, -1], head.d2t, request.vocab_size), request.logit_mask)
            token, q = draw(logits, Prefix(ctx, tokens), chain, request.generator)  # [1], q [1, V] or None
            tokens.append(token)
            if q is not None:
                probs.append(q)
        return Draft(torch.stack(tokens, dim=1), torch.stack(probs, dim=1) if probs else None)
