"""Sampling in a batch: the engine (engine/engine.py) draws every request's tokens from exactly the target's
distribution, whoever shares its steps (house rule: a chi-square test against exact probabilities, and a negative
control that must fail).

The machinery is test_speculative_distribution.py's, run through one ``Engine`` with many requests at a time: a
16-token vocabulary, networks replaced by exact lookup tables of transformers' logits (``TableModel``, here keyed
by the whole context, so that prompts of different lengths share a batch), and the joint law of the first three
generated tokens enumerated exactly. Waves of requests queue back to back, 8 running at a time: speculative ones
(the real ``DraftModelDrafter`` with an unrelated draft, so rejections and recovered tokens are common), plain
sampling ones and a greedy one, on prompts of 3, 8 and 13 tokens (1 to 4 prefill chunks of 4, identical prompts
sharing prefix blocks), under a budget of 16 tokens a step that cuts some rows' drafts: every forward mixes ragged
prefill chunks, verify rows and plain rows. The speculative requests' first three tokens are counted per prompt and
all cells (prompt, a, b, c) tested together against the exact law; the plain neighbours likewise.

Two ways to get K: a seeded request drafts its full K (engine.add fixes it; the budget may still cut it), an
unseeded one gets K from the cost model (speculation.py) every step: 0, 1 or 2, depending on its neighbours.
The cost model decides from measured seconds, so those runs read a scripted clock (``ScriptedClock``) in place of
the engine's and the drafter's ``time``: every decision, and so every draw, is the same from run to run (the
draws come from each request's generator, seeded after ``add``). Where K = 1 the third token is a bonus token, so
the cost-model runs also see bonus tokens, which the seeded ones (K = 2) never do within three tokens.
"""

from __future__ import annotations

import dataclasses
import itertools
import types
from collections import Counter

import numpy as np
import pytest
import torch

import verispec.drafters.draft_model
import verispec.engine.engine
import test_speculative_distribution as base
from exact_helpers import ALPHA, chi2_pvalue, variant_verify
from verispec import LLM, SamplingParams
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.engine import Engine
from verispec.sampling import logits_to_probs

V = base.V
PROMPTS = [[7, 7, 2], base.PROMPT, [5, 0, 12, 9, 9, 3, 14, 1, 6, 2, 11, 4, 8]]  # 1, 2 and 4 prefill chunks of 4
DEPTH = 3  # tables hold the logits after every prompt + every history of up to 3 generated tokens
K = 2  # max_new_tokens = K + 2: a first verify round drafts up to K, a second one follows a rejection
SPEC, PLAIN, GREEDY = "spec", "plain", "greedy"
WAVE = [(SPEC, 0), (PLAIN, 1), (SPEC, 2), (SPEC, 1), (GREEDY, 2), (SPEC, 0), (PLAIN, 0), (SPEC, 2), (SPEC, 1)]
# (kind, prompt index) of a wave's requests, in arrival order
WAVES = 500  # per positive case: 3,000 speculative draws (and 1,000 plain ones)
FORWARD_S, ROW_S = 4e-2, 5e-4  # the scripted cost of a target forward: seconds, and seconds more a row
WAVES_NEG = 300  # per negative control: fewer draws make rejection harder, so this is conservative

CASES = {  # name: (seeded, SamplingParams fields); the draft is always the unrelated "other"
    "seeded-T1": (True, dict(temperature=1.0)),
    "seeded-T0.7-top_k5": (True, dict(temperature=0.7, top_k=5)),
    "cost_model-T1": (False, dict(temperature=1.0)),
    "cost_model-top_p0.8": (False, dict(temperature=1.0, top_p=0.8)),
}
ACCEPTANCE = {  # sanity bounds on the measured acceptance rate: the cases are what they claim to be
    "seeded-T1": (0.3, 0.6),
    "seeded-T0.7-top_k5": (0.04, 0.2),
    "cost_model-T1": (0.3, 0.65),
    "cost_model-top_p0.8": (0.15, 0.5),
}
NEGATIVE = [  # (case, broken verifier): each must be rejected
    ("cost_model-top_p0.8", "always_accept"),
    ("seeded-T0.7-top_k5", "recover_from_p"),
    ("cost_model-top_p0.8", "bonus_from_p_K"),  # a bonus token is among the first three only after a K = 1 round
]
model_dirs = base.model_dirs  # the same tiny target and drafts (only "other" drafts here)


