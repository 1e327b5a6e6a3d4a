"""How many tokens a request drafts: the one place K is decided.

- A request's bound is set once, when the engine admits it (``Engine.add``: the request's K, at most the engine's
  ``max_draft_tokens``); every per-request structure (its DraftLengthController, its drafter, its stats) is sized by
  that bound, and no step ever asks a drafter for more.
- In a batch, :class:`SpecPolicy` gives each request a K in [0, bound] from the measured forward cost and the
  request's acceptance (below); the scheduler reserves exactly those slots.
- ``method="auto"`` chooses a drafter (or none) per round from :class:`DraftLengthController` estimates, with the
  constants below; the draft model ends a round early by :func:`worth_another_draft`.
All of them read spec/costs.py.

In a batch, speculation backs off as the batch grows.

Every decoding request adds 1 row to the step's target forward, and k drafts add k rows more plus k of its drafter's
steps (drafters run one request after another). With the measured forward cost t(N) for N rows, each request's draft
cost per token and its per-position acceptance (costs.py), the step yields ``sum_i E_i(k_i)`` tokens (E(k) = 1 +
sum_{j<=k} P(first j accepted)) for ``sum_i k_i t_draft_i + t(N)`` seconds. Drafts are handed out one at a time to
the request whose next draft adds the most expected tokens per second of extra step time, while that beats the
step's tokens per second by SPEC_MARGIN (as auto asks of a drafter: near break-even the estimates run optimistic,
docs/BENCHMARKS.md, "auto"). The step is valued as a plain decoding step of all its sequences: a step that also
reads prompt chunks yields few tokens for many rows, yet every second a draft adds to it delays the whole batch,
which would otherwise decode at the plain rate. A row's cost is the slope of the forward costs measured at nearby
sizes (two neighbouring timings are noisier than a row). One request alone gets the K the cost model gives it; at 8
requests, where a forward's extra row costs almost as much as a whole step on a 2-core CPU, speculation falls to the
requests whose drafts are nearly always right, or to none. A request left without drafts learns nothing, so it
drafts once more after NO_SPEC_RETRY steps without, then after twice as many each time (at most NO_SPEC_RETRY_MAX),
as auto does with plain steps; but only where drafts that are always right would beat the bar and the retry's
catch-up stalls the batch for at most RETRY_MAX_CATCH_UP of its tokens.
"""

from __future__ import annotations

from .costs import LONG_CATCH_UP, Costs, expected_tokens, interpolate, joint, slope

PRIOR_C = 0.25  # draft seconds per drafted token / target seconds per step, before a drafter ran: between the 0.5B
# draft's measured c on the bf16 and on the native 1.5B target (docs/BENCHMARKS.md, "Draft model")
PRIOR_CATCH_UP = 0.03  # the same for each token of a catch-up (fed together: cheap per token)
NO_SPEC_RETRY = 4  # plain rounds in a row before the best drafter drafts again; doubled after each losing retry
NO_SPEC_RETRY_MAX = 64  # the longest wait between retries
RETRY_MAX_CATCH_UP = 2.0  # a retry may first spend this many target steps catching up, no more
PRIOR_WEIGHT = 1.0  # the prior acceptance counts as this many verdicts (DraftLengthController)
EXPLORE_ROUNDS = 2  # auto lets every expensive drafter draft this many rounds before it compares estimates
SPEC_MARGIN = 1.1  # a draft must promise this much more than a plain step: near break-even the estimates run
# optimistic (measured: docs/BENCHMARKS.md, "auto")


class Calibration:
    """P(a draft token is accepted | the draft's confidence q in it), learned from the verifier's verdicts.

    Confidence is cut into equal bins, each a running count started from a small prior centred on q itself
    (a calibrated draft). Drafts are often under-confident (an int8 0.5B draft of the 1.5B target: docs/BENCHMARKS.md,
    "Early stops"), so the raw q would end rounds early.
    """

    def __init__(self, bins: int = 10, prior: float = 2.0):
        self.bins = bins
        self.judged = [prior] * bins
        self.accepted = [prior * (b + 0.5) / bins for b in range(bins)]

    def _bin(self, q: float) -> int:
        return min(max(int(q * self.bins), 0), self.bins - 1)

    def __call__(self, q: float) -> float:
        b = self._bin(q)
        return self.accepted[b] / self.judged[b]

    def observe(self, confidences: list[float], num_accepted: int) -> None:
        """A round's drafts had these confidences; the first num_accepted were accepted, the next rejected."""
        for i, q in enumerate(confidences[: num_accepted + 1]):  # judged: the accepted ones and the first rejection
            b = self._bin(q)
            self.judged[b] += 1
            self.accepted[b] += i < num_accepted


