"""``method="auto"``: each round, the drafter whose draft promises the most tokens per second.

Every drafter is valued with the cost model of spec/policy.py and spec/costs.py: its live per-position acceptance
(kept here) and the costs the engine measures into its one store (``DraftRequest.costs``: seconds per drafted token
of each drafter, a round's verify cost per size, each drafter's catch-up per token): a round of K drafts yields
``1 + sum_i P(first i accepted)`` tokens for ``K * t_draft + t_verify(K + 1)`` seconds.

- Cheap drafters (``cheap = True``: proposing costs ~nothing and a proposal may be dropped without
  ``update``, e.g. n-gram lookup) propose first, and the draft they actually made is valued. A drafter
  that reports the length of its match (``last_match``) gets separate estimates per match length: a
  4-token match continues far more often than a 1-token one. K is then cut to the best length for them.
  A cheap draft with no record yet (a match length never tried) is valued at the prior acceptance if its
  match is long enough (TRY_MIN_MATCH), else not at all: it is tried when that beats the draft model.
- An expensive drafter (a draft model, a draft head) is valued at the K it would choose, plus the catch-up it
  needs first: a drafter that sat out rounds (or never ran: the whole prompt) must feed what its cache lacks.
  A short catch-up is this round's cost; a long one (a prompt) is a one-off, spread over the rounds left. The engine
  learns catch-up time per token (short and long apart) from what the drafter reports (``catch_up``) and keeps it
  out of the per-token draft cost. Before its first
  round a drafter is valued with priors in units of one target step (PRIOR_C per drafted token, PRIOR_CATCH_UP
  per catch-up token: the 0.5B draft of the 1.5B target on CPU, where PRIOR_C sits between the ratio measured with
  the 4-bit draft on the bf16 target and on the native target; docs/BENCHMARKS.md, "Draft model").
- Acceptance estimates start from the prior (0.6 a position, worth one verdict) and follow the verdicts' mean, then
  an EMA (spec/policy.py, DraftLengthController): one unlucky first round lowers a drafter's estimate, it does not
  switch it off.
- Every expensive drafter drafts EXPLORE_ROUNDS rounds (unless a cheap draft is worth more) before it is compared
  with the other expensive ones, and no plain step is taken instead: valued at the prior, a draft model (c ~0.3)
  lost to a cheap head (c ~0.1) that was right half as often, and one never chosen never showed what it could do.
- From then on an expensive drafter is valued by what its rounds delivered (``Realized``: their tokens over their
  seconds at the store's costs, each of its rounds discounting the earlier ones by REALIZED_DECAY), plus a long
  catch-up still ahead of it, not by the model of its acceptance: the model valued a round at the K the controller
  would choose, while a draft model that stops early drafts fewer, and it ran optimistic for a cheap head.
- What a drafter delivered fades every round, drafted or not, and IDLE_ROUNDS rounds after it last drafted it
  drafts once more (if its catch-up is cheap, RETRY_MAX_CATCH_UP), so a choice made on earlier text, or in an
  earlier request, is revisited (docs/BENCHMARKS.md, "auto"). While plain steps win, that revisit is their retry
  and waits for their back-off (below): where no drafter pays (verify costs steep, as on AVX2), every drafter's
  revisit each IDLE_ROUNDS rounds cost more than the back-off saved.
- The acceptance and the deliveries auto learns are kept across requests (``memory``, held by the LLM per drafter
  set, K range and sampling setting; the costs live in the engine's store): a new request starts from the last
  one's, so a drafter is not explored again on every request (the head's first round reads the whole prompt; on
  CPU that costs a few target steps).

- No speculation (K = 0, an empty draft: the engine runs a plain target step) is an option too, worth
  ``1 / t_verify(1)`` tokens per second (one target forward per token). It is taken unless a drafter promises
  SPEC_MARGIN times more (REALIZED_MARGIN times, valued by what it delivered), once the best drafter has a record of
  its own (a drafter never measured is tried first, and
  before any verify is measured auto drafts). A plain round is timed by the engine like any other: it measures
  t_verify(1). Switched-off drafters learn nothing, so after a run of plain rounds the best drafter drafts
  once more for fresh evidence (unless it would first spend more than RETRY_MAX_CATCH_UP target steps catching up,
  e.g. on a prompt it never read):
  after NO_SPEC_RETRY plain rounds, then twice as many after each retry that
  loses (at most NO_SPEC_RETRY_MAX), back to NO_SPEC_RETRY when a drafter wins. A context that turns
  predictable gets speculation back. ``allow_no_spec=False`` always drafts.

- A seeded sample is reproducible: its rounds follow no measured time (which drafter and how long a draft decide
  which random numbers the seed feeds). It drafts every round with one delegate, the first expensive one (the draft
  model where there is one, else the head), else the cheap one, at the request's fixed K (the engine fixes K for it),
  and no plain step is chosen instead.

Only the chosen drafter proposes (expensive) or is kept (cheap), and only it learns from the round.
Exactness is the verifier's business, whatever drafter is picked.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from ..spec.costs import LONG_CATCH_UP, Costs, expected_tokens, interpolate
from ..spec.policy import (EXPLORE_ROUNDS, NO_SPEC_RETRY, NO_SPEC_RETRY_MAX, PRIOR_C, PRIOR_CATCH_UP,
                           RETRY_MAX_CATCH_UP, SPEC_MARGIN, DraftLengthController)
from .base import Draft, Drafter, DraftRequest

REALIZED_DECAY = 0.9  # the weight of earlier rounds in what an expensive drafter delivered, per round auto plays
IDLE_ROUNDS = 20  # rounds an expensive drafter sits out before it drafts once more (if it catches up cheaply)
REALIZED_MARGIN = 1.03  # what a drafter's rounds delivered must beat a plain step by this much (SPEC_MARGIN: what
# the model of its acceptance promises, which runs optimistic near break-even)
TRY_MIN_MATCH = 3  # an n-gram match this long is valued at the prior without a record (shorter: only with a
# record, or alone): untried 1- and 2-gram matches were accepted far less often than 3- and 4-grams (one-off
# count: docs/BENCHMARKS.md, "auto")


@dataclass
class Realized:
    """What an expensive drafter's rounds delivered: discounted sums of their tokens, of their seconds (drafting, the
    round besides drafting, short catch-ups; the store's costs at the round's K) and of their number. Every round
    auto plays discounts them by REALIZED_DECAY, whether this drafter drafted in it or not (a plain step, another
    drafter's round). A drafter that has sat out IDLE_ROUNDS rounds is no longer ``known``: it drafts once more, and
    that round weighs about as much as all it did before, so a choice made on earlier text (or in an earlier
    request) is revisited."""

    tokens: float = 0.0
    seconds: float = 0.0
    rounds: float = 0.0
    count: int = 0  # rounds drafted
    idle: int = 0  # rounds since it last drafted

    def observe(self, tokens: int, seconds: float) -> None:
        self.fade()
        self.tokens, self.seconds, self.rounds = self.tokens + tokens, self.seconds + seconds, self.rounds + 1
        self.count, self.idle = self.count + 1, 0

    def fade(self) -> None:
        self.tokens, self.seconds, self.rounds = (REALIZED_DECAY * v for v in (self.tokens, self.seconds, self.rounds))
        self.idle += 1

    @property
    def known(self) -> bool:
        """Long enough and recent enough a record to value the drafter by."""
        return self.count >= EXPLORE_ROUNDS and self.idle < IDLE_ROUNDS

    def tokens_per_second(self, extra_s: float = 0.0) -> float:
        """Tokens per second of its rounds, with ``extra_s`` more seconds a round."""
        return (self.tokens / self.rounds) / max(self.seconds / self.rounds + extra_s, 1e-9)


@dataclass
class AutoMemory:
    """What auto has learned of acceptance: a DraftLengthController per (drafter, match length), and what each
    expensive drafter's rounds delivered."""

    controllers: dict[tuple[str, int | None], DraftLengthController] = field(default_factory=dict)
    realized: dict[str, Realized] = field(default_factory=dict)


class AutoDrafter(Drafter):
    name = "auto"
    adaptive = True  # chooses its own lengths: the engine must not wrap it again

    def __init__(self, drafters: dict[str, object], k_min: int, k_max: int, allow_no_spec: bool = True,
                 memory: dict | None = None):
        self.drafters = drafters
        # the target hidden states its delegates read (draft heads), each layer once, in the order first asked for:
        # the engine keeps them all, and each delegate is handed the columns of its own layers (_for)
        layers: list[int] = []
        for d in drafters.values():
            layers += [i for i in d.feature_layers if i not in layers]
        self.feature_layers = tuple(layers)
        self.k_min, self.k_max = k_min, k_max
        self.allow_no_spec = allow_no_spec  # a plain target step (K = 0) may be chosen
        self._memories = memory  # kept across requests: key -> AutoMemory, looked up in the first round
        self.costs = Costs()  # the engine's store, from the first request on (its own until then)
        self._use(AutoMemory())
        self.plain_rounds = 0  # plain rounds chosen in a row since the last drafter round
        self.retry_after = NO_SPEC_RETRY  # plain rounds before the best drafter drafts again
        self.plain_phase = False  # plain steps win (since the last round a drafter won on its value)
        self._round: tuple | None = None  # (drafter, controller, K, its name if expensive) of this round;
        # drafter None: a plain step
        self.catch_up = (0, 0.0)  # the chosen delegate's catch-up this round (tokens, seconds beyond drafting)

    def lag(self, context: list[int]) -> int:
        """Tokens of ``context`` that the delegates keeping state (a draft model, a head) have not read, the most of
        any: in a batch the engine charges a first draft with that catch-up (spec/policy.py)."""
        return max((d.lag(context) for d in self.drafters.values()), default=0)

    def delegates(self) -> dict[str, Drafter]:
        return self.drafters

    def _for(self, d: Drafter, request: DraftRequest) -> DraftRequest:
        """``request`` as delegate ``d`` reads it: of the features the engine kept (``self.feature_layers``), the
        columns of ``d``'s own layers in its order; a view when they lie side by side, as for heads whose layers
        are all of the kept ones or a run of them."""
        mine = tuple(d.feature_layers)
        if request.features is None or not mine or mine == self.feature_layers:
            return request
        H = request.features.shape[-1] // len(self.feature_layers)  # one residual stream's width
        at = [self.feature_layers.index(i) for i in mine]
        if at == list(range(at[0], at[0] + len(at))):
            features = request.features[..., at[0] * H:(at[-1] + 1) * H]  # [n, len(mine) * H], a view
        else:
            cols = torch.cat([torch.arange(j * H, (j + 1) * H, device=request.features.device) for j in at])
            features = request.features.index_select(-1, cols)  # [n, len(mine) * H]
        return replace(request, features=features)

    def _use(self, memory: AutoMemory) -> None:
        self.memory = memory
        self.controllers = memory.controllers

    @property
    def t_verify(self) -> dict[int, float]:
        """Verify size T -> seconds of a round besides drafting (the store's)."""
        return self.costs.round

    def _remember(self, request: DraftRequest) -> None:
        """First round: continue from what earlier requests with these drafters and this sampling setting measured."""
        p = request.params
        key = (tuple(self.drafters), self.k_min, self.k_max, p.temperature, p.top_k, p.top_p)
        self._use(self._memories.setdefault(key, self.memory))
        self._memories = None

    def controller(self, name: str, match: int | None = None) -> DraftLengthController:
        key = (name, match)
        if key not in self.controllers:
            self.controllers[key] = DraftLengthController(self.k_min, self.k_max, name=name)
        ctl = self.controllers[key]
        ctl.costs = self.costs  # a controller kept from an earlier request reads today's store
        return ctl

    def _catch_up_seconds(self, name: str, drafter, request: DraftRequest, step: float) -> tuple[float, bool]:
        """Seconds this drafter would spend catching up before its next draft, and whether that is a long stretch."""
        lag = drafter.lag(request.context)
        return self.costs.catch_up_s(name, lag, PRIOR_CATCH_UP * step), lag > LONG_CATCH_UP

    @staticmethod
    def _spread(seconds: float, long: bool, request: DraftRequest, ctl: DraftLengthController, K: int) -> float:
        """A catch-up's share of this round: a short one in full, a long one (a one-off) over the rounds left."""
        if not long:
            return seconds
        left = max(request.capacity - len(request.context) - request.num_tokens - 1, 1)  # new tokens still to come
        return seconds / max(left / expected_tokens(ctl.rates()[:K]), 1.0)

    @staticmethod
    def _cheap_value(ctl: DraftLengthController, K: int, match: int | None, step: float | None) -> float:
        """Expected tokens/s of a cheap draft of K tokens from a match of length ``match``.

        With a record at this match length: the record. A long match never tried: the controller's prior
        acceptance, so it is tried when that beats what the draft model has been delivering (next to a
        draft model that is rarely wrong, a failed try costs a round of ~K tokens). In the first round
        nothing is measured: a long match is tried (drafting it was free). A short match without a record
        is valued below a draft model without one (0), so it is taken only when nothing else can draft."""
        short = match is not None and match < TRY_MIN_MATCH
        if step is None:
            return -1.0 if short else float("inf")
        if ctl.rounds == 0 and short:
            return -1.0
        return ctl.tokens_per_second(K)

    def no_spec_value(self) -> float | None:
        """Expected tokens/s of a plain target step, ``1 / t_verify(1)``; None when it is no option (disabled,
        or no verify measured yet)."""
        if not self.allow_no_spec or not self.t_verify:
            return None
        seconds = interpolate(self.t_verify, 1)
        return 1.0 / seconds if seconds > 0 else None

    def _plain_wins(self, value: float, ctl: DraftLengthController, catch_up: float, margin: float) -> bool:
        """Is this round a plain step? The best drafter (``value`` tokens/s, controller ``ctl``, ``catch_up``
        seconds to spend before it drafts) is beaten by no speculation and no retry is due. A retry must be cheap:
        never one whose catch-up costs more than RETRY_MAX_CATCH_UP target steps (a draft model reading a long
        prompt it skipped can cost as much as the whole generation saves). Keeps the back-off count."""
        plain = self.no_spec_value()
        if plain is None or ctl.rounds == 0:  # nothing to compare, or a drafter never measured: it drafts
            return False
        if value >= margin * plain:  # a drafter wins: the back-off starts over
            self.plain_rounds, self.retry_after, self.plain_phase = 0, NO_SPEC_RETRY, False
            return False
        self.plain_phase = True
        if self.plain_rounds < self.retry_after or catch_up > RETRY_MAX_CATCH_UP * interpolate(self.t_verify, 1):
            self.plain_rounds += 1
            return True
        self.plain_rounds, self.retry_after = 0, min(2 * self.retry_after, NO_SPEC_RETRY_MAX)  # retry: it drafts
        return False

    def _known(self, name: str) -> Realized | None:
        """What expensive drafter ``name``'s recent rounds delivered, None while that record is short."""
        done = self.memory.realized.get(name)
        return done if done is not None and done.known else None

    def _plain_step(self, request: DraftRequest) -> Draft:
        """An empty draft [1, 0]: the engine runs one target step, which it times as t_verify(1)."""
        self._round = (None, None, 0, None)
        return Draft(torch.empty(1, 0, dtype=torch.long, device=request.device))

    def _seeded(self, request: DraftRequest) -> Draft:
        """A seeded sample's round: its one delegate drafts the request's K (module docstring)."""
        name, d = next(((n, d) for n, d in self.drafters.items() if not d.cheap), next(iter(self.drafters.items())))
        draft = d.propose(self._for(d, request))
        if not draft.tokens.shape[1]:  # a lookup that found nothing
            return self._plain_step(request)
        if not d.cheap:
            self.catch_up = d.catch_up
        self._round = (d, self.controller(name, d.last_match if d.cheap else None), draft.tokens.shape[1],
                       None if d.cheap else name)
        return replace(draft, source=name)

    def propose(self, request: DraftRequest) -> Draft:
        self.catch_up = (0, 0.0)
        if request.costs is not None:
            self.costs = request.costs
        if self._memories is not None:
            self._remember(request)
        if not request.params.greedy and request.params.seed is not None:
            return self._seeded(request)
        step = self.costs.step_s()  # ~ one target step
        # (expected tokens/s, name, drafter, controller, K, draft or None, seconds to spend catching up first
        # (expensive; 0 for a cheap draft, made already))
        options = []
        for name, d in self.drafters.items():
            if d.cheap:  # propose now, value the draft it really has
                draft = d.propose(self._for(d, request))
                if draft.tokens.shape[1]:
                    ctl = self.controller(name, d.last_match)
                    K = ctl.choose(draft.tokens.shape[1])
                    draft = replace(draft, tokens=draft.tokens[:, :K],
                                    draft_probs=None if draft.draft_probs is None else draft.draft_probs[:, :K])
                    value = self._cheap_value(ctl, K, d.last_match, step)
                    options.append((value, name, d, ctl, K, draft, 0.0))
            else:  # value it at the K it would choose; it proposes only if chosen
                ctl = self.controller(name)
                K = ctl.choose(request.num_tokens)
                prior = None if step is None else PRIOR_C * step
                catch_up, long = self._catch_up_seconds(name, d, request, step) if step else (0.0, False)
                extra = self._spread(catch_up, long, request, ctl, K)
                value = ctl.tokens_per_second(K, t_draft=prior, extra_s=extra) if step else 0.0
                done = self._known(name)
                if done is not None:  # what its rounds delivered, not the model
                    value = done.tokens_per_second(extra if long else 0.0)  # a short catch-up is in its rounds
                options.append((value, name, d, ctl, K, None, catch_up))
        if not options:  # only cheap drafters and none found anything: a plain target step
            return self._plain_step(request)
        # an expensive drafter whose record is still short is not outvalued by another expensive one with a record
        # (one whose record grew old only if it catches up cheaply: not after sitting out a long stretch)
        untried = [o for o in options if o[5] is None and self._known(o[1]) is None
                   and (o[1] not in self.memory.realized or not step or o[6] <= RETRY_MAX_CATCH_UP * step)]
        pool = [o for o in options if o[5] is not None] + untried if untried else options
        best = max(pool, key=lambda o: o[0])  # the first on ties
        value, name, d, ctl, K, draft, spent = best
        exploring = any(o is best for o in untried)
        done = self.memory.realized.get(name)
        if exploring and self.plain_phase and done is not None and done.count >= EXPLORE_ROUNDS:
            # a record gone stale while plain steps win: its revisit is their retry, and waits for the back-off
            if self.plain_rounds < self.retry_after:
                self.plain_rounds += 1
                return self._plain_step(request)
        if exploring and self.plain_rounds:  # it drafts in the middle of plain rounds: that was their retry
            self.plain_rounds, self.retry_after = 0, min(2 * self.retry_after, NO_SPEC_RETRY_MAX)
        # valued by what it delivered, or by the model of its acceptance (a cheap draft, a record gone stale)
        margin = REALIZED_MARGIN if draft is None and self._known(name) is not None else SPEC_MARGIN
        if not exploring and self._plain_wins(value, ctl, spent, margin):
            return self._plain_step(request)
        if draft is None:  # a drafter that ends its rounds itself (early_stop) gets the largest K as its cap
            cap = request.num_tokens if d.early_stop else K
            draft = d.propose(self._for(d, replace(request, num_tokens=cap)))
            self.catch_up = d.catch_up  # the engine keeps it out of the draft cost, and learns it for ``name``
        self._round = (d, ctl, draft.tokens.shape[1], None if d.cheap else name)
        return replace(draft, source=name)

    def update(self, num_accepted: int) -> None:
        if self._round is None:
            return
        d, ctl, K, expensive = self._round
        for name, done in self.memory.realized.items():  # what the drafters that sat this round out did grows older
            if name != expensive:
                done.fade()
        if d is None:  # a plain step: nothing drafted, nothing else to learn (the engine timed it)
            return
        ctl.observe(K, num_accepted)
        d.update(num_accepted)
        if expensive is not None and self.t_verify:
            fed, caught_up_s = self.catch_up
            seconds = (K * (self.costs.draft.get(expensive) or 0.0) + interpolate(self.t_verify, K + 1)
                       + (caught_up_s if fed <= LONG_CATCH_UP else 0.0))  # a prompt's catch-up is valued apart
            self.memory.realized.setdefault(expensive, Realized()).observe(num_accepted + 1, seconds)