class TableModel:
    """Stands in for a ``Transformer`` (contiguous and paged calls), as test_speculative_distribution.TableModel
    does, with logits looked up by the whole context the cache holds (any of PROMPTS, then generated tokens).
    Token ids are written where a network's keys go, so rollback, block tables and shared prefix blocks are all
    exercised: a wrong slot gives a wrong history and so wrong logits (or a KeyError)."""

    def __init__(self, real, table: dict):
        self.config, self.embed_tokens, self.dtype = real.config, real.embed_tokens, real.dtype
        self.table = table

    def __call__(self, input_ids, positions, cache, mask=None, num_logits=None, hidden_layers=()):
        B, T = input_ids.shape
        start = cache.reserve(T)
        assert B == 1 and mask is None and not hidden_layers
        assert positions.tolist() == [list(range(start, start + T))], "wrong RoPE positions"
        slots = cache.k[0, 0, 0, :, 0]  # [capacity]: each slot's token id
        slots[start:start + T] = input_ids[0].to(slots.dtype)
        held = tuple(slots[:start + T].long().tolist())
        cache.advance(T)
        n = T if num_logits is None else num_logits
        return torch.stack([self.table[held[:end]] for end in range(start + T - n + 1, start + T + 1)])[None], {}

    def forward_paged(self, input_ids, batch, cache, logit_rows=None, hidden_layers=()):
        assert not hidden_layers
        blocks, offsets = batch.slots(cache.block_size)
        cache.k[0, blocks, 0, offsets, 0] = input_ids.to(cache.k.dtype)
        held_by_slot = cache.k[0, :, 0, :, 0].long().tolist()  # [num_blocks][block_size]: each slot's token id
        wanted = set(range(batch.num_rows) if logit_rows is None else logit_rows.tolist())
        rows = []
        for (first, n, start), (_, _, table) in zip(batch.seqs.tolist(), batch.chunks):
            held = tuple(held_by_slot[table[i // cache.block_size]][i % cache.block_size] for i in range(start + n))
            rows += [self.table[held[:start + r + 1]] for r in range(n) if first + r in wanted]
        return (torch.stack(rows) if rows else torch.empty(0, self.config.vocab_size)), {}  # [rows wanted, V]


def exact_joint(table, prompt, params: SamplingParams) -> np.ndarray:
    """[V, V, V]: P(first three generated tokens | prompt) under autoregressive sampling from the target."""
    P = tuple(prompt)
    rows = lambda hs: logits_to_probs(torch.stack([table[P + h] for h in hs]).double(), params)  # noqa: E731
    p1, p2 = rows([()])[0], rows([(a,) for a in range(V)])
    p3 = rows(list(itertools.product(range(V), repeat=2))).reshape(V, V, V)
    joint = (p1[:, None, None] * p2[:, :, None] * p3).numpy()
    return joint / joint.sum()


@pytest.fixture(scope="module")
def tables(model_dirs):
    """transformers' logits after every prompt + h, h of up to DEPTH tokens: {name: {prompt + h: [V]}}."""
    import transformers

    out = {}
    for name in ("target", "other"):
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(model_dirs[name]), dtype=torch.float32).eval()
        table = {}
        with torch.no_grad():
            for prompt in PROMPTS:
                for d in range(DEPTH + 1):
                    ctxs = [tuple(prompt) + h for h in itertools.product(range(V), repeat=d)]
                    table.update(zip(ctxs, hf(torch.tensor(ctxs)).logits[:, -1]))
        out[name] = table
    return out


@pytest.fixture(scope="module")
def models(model_dirs, tables):
    """The target and the draft as table models (with the real target's config and embeddings)."""
    llm = LLM(target=str(model_dirs["target"]), dtype="float32")
    return types.SimpleNamespace(target=TableModel(llm.target.model, tables["target"]),
                                 draft=TableModel(llm.target.model, tables["other"]), logit_mask=llm.logit_mask)


class ScriptedClock:
    """Stands in for the ``time`` module: each perf_counter() call moves on by a seeded pseudo-random step (mean
    ``step`` seconds; 0: a stopped clock), so the cost model meets varied but reproducible costs."""

    def __init__(self, seed: int, step: float):
        self.rng, self.step, self.now = np.random.default_rng(seed), step, 0.0

    def perf_counter(self) -> float:
        self.now += float(self.rng.exponential(self.step)) if self.step else 0.0
        return self.now


def script_the_clocks(monkeypatch, models):
    """The engine's clock ticks at random, and a target forward moves it on by a seeded random cost of mean
    FORWARD_S + ROW_S a row (a step dearer than a draft, a row cheap: drafts sometimes pay); the drafter's clock
    stands still (so its draft steps and catch-ups cost nothing of their own and the engine's measure of a draft is
    a tick or two). The cost model then drafts in some steps and not in others, with K = 1 and K = 2: ~60% of them
    with these seeds. Costs this noisy (exponential: as spread as they are large) often talk it out of drafting in
    requests of 3 tokens, too short for a retry: of seeds 0-7 for ``rng``, 1-3 give a mix, the rest < 7% drafted
    steps (the test's check on the mix fails those)."""
    clock, rng = ScriptedClock(1, 1e-4), np.random.default_rng(7)
    monkeypatch.setattr(verispec.engine.engine, "time", clock)
    monkeypatch.setattr(verispec.drafters.draft_model, "time", ScriptedClock(0, 0.0))
    forward = models.target.forward_paged

    def timed(input_ids, *args, **kwargs):
        clock.now += float(rng.exponential(FORWARD_S + ROW_S * len(input_ids)))
        return forward(input_ids, *args, **kwargs)

    monkeypatch.setattr(models.target, "forward_paged", timed)


class CountingDrafter(DraftModelDrafter):
    """The real draft-model drafter (no early stop), keeping the K of each round it is asked for."""

    def __init__(self, model, rounds: list):
        super().__init__(model, early_stop=False)
        self.rounds = rounds

    def propose(self, request):
        self.rounds.append(request.num_tokens)
        return super().propose(request)


@dataclasses.dataclass
class Outcome:
    counts: dict  # kind -> [len(PROMPTS), V, V, V]: the first three tokens, per prompt
    rounds: list = dataclasses.field(default_factory=list)  # K of every draft round
    drafted: int = 0
    accepted: int = 0
    plain_steps: int = 0  # speculative requests' decode steps without a draft

    @property
    def acceptance(self) -> float:
        return self.accepted / max(self.drafted, 1)


def run_waves(models, n_waves: int, params: SamplingParams, seeded: bool, first_seed: int = 0) -> Outcome:
    """``n_waves`` waves of WAVE's requests through one engine, the next wave queued while the last runs. Every
    sampling request has its own seed: in its params if ``seeded`` (so its K is fixed), else given to its
    generator after ``add`` (K from the cost model)."""
    engine = Engine(models.target, num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=16,
                    chunk_size=4, logit_mask=models.logit_mask)
    out = Outcome({kind: np.zeros((len(PROMPTS), V, V, V), np.int64) for kind in (SPEC, PLAIN)})
    seeds, live, waves = itertools.count(first_seed), [], 0
    while waves < n_waves or engine.has_work:
        if waves < n_waves and engine.scheduler.num_waiting < len(WAVE):
            for kind, i in WAVE:
                seed = next(seeds)
                p = dataclasses.replace(params, max_new_tokens=K + 2, ignore_eos=True, seed=seed if seeded else None)
                if kind == GREEDY:
                    p = SamplingParams(max_new_tokens=K + 2, ignore_eos=True)
                drafter = CountingDrafter(models.draft, out.rounds) if kind == SPEC else None
                req = engine.add(PROMPTS[i], p, drafter, K if kind == SPEC else 0)
                if kind != GREEDY and not seeded:
                    req.generator.manual_seed(seed)
                live.append((req, kind, i))
            waves += 1
        engine.step()
        for req, kind, i in (x for x in live if x[0].finished):
            assert req.finish_reason == "length" and len(req.output_ids) == K + 2
            if kind != GREEDY:
                out.counts[kind][(i, *req.output_ids[:3])] += 1
            if kind == SPEC:
                out.drafted += req.drafted
                out.accepted += req.accepted
        live = [x for x in live if not x[0].finished]
    assert engine.blocks.num_free == engine.blocks.num_blocks  # nothing leaks
    n_spec = sum(kind == SPEC for kind, _ in WAVE) * n_waves
    out.plain_steps = n_spec * (K + 1) - out.accepted - len(out.rounds)  # K + 1 tokens after the prefill's one
    return out


def pvalue(tables, counts: np.ndarray, params: SamplingParams) -> float:
    """Chi-square of counts [len(PROMPTS), V, V, V] against each prompt's exact joint law, all cells at once."""
    want = np.stack([n * exact_joint(tables["target"], prompt, params)
                     for n, prompt in zip(counts.sum((1, 2, 3)), PROMPTS)])
    return chi2_pvalue(counts, want)


def draw(models, monkeypatch, name: str, n_waves: int) -> tuple[Outcome, SamplingParams]:
    seeded, kw = CASES[name]
    if not seeded:
        script_the_clocks(monkeypatch, models)
    params = SamplingParams(**kw)
    return run_waves(models, n_waves, params, seeded), params


def test_cases_are_nontrivial(tables):
    """The filters cut something, and no top-p boundary of the target rows that decide the first three tokens lies
    within float noise (so float32 rounding in the engine cannot flip a kept set)."""
    for prompt in PROMPTS:
        assert (exact_joint(tables["target"], prompt, SamplingParams(temperature=1.0)) > 0).all()
        for name in ("seeded-T0.7-top_k5", "cost_model-top_p0.8"):
            support = (exact_joint(tables["target"], prompt, SamplingParams(**CASES[name][1])) > 0).sum()
            assert support < V ** 3 / 4, (prompt, name)
    rows = torch.stack([r for ctx, r in tables["target"].items()
                        if any(ctx[:len(p)] == tuple(p) and len(ctx) - len(p) < DEPTH for p in PROMPTS)])
    rows = rows.double().softmax(-1).sort(-1, descending=True).values
    assert (rows.cumsum(-1) - 0.8).abs().min() > 1e-5


@pytest.mark.parametrize("name", list(CASES))
def test_batched_sampling_matches_exact_distribution(models, tables, monkeypatch, name):
    out, params = draw(models, monkeypatch, name, WAVES)
    lo, hi = ACCEPTANCE[name]
    assert lo < out.acceptance < hi, f"{name}: acceptance rate {out.acceptance:.3f} outside ({lo}, {hi})"
    ks = Counter(out.rounds)
    assert ks[1] > 0.05 * len(out.rounds) and ks[2] > 0.05 * len(out.rounds), ks  # rounds of both lengths
    if not CASES[name][0]:  # the cost model left some steps without drafts, and drafted in others
        assert 0.1 < len(out.rounds) / (len(out.rounds) + out.plain_steps) < 0.9, (ks, out.plain_steps)
    p = pvalue(tables, out.counts[SPEC], params)
    p_plain = pvalue(tables, out.counts[PLAIN], params)
    assert p > ALPHA, f"{name}: chi-square p = {p:.3g} (acceptance {out.acceptance:.3f}, K {ks})"
    assert p_plain > ALPHA, f"{name}: plain neighbours' chi-square p = {p_plain:.3g}"


@pytest.mark.parametrize("name,bug", NEGATIVE)
def test_negative_control_broken_verifier_fails(models, tables, monkeypatch, name, bug):
    """The same test, with a deliberately wrong verifier inside the engine, must reject it."""
    monkeypatch.setattr(verispec.engine.engine, "verify", variant_verify(bug))
    out, params = draw(models, monkeypatch, name, WAVES_NEG)
    p = pvalue(tables, out.counts[SPEC], params)
    assert p < ALPHA, f"negative control {name}/{bug} not detected: p = {p:.3g}"


def test_copied_verifier_passes(models, tables, monkeypatch):
    """Control for the controls: the unbroken copy of the rule, patched in the same way, passes."""
    monkeypatch.setattr(verispec.engine.engine, "verify", variant_verify(None))
    out, params = draw(models, monkeypatch, "seeded-T0.7-top_k5", WAVES_NEG)
    p = pvalue(tables, out.counts[SPEC], params)
    assert p > ALPHA, f"p = {p:.3g}"


def run_alone_and_together(models, jobs, budget: int) -> tuple[list, list, list]:
    """jobs: (prompt index, params, speculative?) -> (each request's tokens alone, in one batch, its drafted count in
    the batch). An unseeded sampling request's generator gets a fixed seed after ``add`` (K from the cost model)."""

    def run(batch):
        engine = Engine(models.target, num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=budget,
                        chunk_size=4, logit_mask=models.logit_mask)
        reqs = []
        for n, (i, params, spec) in enumerate(batch):
            drafter = DraftModelDrafter(models.draft, early_stop=False) if spec else None
            reqs.append(engine.add(PROMPTS[i], params, drafter, K if spec else 0))
            if not params.greedy and params.seed is None:
                reqs[-1].generator.manual_seed(1000 + n)
        while engine.has_work:
            engine.step()
        assert all(r.finish_reason == "length" for r in reqs)
        return reqs

    together = run(jobs)
    return [run([job])[0].output_ids for job in jobs], [r.output_ids for r in together], [r.drafted for r in together]


def mixed_jobs(first_seed: int) -> list:
    """Seeded sampling requests (speculative and plain, with and without top-k / top-p) among greedy and unseeded
    ones (the cost model's K), on all prompts: (prompt index, params, speculative?)."""
    new = dict(max_new_tokens=K + 2, ignore_eos=True)
    seeded = [dict(temperature=0.7, top_k=5), dict(temperature=1.0, top_p=0.8), dict(temperature=1.0),
              dict(temperature=0.9, top_k=8, top_p=0.9)]
    jobs = [(j % 3, SamplingParams(seed=first_seed + j, **kw, **new), j < 3) for j, kw in enumerate(seeded)]
    jobs += [(0, SamplingParams(**new), True), (1, SamplingParams(temperature=1.0, **new), True),
             (2, SamplingParams(**new), False), (1, SamplingParams(temperature=0.7, top_k=5, **new), False)]
    return jobs


def test_a_seeded_request_samples_the_same_alone_and_among_greedy_and_unseeded_ones(models):
    """Complements test_engine_batch.py (batches of one kind, plain temperature): top-k / top-p, mixed neighbours.
    The budget (64 tokens a step) never cuts a draft here, so every seeded request drafts its full K."""
    seen = []
    for first_seed in (0, 100, 200):
        jobs = mixed_jobs(first_seed)
        alone, together, drafted = run_alone_and_together(models, jobs, budget=64)
        for job, a, t, d in zip(jobs, alone, together, drafted):
            if job[1].seed is not None:
                assert t == a, (job, a, t)
                seen.append(tuple(a))
                assert d >= K or not job[2]  # the speculative ones drafted
    assert len(set(seen)) > len(seen) // 2  # varied samples: the identity means something


def test_a_seeded_request_samples_the_same_alone_and_in_a_batch_under_a_tight_budget(models):
    """8 seeded speculative requests under budgets of 8 to 12 tokens a step (8 rows, 0 to 4 drafts): a row late in
    arrival order would get fewer than its K drafts in the batch if the scheduler cut them; it waits a step instead."""
    new = dict(max_new_tokens=K + 2, ignore_eos=True)
    differ = []
    for budget, first_seed in itertools.product(range(8, 13), (0, 100, 200)):
        jobs = [(j % 3, SamplingParams(temperature=0.7, top_k=5, seed=first_seed + j, **new), True) for j in range(8)]
        alone, together, drafted = run_alone_and_together(models, jobs, budget)
        differ += [(budget, job[1].seed, a, t, d) for job, a, t, d in zip(jobs, alone, together, drafted) if a != t]
    assert not differ, differ