def worth_another_draft(chances: list[float], t_draft: float, t_verify: dict[int, float]) -> bool:
    """Stop drafting early (draft model, within a round): after k drafted tokens with chances of acceptance
    a_1..a_k (from the draft's confidence in each, see Calibration), does one more draft, expected to be
    accepted as often as the last one, raise the round's expected rate?

    Rate of k drafts: (1 + sum_i prod_{j<=i} a_j) / (k * t_draft + t_verify(k + 1)). Rounds run long where
    the draft is sure and end where it hesitates, instead of spending a draft step and a verify row on a
    likely rejection. t_verify should hold all of a round's time outside drafting (the verify forward and
    the bookkeeping), so that the fixed cost of a round weighs against ending it early.
    """
    k, p = len(chances), joint(chances)
    tokens, seconds = 1.0 + sum(p), k * t_draft + interpolate(t_verify, k + 1)
    more_tokens = tokens + p[-1] * chances[-1]
    more_seconds = seconds + t_draft + interpolate(t_verify, k + 2) - interpolate(t_verify, k + 1)
    return more_tokens * seconds > tokens * more_seconds


class DraftLengthController:
    """Per-position acceptance (from a prior) of one drafter in one request (or per n-gram match length), and the
    K with the best expected rate given the measured costs it reads (``costs``: seconds per drafted token of drafter
    ``name``, a round's verify cost by size).

    Each position's estimate is the mean of its verdicts with the prior counted as PRIOR_WEIGHT of them, until that
    mean moves less than an EMA of ``decay`` would; from then on the EMA (recent rounds weigh more: a request's text
    changes). A plain EMA started at the prior kept 64% of the prior after two rounds: a draft model accepted 0.84 of
    the time still read ~0.68 and lost its turn to a cheaper drafter that was right half as often."""

    def __init__(self, k_min: int, k_max: int, prior_acceptance: float = 0.6, decay: float = 0.8,
                 costs: Costs | None = None, name: str = ""):
        if not 1 <= k_min <= k_max:
            raise ValueError(f"need 1 <= min draft tokens <= max draft tokens, got {k_min}, {k_max}")
        self.k_min, self.k_max, self.prior, self.decay = k_min, k_max, prior_acceptance, decay
        self.acceptance: list[float | None] = [None] * k_max  # estimate of P(accept i | 1..i-1 accepted)
        self.judged = [0] * k_max  # rounds that judged position i
        self.rounds = 0  # rounds judged: 0 = no record of its own yet
        self.costs, self.name = Costs() if costs is None else costs, name

    @property
    def t_draft(self) -> float | None:
        """Seconds per drafted token of its drafter (the store's), None before one drafted."""
        return self.costs.draft.get(self.name)

    @t_draft.setter
    def t_draft(self, seconds: float) -> None:
        self.costs.draft[self.name] = seconds

    @property
    def t_verify(self) -> dict[int, float]:
        """Verify size T -> seconds of a round besides drafting (the store's)."""
        return self.costs.round

    def rates(self) -> list[float]:
        """Per-position estimates; a position never judged takes the last judged one's (then the prior)."""
        out, last = [], self.prior
        for a in self.acceptance:
            last = last if a is None else a
            out.append(last)
        return out

    def verify_seconds(self, T: int) -> float:
        return interpolate(self.t_verify, T)

    def tokens_per_second(self, K: int, t_draft: float | None = None, extra_s: float = 0.0) -> float:
        """Expected tokens per second of a round of K drafts (t_draft: seconds per drafted token if not yet
        measured; extra_s: a further cost of this round, e.g. a draft model's catch-up)."""
        if not self.t_verify:
            return 0.0
        per_token = self.t_draft if self.t_draft is not None else (t_draft or 0.0)
        seconds = K * per_token + self.verify_seconds(K + 1) + extra_s
        return expected_tokens(self.rates()[:K]) / max(seconds, 1e-9)  # a clock too coarse to see a round: no 0

    def choose(self, k_cap: int) -> int:
        """K in [k_min, min(k_max, k_cap)] with the best expected rate (the largest before any measurement)."""
        hi = max(min(self.k_max, k_cap), 1)
        lo = min(self.k_min, hi)
        if not self.t_verify:
            return hi
        return max(range(lo, hi + 1), key=lambda k: (self.tokens_per_second(k), -k))

    def observe(self, K: int, num_accepted: int) -> None:
        """A round of K drafts, of which the first num_accepted were accepted."""
        # position i was judged iff all before it were accepted; its estimate starts from the prior, so that
        # one unlucky first round does not read as "never accepted" (and switch the drafter off for good)
        if K > self.k_max:
            raise ValueError(f"a round of {K} drafts exceeds the bound of {self.k_max} this controller was sized by")
        before = self.rates()
        for i in range(min(num_accepted + 1, K)):
            self.judged[i] += 1
            step = max(1.0 / (PRIOR_WEIGHT + self.judged[i]), 1.0 - self.decay)  # the mean's step, then the EMA's
            self.acceptance[i] = before[i] + step * (float(i < num_accepted) - before[i])
        self.rounds += K > 0


