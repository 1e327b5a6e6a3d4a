"""How many tokens each request drafts this step, so that speculation backs off as the batch grows.

Every decoding request adds 1 row to the step's target forward, and k drafts add k rows more plus k of its
drafter's steps (drafters run one request after another). With the measured forward cost t(N) for N rows, each
request's draft cost per token and its per-position acceptance (costmodel.py), the step yields
``sum_i E_i(k_i)`` tokens (E(k) = 1 + sum_{j<=k} P(first j accepted)) for ``sum_i k_i t_draft_i + t(N)``
seconds. Drafts are handed out one at a time to the request whose next draft adds the most expected tokens per
second of extra step time, while that beats the step's tokens per second by SPEC_MARGIN (as auto asks of a
drafter: near break-even the estimates run ~10% optimistic). The step is valued as a plain decoding
step of all its sequences: a step that also reads prompt chunks yields few tokens for many rows, yet every second a
draft adds to it delays the whole batch, which would otherwise decode at the plain rate. A row's cost is the slope
of the forward costs measured at nearby sizes (two neighbouring timings are noisier than a row). One request alone
gets the K the cost model gives it; at 8 requests, where a forward's extra row costs almost as much as a whole step
on a 2-core CPU, speculation falls to the requests whose drafts are nearly always right, or to none. A request left
without drafts learns nothing, so it drafts once more after RETRY steps without, then after twice as many each time
(at most RETRY_MAX), as auto does with plain steps; but only where drafts that are always right would beat the bar
and the retry's catch-up stalls the batch for at most RETRY_MAX_CATCH_UP of its tokens.
"""

from __future__ import annotations

from ..adaptive import DraftLengthController, ema, verify_seconds
from ..drafters.auto import NO_SPEC_RETRY as RETRY, NO_SPEC_RETRY_MAX as RETRY_MAX, RETRY_MAX_CATCH_UP, SPEC_MARGIN


