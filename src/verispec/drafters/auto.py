"""``method="auto"``: each round, the drafter whose draft promises the most tokens per second.

Every candidate drafter runs behind its own adaptive-length controller (adaptive.py), so each has live
estimates of its acceptance per position and of its costs. Cheap drafters (``cheap = True``: proposing
costs ~nothing and a proposal may be dropped without ``update``, e.g. n-gram lookup) propose first; the
draft they actually produced is valued with their estimates. The best expensive drafter is valued at its
chosen K. The round goes to the higher value; only the chosen drafter proposes (expensive) or is kept
(cheap), and only it is updated. Exactness is the verifier's business, whatever drafter is picked.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..adaptive import AdaptiveDrafter, DraftLengthController
from .base import Draft, DraftRequest


class AutoDrafter:
    adaptive = True  # chooses its own lengths: the engine must not wrap it again

    def __init__(self, drafters: dict[str, object], k_min: int, k_max: int):
        self.candidates = {name: AdaptiveDrafter(d, DraftLengthController(k_min, k_max))
                           for name, d in drafters.items()}
        self.chosen: AdaptiveDrafter | None = None

    def _value(self, name: str, K: int) -> float:
        controller = self.candidates[name].controller
        return controller.tokens_per_second(K) if controller.t_verify else float("inf")  # untried: try it

    def propose(self, request: DraftRequest) -> Draft:
        options = []  # (expected tokens/s, name, draft already made or None)
        for name, cand in self.candidates.items():
            if getattr(cand.inner, "cheap", False):  # propose now, value the draft it really has
                draft = cand.propose(request)
                if draft.tokens.shape[1]:
                    options.append((self._value(name, draft.tokens.shape[1]), name, draft))
            else:  # value it at the K it would choose; it proposes only if chosen
                options.append((self._value(name, cand.controller.choose(request.num_tokens)), name, None))
        if options:
            _, name, draft = max(options, key=lambda o: o[0])  # the first on ties
        else:  # only cheap drafters and none found anything: a plain target step
            name = next(iter(self.candidates))
            draft = Draft(torch.empty(1, 0, dtype=torch.long, device=request.device))
        self.chosen = self.candidates[name]
        if draft is None:
            draft = self.chosen.propose(request)
        return replace(draft, source=name)

    def update(self, num_accepted: int) -> None:
        self.chosen.update(num_accepted)