class SpecPolicy:
    """K per request in a batch, from the measured costs (``costs``, the engine's store) and, per request, a
    DraftLengthController of its acceptance."""

    def __init__(self, costs: Costs | None = None):
        self.costs = Costs() if costs is None else costs
        self.controllers: dict[int, DraftLengthController] = {}  # request id -> its acceptance
        self.idle: dict[int, tuple[int, int]] = {}  # request id -> (steps without drafts, steps before a retry)
        self.bounds: dict[int, tuple[int, str]] = {}  # request id -> (the most it may draft a step, its drafter)

    @property
    def t_forward(self) -> dict[int, float]:
        return self.costs.forward

    def admit(self, request_id: int, bound: int, drafter: str = "") -> None:
        """A request that may draft up to ``bound`` tokens a step (its K, set once by Engine.add) with the drafter
        of that name (its cost per drafted token is the store's)."""
        self.bounds[request_id] = (bound, drafter)

    def controller(self, request_id: int, k_max: int) -> DraftLengthController:
        """A request's estimates, sized by its bound (never by one step's budget-cut K); made at its first use, it
        starts from the prior acceptance and from the draft cost earlier requests measured by then (its drafts are
        not free before its first round)."""
        if request_id not in self.controllers:
            bound, name = self.bounds.get(request_id, (0, ""))
            self.controllers[request_id] = DraftLengthController(1, max(bound, k_max, 1), costs=self.costs, name=name)
        return self.controllers[request_id]

    def forget(self, request_id: int) -> None:
        self.controllers.pop(request_id, None)
        self.idle.pop(request_id, None)
        self.bounds.pop(request_id, None)

    def catch_up(self, drafter: str, lag: int, tokens_left: int) -> tuple[float, float]:
        """(seconds drafter ``drafter``, ``lag`` tokens behind, would first spend catching up, that cost's share of
        this step). A long catch-up (a draft model that has not read the prompt) is a one-off, spread over the steps
        left (``tokens_left`` new tokens, ~2 a drafting step)."""
        if lag <= 0 or not self.t_forward:
            return 0.0, 0.0
        seconds = self.costs.catch_up_s(drafter, lag, PRIOR_CATCH_UP * interpolate(self.t_forward, 1))
        if lag <= LONG_CATCH_UP:
            return seconds, seconds
        return seconds, seconds / max(tokens_left / 2, 1.0)

    def observe(self, request_id: int, k: int, num_accepted: int) -> None:
        """A request drafted k tokens and the verifier accepted num_accepted of them."""
        if k and request_id in self.controllers:
            self.controllers[request_id].observe(k, num_accepted)

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
        bar = seqs / max(self._plain_seconds(seqs), 1e-9)  # tokens per second of a plain step of them all
        for rid, cap in wanted.items():  # back-off retries for requests left without drafts, if a retry is cheap
            steps, wait = self.idle.get(rid, (0, NO_SPEC_RETRY))
            if k[rid]:
                self.idle[rid] = (0, NO_SPEC_RETRY)
            elif steps + 1 >= wait and self._retry_pays(rid, cap, base_rows, catch_up.get(rid, (0.0, 0.0)), bar):
                k[rid], self.idle[rid] = cap, (0, min(2 * wait, NO_SPEC_RETRY_MAX))
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
        cost = self._draft_cost(self.controller(rid, cap), base_rows) + share
        return cost <= 0 or 1.0 / cost > bar  # a draft that costs nothing measurable always pays

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
                gain = joint(ctl.rates()[:k[rid] + 1])[-1]  # P(the first k + 1 drafts accepted)
                cost = self._draft_cost(ctl, rows) + (0.0 if k[rid] else first_cost.get(rid, 0.0))
                rate = gain / cost if cost > 0 else float("inf")
                if rate > best_rate:
                    best, best_rate = rid, rate
            if best is None or best_rate <= SPEC_MARGIN * tokens / max(seconds, 1e-9):  # one more draft would not raise the
                return k  # step's tokens per second by the margin auto asks of a drafter (estimates run optimistic)
            ctl = self.controllers[best]
            tokens += joint(ctl.rates()[:k[best] + 1])[-1]
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
        t = interpolate(self.t_forward, seqs)
        smallest = min(self.t_forward)
        return t if smallest <= seqs else min(t, self.t_forward[smallest] * seqs / smallest)

    def _row_seconds(self, rows: int) -> float:
        """Seconds one more row adds to a forward of ``rows`` rows (costs.slope)."""
        return slope(self.t_forward, rows)

