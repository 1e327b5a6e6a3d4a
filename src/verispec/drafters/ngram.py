"""Model-free drafting by n-gram lookup in the context ("prompt lookup decoding", Saxena 2023; the
``prompt_lookup_num_tokens`` of transformers and vLLM's ``ngram`` method).

The last n committed tokens are looked up among all earlier n-grams of prompt + generated text, for n
from ``n_max`` down to ``n_min``; the tokens that followed the most recent earlier occurrence of the
longest matching n-gram are proposed. Nothing matches -> an empty draft, and the round is a plain target
step. The draft is deterministic (``draft_probs=None``): the verifier treats it as one-hot q, which keeps
it lossless for greedy decoding and for sampling alike.

The index is incremental: each committed token adds the n-grams that end just before it (one dict
insert per n), so a round costs O(n_max) lookups, never a rescan of the context.
"""

from __future__ import annotations

import torch

from .base import Draft, Drafter, DraftRequest


class NgramIndex:
    """For each n in [n_min, n_max]: n-gram -> the position right after its most recent occurrence that
    is followed by at least one token (so the context's own suffix never matches itself)."""

    def __init__(self, n_min: int, n_max: int):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got {n_min}, {n_max}")
        self.n_min, self.n_max = n_min, n_max
        self.tables: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(n_min, n_max + 1)}
        self.tokens: list[int] = []

    def extend(self, context: list[int]) -> None:
        """Index ``context``, which must extend the tokens seen so far (committed text only grows)."""
        old = len(self.tokens)
        if context[:old] != self.tokens:  # a different text: start over
            self.__init__(self.n_min, self.n_max)
            old = 0
        self.tokens = list(context)
        # The n-gram ending at position e-1 (continuation at e) becomes indexable once token e exists.
        for e in range(max(old, 1), len(context)):
            for n, table in self.tables.items():
                if e >= n:
                    table[tuple(context[e - n:e])] = e

    def lookup(self, max_tokens: int) -> tuple[list[int], int]:
        """(continuation of the longest, most recent match of the context's suffix, its n) or ([], 0)."""
        ctx = self.tokens
        for n in range(min(self.n_max, len(ctx)), self.n_min - 1, -1):
            start = self.tables[n].get(tuple(ctx[len(ctx) - n:]))
            if start is not None:
                return ctx[start:start + max_tokens], n
        return [], 0


class NgramDrafter(Drafter):
    name = "ngram"
    cheap = True  # proposing costs ~nothing and a proposal may be dropped without update()

    def __init__(self, n_min: int = 1, n_max: int = 4):
        self.index = NgramIndex(n_min, n_max)
        self.last_match = 0  # n of this round's match (0: none)

    def propose(self, request: DraftRequest) -> Draft:
        self.index.extend(request.context)
        tokens, self.last_match = self.index.lookup(request.num_tokens)
        if request.logit_mask is not None:  # never propose a padding row (cannot occur in real text)
            tokens = tokens[:next((i for i, t in enumerate(tokens) if request.logit_mask[t]), len(tokens))]
        return Draft(torch.tensor(tokens, dtype=torch.long, device=request.device).reshape(1, len(tokens)))

    def update(self, num_accepted: int) -> None:
        pass  # stateless beyond the index, which follows the committed context in propose()
