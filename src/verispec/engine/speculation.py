"""How many tokens each request drafts this step, so that speculation backs off as the batch grows.

Every decoding request adds 1 row to the step's target forward, and k drafts add k rows more plus k of its
drafter's steps (drafters run one request after another). With the measured forward cost t(N) for N rows, each
request's draft cost per token and its per-position acceptance (costmodel.py), the step yields
``sum_i E_i(k_i)`` tokens (E(k) = 1 + sum_{j<=k} P(first j accepted)) for ``sum_i k_i t_draft_i + t(N)``
seconds. Drafts are handed out one at a time to the request whose next draft adds the most expected tokens per
second of extra step time, while that raises the step's tokens per second: one request alone gets the K the cost
model gives it; at 8 requests, where a forward's extra row costs almost as much as a whole step on a 2-core
CPU, speculation falls to the requests whose drafts are nearly always right, or to none. A request left without
drafts learns nothing, so it drafts once more after RETRY steps without, then after twice as many each time
(at most RETRY_MAX), as auto does with plain steps.
"""

from __future__ import annotations

from ..adaptive import DraftLengthController, ema, verify_seconds
from ..drafters.auto import NO_SPEC_RETRY as RETRY, NO_SPEC_RETRY_MAX as RETRY_MAX, RETRY_MAX_CATCH_UP


class SpecPolicy:
    """The measured costs (forward seconds per row count) and, per request, a DraftLengthController."""

    def __init__(self):
        self.t_forward: dict[int, float] = {}  # rows in the target forward -> EMA seconds
        self.controllers: dict[int, DraftLengthController] = {}  # request id -> its acceptance and draft cost
        self.idle: dict[int, tuple[int, int]] = {}  # request id -> (steps without drafts, steps before a retry)

    def controller(self, request_id: int, k_max: int) -> DraftLengthController:
        if request_id not in self.controllers:
            self.controllers[request_id] = DraftLengthController(1, max(k_max, 1))
        return self.controllers[request_id]

    def forget(self, request_id: int) -> None:
        self.controllers.pop(request_id, None)
        self.idle.pop(request_id, None)

    def observe_forward(self, rows: int, seconds: float) -> None:
        self.t_forward[rows] = ema(self.t_forward.get(rows), seconds)

    def observe(self, request_id: int, k: int, num_accepted: int, draft_s: float) -> None:
        """A request drafted k tokens in draft_s seconds and the verifier accepted num_accepted of them."""
        if k and request_id in self.controllers:
            self.controllers[request_id].observe(k, num_accepted, draft_s, 0.0)

    def choose(self, wanted: dict[int, int], base_rows: int, catch_up: dict[int, tuple[float, float]] | None = None
               ) -> dict[int, int]:
        """K per request (request id -> the most it may draft) for a step whose forward carries ``base_rows``
        rows before drafts. ``catch_up``: request id -> (seconds its drafter would first spend on what it skipped,
        that cost's share of this step: a prompt's catch-up is a one-off spread over the steps left). Before the
        forward cost is measured every request drafts its most (the first steps measure it)."""
        if not self.t_forward:
            return dict(wanted)
        catch_up = catch_up or {}
        k = self._allot(wanted, base_rows, {rid: share for rid, (_, share) in catch_up.items()})
        step = verify_seconds(self.t_forward, 1)
        for rid, cap in wanted.items():  # back-off retries for requests left without drafts, if a retry is cheap
            steps, wait = self.idle.get(rid, (0, RETRY))
            if k[rid]:
                self.idle[rid] = (0, RETRY)
            elif steps + 1 >= wait and catch_up.get(rid, (0.0, 0.0))[0] <= RETRY_MAX_CATCH_UP * step:
                k[rid], self.idle[rid] = cap, (0, min(2 * wait, RETRY_MAX))
            else:
                self.idle[rid] = (steps + 1, wait)
        return k

    def _allot(self, wanted: dict[int, int], base_rows: int, first_cost: dict[int, float] | None = None
               ) -> dict[int, int]:
        """The cost model's K per request (before retries); ``first_cost``: seconds a request's first draft costs
        beyond drafting (its catch-up's share)."""
        first_cost = first_cost or {}
        k = dict.fromkeys(wanted, 0)
        tokens, seconds = float(len(wanted)), verify_seconds(self.t_forward, max(base_rows, 1))
        rows = base_rows
        while True:
            best, best_rate = None, 0.0
            for rid, cap in wanted.items():
                if k[rid] >= cap:
                    continue
                ctl = self.controller(rid, cap)
                gain = _joint(ctl.rates(), k[rid] + 1)  # P(the first k + 1 drafts accepted)
                cost = self._draft_cost(ctl, rows) + (0.0 if k[rid] else first_cost.get(rid, 0.0))
                rate = gain / cost if cost > 0 else float("inf")
                if rate > best_rate:
                    best, best_rate = rid, rate
            if best is None or best_rate <= tokens / seconds:  # one more draft would lower tokens per second
                return k
            ctl = self.controllers[best]
            tokens += _joint(ctl.rates(), k[best] + 1)
            seconds += self._draft_cost(ctl, rows) + (0.0 if k[best] else first_cost.get(best, 0.0))
            k[best] += 1
            rows += 1

    def _draft_cost(self, ctl: DraftLengthController, rows: int) -> float:
        """Seconds one more draft adds to a step whose forward has ``rows`` rows: a draft step and a row."""
        return (ctl.t_draft or 0.0) + verify_seconds(self.t_forward, rows + 1) - verify_seconds(self.t_forward, rows)


def _joint(rates: list[float], i: int) -> float:
    """P(the first i drafts are accepted) from conditional per-position rates."""
    p = 1.0
    for a in rates[:i]:
        p *= a
    return p