class SpecPolicy:
    """The measured costs (forward seconds per row count) and, per request, a DraftLengthController."""

    def __init__(self):
        self.t_forward: dict[int, float] = {}  # rows in the target forward -> EMA seconds
        self.controllers: dict[int, DraftLengthController] = {}  # request id -> its acceptance and draft cost
        self.idle: dict[int, tuple[int, int]] = {}  # request id -> (steps without drafts, steps before a retry)
        self.t_draft: float | None = None  # EMA seconds per drafted token over all requests: where a new one starts

    def controller(self, request_id: int, k_max: int) -> DraftLengthController:
        """A request's estimates; a new one starts from the prior acceptance and from the draft cost earlier
        requests measured (its drafts are not free before its first round)."""
        if request_id not in self.controllers:
            self.controllers[request_id] = ctl = DraftLengthController(1, max(k_max, 1))
            ctl.t_draft = self.t_draft
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
            self.t_draft = ema(self.t_draft, draft_s / k)

    def choose(self, wanted: dict[int, int], base_rows: int, catch_up: dict[int, tuple[float, float]] | None = None,
               seqs: int | None = None) -> dict[int, int]:
        """K per request (request id -> the most it may draft) for a step of ``seqs`` sequences (default: one row
        each) whose forward carries ``base_rows`` rows before drafts. ``catch_up``: request id -> (seconds its
        drafter would first spend on what it skipped, that cost's share of this step: a prompt's catch-up is a
        one-off spread over the steps left). Before any forward is measured no request drafts."""
        if not self.t_forward:
            return dict.fromkeys(wanted, 0)
        seqs = max(base_rows if seqs is None else seqs, len(wanted), 1)
        catch_up = catch_up or {}
        first_cost = {rid: share for rid, (_, share) in catch_up.items()}
        k = self._allot(wanted, base_rows, first_cost, seqs)
        bar = seqs / self._plain_seconds(seqs)  # tokens per second of a plain step of them all
        for rid, cap in wanted.items():  # back-off retries for requests left without drafts, if a retry is cheap
            steps, wait = self.idle.get(rid, (0, RETRY))
            if k[rid]:
                self.idle[rid] = (0, RETRY)
            elif steps + 1 >= wait and self._retry_pays(rid, cap, base_rows, catch_up.get(rid, (0.0, 0.0)), bar):
                k[rid], self.idle[rid] = cap, (0, min(2 * wait, RETRY_MAX))
            else:
                self.idle[rid] = (steps + 1, wait)
        return k

    def _retry_pays(self, rid: int, cap: int, base_rows: int, catch_up: tuple[float, float], bar: float) -> bool:
        """May a request left without drafts draft once more, for fresh evidence? Only if its catch-up stalls the
        batch for no more than RETRY_MAX_CATCH_UP tokens of the plain rate, and if drafts that are always right
        would beat the bar at all (in a big batch on a CPU no draft model can: learning its acceptance is waste)."""
        seconds, share = catch_up
        if seconds * bar > RETRY_MAX_CATCH_UP:
            return False
        return 1.0 / (self._draft_cost(self.controller(rid, cap), base_rows) + share) > bar

    def _allot(self, wanted: dict[int, int], base_rows: int, first_cost: dict[int, float] | None = None,
               seqs: int | None = None) -> dict[int, int]:
        """The cost model's K per request (before retries); ``first_cost``: seconds a request's first draft costs
        beyond drafting (its catch-up's share). The bar: a plain decoding step of the step's ``seqs`` sequences
        (default: one row each)."""
        first_cost = first_cost or {}
        k = dict.fromkeys(wanted, 0)
        seqs = max(base_rows if seqs is None else seqs, len(wanted), 1)
        tokens, seconds = float(seqs), self._plain_seconds(seqs)
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
            if best is None or best_rate <= SPEC_MARGIN * tokens / seconds:  # one more draft would not raise the
                return k  # step's tokens per second by the margin auto asks of a drafter (estimates run optimistic)
            ctl = self.controllers[best]
            tokens += _joint(ctl.rates(), k[best] + 1)
            seconds += self._draft_cost(ctl, rows) + (0.0 if k[best] else first_cost.get(best, 0.0))
            k[best] += 1
            rows += 1

    def _draft_cost(self, ctl: DraftLengthController, rows: int) -> float:
        """Seconds one more draft adds to a step whose forward has ``rows`` rows: a draft step and a row."""
        return (ctl.t_draft or 0.0) + self._row_seconds(rows)

    def _plain_seconds(self, seqs: int) -> float:
        """Seconds of a plain step of ``seqs`` rows. Below every measured size (only prompt chunks so far) it is
        the smallest one's cost per row times ``seqs``, no more: a forward's cost per row only falls with its
        rows, so this never makes the bar look low (a line through two noisy prompt chunks can reach any value)."""
        t = verify_seconds(self.t_forward, seqs)
        smallest = min(self.t_forward)
        return t if smallest <= seqs else min(t, self.t_forward[smallest] * seqs / smallest)

    def _row_seconds(self, rows: int) -> float:
        """Seconds one more row adds to a forward of ``rows`` rows: the least-squares slope of the forward costs
        measured between half and twice that size (two neighbouring timings are too noisy: a step's cost moves by
        10-20% on a busy CPU, more than a row's), never negative."""
        near = [(n, t) for n, t in self.t_forward.items() if rows / 2 <= n <= 2 * rows + 2]
        if len(near) < 2:
            return max(verify_seconds(self.t_forward, rows + 1) - verify_seconds(self.t_forward, rows), 0.0)
        mean_n = sum(n for n, _ in near) / len(near)
        mean_t = sum(t for _, t in near) / len(near)
        var = sum((n - mean_n) ** 2 for n, _ in near)
        return max(sum((n - mean_n) * (t - mean_t) for n, t in near) / var, 0.0)


def _joint(rates: list[float], i: int) -> float:
    """P(the first i drafts are accepted) from conditional per-position rates."""
    p = 1.0
    for a in rates[:i]:
        p *= a
    return p
