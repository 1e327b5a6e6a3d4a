"""Speculative sampling draws from exactly the target's distribution (house rule: every sampling path
has a chi-square test against exact probabilities, and a negative control that must fail).

As in test_ar_distribution.py: tiny models with a 16-token vocabulary, a fixed prompt, and the joint
law of the first three generated tokens enumerated exactly (16**3 cells):
P(a, b, c) = p(a | prompt) p(b | prompt a) p(c | prompt a b), from transformers' logits through
``logits_to_probs``. Samples come from the public API, ``LLM.generate(..., method="draft",
num_draft_tokens=K)`` with ``max_new_tokens = K + 2``, so the first round drafts all K tokens and the
three tokens observed come from the prefill, the first round's verification (accepted drafts and the
recovered token; with K = 1 the bonus token too) and, after an early rejection, a second round whose
draft model first catches up on the committed tokens.

Speed: one call with the real tiny networks costs ~2 ms (several forwards of ~0.2 ms of Python
overhead each), too slow for 10k draws per case on a shared 2-core machine. The draws therefore run
with both networks replaced by exact lookup tables of transformers' logits (``TableModel``): the
decoding loop, the target KV cache's length bookkeeping (truncate after a rejection), the real
``DraftModelDrafter`` (its own cache, catch-up and rollback), ``verify`` and the generator handling
are all the real code; only the matrix multiplications are skipped. The table answers from the token
history that the KV cache really holds (slots [0, cache.length)), so a wrong rollback returns wrong
logits, exactly as a real network would. ``test_table_runs_equal_real_network_runs`` checks that the
real networks make the very same draws, seed for seed, so the statistics carry over to them.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
import torch

import verispec.engine.engine
from exact_helpers import ALPHA, chi2_pvalue, naive_probs, use_fused_quantized_draft, variant_verify, varied_stop
from tiny import make_hf_model
from verispec import LLM, SamplingParams
from verispec.draft_vocab import save_table
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.sampling import logits_to_probs

V = 16
N = 10_000  # draws per positive case: twice the negative controls' (which fail with 5,000)
N_NEG = 5_000  # draws per negative control: fewer draws make rejection harder, so this is conservative
N_SAME = 150  # seeds on which the real networks must reproduce the table-backed draws exactly
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
DEPTH = 3  # the tables hold the logits after prompt + every history of up to 3 generated tokens
TINY = dict(vocab_size=V, eos_token_id=None, num_hidden_layers=1, hidden_size=32, intermediate_size=64,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)

# name: (draft, K, SamplingParams fields)
CASES = {
    "T1-K2": ("other", 2, dict(temperature=1.0)),
    "T0.7-top_k5-K1": ("near", 1, dict(temperature=0.7, top_k=5)),
    "top_p0.8-K2": ("near", 2, dict(temperature=1.0, top_p=0.8)),
    "far_draft-T1-K2": ("far", 2, dict(temperature=1.0)),
}
ACCEPTANCE = {  # sanity bounds on the measured acceptance rate: the cases are what they claim to be
    "T1-K2": (0.35, 0.75),
    "T0.7-top_k5-K1": (0.6, 0.98),
    "top_p0.8-K2": (0.6, 0.98),
    "far_draft-T1-K2": (0.03, 0.3),
}
NEGATIVE = [  # (case, broken verifier): each must be rejected
    ("T1-K2", "always_accept"),
    ("far_draft-T1-K2", "recover_from_p"),
    ("T0.7-top_k5-K1", "bonus_from_p_K"),
]


def _save(model, path):
    model.save_pretrained(str(path), safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """The target (as in test_ar_distribution.py) and three drafts of decreasing quality."""
    root = tmp_path_factory.mktemp("spec16")
    dirs = {"target": _save(make_hf_model("qwen2", 1, **TINY), root / "target")}
    near = make_hf_model("qwen2", 1, **TINY)  # the target's weights plus noise: high acceptance
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in near.parameters():
            if p.dim() == 2:
                p.add_(0.03 * torch.randn(p.shape, generator=g))
    dirs["near"] = _save(near, root / "near")
    dirs["other"] = _save(make_hf_model("llama", 2, **TINY), root / "other")  # unrelated, another architecture
    far = make_hf_model("llama", 2, **TINY)
    with torch.no_grad():
        far.lm_head.weight.mul_(5.0)  # over-confident: q piles onto tokens the target rarely picks
    dirs["far"] = _save(far, root / "far")
    return dirs


@pytest.fixture(scope="module")
def tables(model_dirs):
    """transformers' logits after prompt + h for every history h of up to DEPTH tokens: {name: {h: [V]}}."""
    import transformers

    out = {}
    for name, path in model_dirs.items():
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        table = {}
        with torch.no_grad():
            for d in range(DEPTH + 1):
                hists = list(itertools.product(range(V), repeat=d))
                logits = hf(torch.tensor([PROMPT + list(h) for h in hists])).logits[:, -1]
                table.update(zip(hists, logits))
        out[name] = table
    return out


class TableModel:
    """Stands in for a ``Transformer``: same calls (contiguous and paged), logits looked up by the tokens the cache
    holds.

    Each call writes its tokens at cache slots [length, length + T) (into the cache's key tensor, where a
    network's keys go, so a kept draft cache handed to the next request carries them), advances the cache
    and returns the logits of the last ``num_logits``
    positions given everything in slots [0, position]. A history outside the table (deeper than
    DEPTH, or not starting with the prompt) raises: the runs below never need one.
    """

    def __init__(self, real, table: dict):
        self.config, self.embed_tokens, self.dtype = real.config, real.embed_tokens, real.dtype
        self.table = table

    def __call__(self, input_ids, positions, cache, mask=None, num_logits=None, hidden_layers=()):
        B, T = input_ids.shape
        start = cache.reserve(T)
        assert B == 1 and mask is None and not hidden_layers
        assert positions.tolist() == [list(range(start, start + T))], "wrong RoPE positions"
        slots = cache.k[0, 0, 0, :, 0]  # [capacity]: each slot's token id, kept where a network keeps its keys
        slots[start:start + T] = input_ids[0].to(slots.dtype)  # (so a cache copied or handed on carries them)
        held = slots[:start + T].long().tolist()
        cache.advance(T)
        n = T if num_logits is None else num_logits
        rows = []
        for end in range(start + T - n + 1, start + T + 1):
            assert held[: len(PROMPT)] == PROMPT and end >= len(PROMPT), "not a prediction after the prompt"
            rows.append(self.table[tuple(held[len(PROMPT):end])])
        return torch.stack(rows)[None], {}

    def forward_paged(self, input_ids, batch, cache, logit_rows=None, hidden_layers=()):
        """The engine's batched call on a paged cache: each row's token id goes to its slot, and a row that needs
        logits looks them up by the tokens its sequence holds up to it."""
        assert not hidden_layers
        blocks, offsets = batch.slots(cache.block_size)
        cache.k[0, blocks, 0, offsets, 0] = input_ids.to(cache.k.dtype)
        wanted = range(batch.num_rows) if logit_rows is None else logit_rows.tolist()
        rows = []
        for (first, n, start), (_, _, table) in zip(batch.seqs.tolist(), batch.chunks):
            pos = torch.arange(start + n)
            held = cache.k[0, torch.tensor(table)[pos // cache.block_size], 0, pos % cache.block_size, 0]
            held = held.long().tolist()
            for r in range(n):
                if first + r in wanted:
                    assert held[: len(PROMPT)] == PROMPT and start + r + 1 >= len(PROMPT), "not after the prompt"
                    rows.append(self.table[tuple(held[len(PROMPT):start + r + 1])])
        return torch.stack(rows), {}


def make_llm(model_dirs, draft: str, tables=None) -> LLM:
    llm = LLM(target=str(model_dirs["target"]), draft=str(model_dirs[draft]), dtype="float32", draft_quant="none")
    if tables is not None:
        llm.target.model = TableModel(llm.target.model, tables["target"])
        llm.draft.model = TableModel(llm.draft.model, tables[draft])
    return llm


@pytest.fixture(scope="module")
def table_llms(model_dirs, tables):
    return {d: make_llm(model_dirs, d, tables) for d in ("near", "other", "far")}


def exact_joint(tables, params: SamplingParams) -> np.ndarray:
    """[V, V, V]: P(first three generated tokens) under autoregressive sampling from the target."""
    t = tables["target"]
    p1 = logits_to_probs(t[()].double(), params)  # [V]
    p2 = logits_to_probs(torch.stack([t[(a,)] for a in range(V)]).double(), params)  # [V, V]
    p3 = logits_to_probs(torch.stack([t[h] for h in itertools.product(range(V), repeat=2)]).double(), params)
    joint = (p1[:, None, None] * p2[:, :, None] * p3.reshape(V, V, V)).numpy()
    return joint / joint.sum()


def draw(llm, K: int, params: SamplingParams, n: int, first_seed: int = 0, rounds: list | None = None):
    """n generations -> (counts of the first three tokens [V, V, V], acceptance rate over all of them);
    ``rounds`` collects (rounds with drafts, drafted tokens) per generation."""
    counts = np.zeros((V, V, V), dtype=np.int64)
    accepted = drafted = 0
    for seed in range(first_seed, first_seed + n):
        out = llm.generate(PROMPT, dataclasses.replace(params, max_new_tokens=K + 2, seed=seed),
                           method="draft", num_draft_tokens=K)
        a, b, c = out.token_ids[:3]
        counts[a, b, c] += 1
        accepted += out.stats["accepted_tokens"]
        drafted += out.stats["drafted_tokens"]
        if rounds is not None:
            rounds.append((out.stats["per_position_reached"][0], out.stats["drafted_tokens"]))
    return counts, accepted / drafted


def test_tables_match_our_runtime(model_dirs, tables):
    """The tables are the models: our runtime's logits (real networks, KV cache) agree with them."""
    from verispec.models.kv_cache import KVCache

    rng = np.random.default_rng(0)
    for name in model_dirs:
        llm = LLM(target=str(model_dirs[name]), dtype="float32")
        for d in range(DEPTH + 1):
            h = tuple(int(t) for t in rng.integers(0, V, d))
            cache = KVCache.for_model(llm.target.config, 1, len(PROMPT) + d, torch.float32)
            ids = PROMPT + list(h)
            logits = llm.target.model(torch.tensor([ids]), torch.arange(len(ids))[None], cache, num_logits=1)[0][0, -1]
            torch.testing.assert_close(logits, tables[name][h], rtol=1e-4, atol=1e-4)


def test_cases_are_nontrivial(tables):
    """The filters cut something, and no top-p boundary of the rows that decide the first three tokens lies
    within float noise (so float32 rounding cannot flip a kept set)."""
    full = (exact_joint(tables, SamplingParams(temperature=1.0)) > 0).sum()
    assert full == V ** 3
    for name in ("T0.7-top_k5-K1", "top_p0.8-K2"):
        support = (exact_joint(tables, SamplingParams(**CASES[name][2])) > 0).sum()
        assert support < full / 4, name
    for name in ("target", "near"):
        rows = torch.stack([r for h, r in tables[name].items() if len(h) < DEPTH]).double()
        rows = rows.softmax(-1).sort(-1, descending=True).values
        assert (rows.cumsum(-1) - 0.8).abs().min() > 1e-5, name


@pytest.mark.parametrize("name", list(CASES))
def test_exact_distribution_is_independently_right(tables, name):
    """The expected cells come from logits_to_probs, which the verifier uses too: check them against a
    naive float64 computation, so a bug in that shared transform cannot hide on both sides."""
    kw = CASES[name][2]
    t = {h: r.double().numpy() for h, r in tables["target"].items() if len(h) < DEPTH}
    naive = lambda h: naive_probs(t[h], kw["temperature"], kw.get("top_k", 0), kw.get("top_p", 1.0))  # noqa: E731
    want = np.zeros((V, V, V))
    for a, b in itertools.product(range(V), repeat=2):
        want[a, b] = naive(())[a] * naive((a,))[b] * naive((a, b))
    got = exact_joint(tables, SamplingParams(**kw))
    assert np.array_equal(got > 0, want > 0)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-10)


@pytest.mark.parametrize("name", list(CASES))
def test_table_runs_equal_real_network_runs(model_dirs, table_llms, name):
    """Seed for seed, the real networks (our runtime, real KV caches) generate exactly what the
    table-backed run generates, so the chi-square below speaks for the real thing."""
    draft, K, kw = CASES[name]
    real = make_llm(model_dirs, draft)
    for seed in range(N_SAME):
        params = SamplingParams(max_new_tokens=K + 2, seed=seed, **kw)
        a = real.generate(PROMPT, params, method="draft", num_draft_tokens=K)
        b = table_llms[draft].generate(PROMPT, params, method="draft", num_draft_tokens=K)
        assert a.token_ids == b.token_ids, f"seed {seed}"
        assert a.stats["accepted_tokens"] == b.stats["accepted_tokens"]


@pytest.mark.parametrize("name", list(CASES))
def test_speculative_sampling_matches_exact_distribution(table_llms, tables, name):
    draft, K, kw = CASES[name]
    params = SamplingParams(**kw)
    counts, acceptance = draw(table_llms[draft], K, params, N)
    assert counts.sum() == N
    lo, hi = ACCEPTANCE[name]
    assert lo < acceptance < hi, f"{name}: acceptance rate {acceptance:.3f} outside ({lo}, {hi})"
    p = chi2_pvalue(counts, exact_joint(tables, params))
    assert p > ALPHA, f"{name}: chi-square p = {p:.3g} (acceptance {acceptance:.3f})"


@pytest.mark.parametrize("quant", ["int8", "int4", "int8-fused", "int4-fused"])
def test_quantized_draft_matches_exact_distribution(model_dirs, tables, quant):
    """The CPU default: the draft's matrices in int8 (or 4-bit; the real network and verispec's kernels
    produce q; only the target is table-backed). An approximate q must leave the output law exactly p.
    "-fused": a bf16 draft, whose steps run the fused C++ decoder layer."""
    bits = quant.split("-")[0]
    llm = LLM(target=str(model_dirs["target"]), draft=str(model_dirs["near"]), dtype="float32", draft_quant=bits)
    if quant.endswith("-fused"):
        use_fused_quantized_draft(llm, str(model_dirs["near"]), int(bits[3:]))
        assert llm.draft.model.fused_quantized and llm.draft.model.dtype == torch.bfloat16
    assert llm.draft.model.layers[0].mlp.down_proj.qop is not None, "the draft did not run quantized"
    llm.target.model = TableModel(llm.target.model, tables["target"])
    params = SamplingParams(temperature=1.0)
    counts, acceptance = draw(llm, 2, params, N, first_seed=500_000)
    assert 0.3 < acceptance < 0.98, acceptance
    p = chi2_pvalue(counts, exact_joint(tables, params))
    assert p > ALPHA, f"{quant} draft: chi-square p = {p:.3g} (acceptance {acceptance:.3f})"


def test_negative_control_quantized_draft_with_recovery_from_p_fails(model_dirs, tables, monkeypatch):
    """The 4-bit draft (the CPU default) through a verifier that recovers from p instead of max(0, p - q):
    the same test must reject it, so the quantized cases above can fail."""
    llm = LLM(target=str(model_dirs["target"]), draft=str(model_dirs["near"]), dtype="float32", draft_quant="int4")
    llm.target.model = TableModel(llm.target.model, tables["target"])
    params = SamplingParams(temperature=1.0)
    monkeypatch.setattr(verispec.engine.engine, "verify", variant_verify("recover_from_p"))
    counts, _ = draw(llm, 2, params, N_NEG, first_seed=550_000)
    p = chi2_pvalue(counts, exact_joint(tables, params))
    assert p < ALPHA, f"recovery from p with a 4-bit draft not detected: p = {p:.3g}"


HEAD_IDS = [0, 2, 3, 5, 8, 11, 13, 14]  # the restricted draft's tokens: half the vocabulary


def restricted_head_llm(model_dirs, tables, tmp_path) -> LLM:
    """The real "near" network as draft with its LM head kept to HEAD_IDS (draft_vocab.py); the target is
    table-backed. q is 0 on half the vocabulary, so recovered tokens carry much of the mass."""
    table = tmp_path / "half.draft-vocab"
    save_table(table, torch.tensor(HEAD_IDS), V)
    llm = LLM(target=str(model_dirs["target"]), draft=str(model_dirs["near"]), dtype="float32", draft_quant="none",
              draft_vocab=len(HEAD_IDS), draft_vocab_table=str(table))
    assert llm.draft.model.head_ids.tolist() == HEAD_IDS
    llm.target.model = TableModel(llm.target.model, tables["target"])
    return llm


def test_restricted_head_draft_matches_exact_distribution(model_dirs, tables, tmp_path):
    llm = restricted_head_llm(model_dirs, tables, tmp_path)
    params = SamplingParams(temperature=1.0)
    counts, acceptance = draw(llm, 2, params, N, first_seed=700_000)
    assert 0.2 < acceptance < 0.9, acceptance
    p = chi2_pvalue(counts, exact_joint(tables, params))
    assert p > ALPHA, f"restricted head: chi-square p = {p:.3g} (acceptance {acceptance:.3f})"


def test_negative_control_restricted_head_with_recovery_from_p_fails(model_dirs, tables, tmp_path, monkeypatch):
    llm = restricted_head_llm(model_dirs, tables, tmp_path)
    params = SamplingParams(temperature=1.0)
    monkeypatch.setattr(verispec.engine.engine, "verify", variant_verify("recover_from_p"))
    counts, _ = draw(llm, 2, params, N_NEG, first_seed=700_000)
    p = chi2_pvalue(counts, exact_joint(tables, params))
    assert p < ALPHA, f"recovery from p with a restricted draft not detected: p = {p:.3g}"


@pytest.mark.parametrize("name,bug", NEGATIVE)
def test_negative_control_broken_verifier_fails(table_llms, tables, monkeypatch, name, bug):
    """The same test, with a deliberately wrong verifier inside the real decoding loop, must reject it."""
    draft, K, kw = CASES[name]
    params = SamplingParams(**kw)
    monkeypatch.setattr(verispec.engine.engine, "verify", variant_verify(bug))
    counts, _ = draw(table_llms[draft], K, params, N_NEG)
    p = chi2_pvalue(counts, exact_joint(tables, params))
    assert p < ALPHA, f"negative control {name}/{bug} not detected: p = {p:.3g}"


def test_copied_verifier_passes(table_llms, tables, monkeypatch):
    """Control for the controls: the unbroken copy of the rule, patched in the same way, passes."""
    draft, K, kw = CASES["far_draft-T1-K2"]
    params = SamplingParams(**kw)
    monkeypatch.setattr(verispec.engine.engine, "verify", variant_verify(None))
    counts, _ = draw(table_llms[draft], K, params, N_NEG)
    p = chi2_pvalue(counts, exact_joint(tables, params))
    assert p > ALPHA, f"p = {p:.3g}"


@pytest.mark.parametrize("bug", [None, "always_accept"])
def test_early_stops_keep_the_exact_distribution(table_llms, tables, monkeypatch, bug):
    """Rounds that end before K (DraftModelDrafter.stop_now, here a rule ending them at varied points) leave
    the law exactly p; the same draws through an always-accepting verifier are rejected (negative control)."""
    stop = varied_stop(2)
    monkeypatch.setattr(DraftModelDrafter, "stop_now", stop)  # about half the rounds end early
    if bug:
        monkeypatch.setattr(verispec.engine.engine, "verify", variant_verify(bug))
    draft, K, kw = CASES["top_p0.8-K2"]
    params = SamplingParams(**kw)
    rounds = []
    counts, acceptance = draw(table_llms[draft], K, params, N_NEG if bug else N, first_seed=900_000, rounds=rounds)
    r, d = map(sum, zip(*rounds))
    assert 1.1 < d / r < K - 0.1, f"{d} drafts in {r} rounds: the stops were not varied"
    assert True in stop.decisions and False in stop.decisions  # rounds ended early, and others went on
    p = chi2_pvalue(counts, exact_joint(tables, params))
    if bug:
        assert p < ALPHA, f"always-accept with early stops not detected: p = {p:.3g}"
    else:
        assert 0.6 < acceptance < 0.98, acceptance
        assert p > ALPHA, f"early stops: chi-square p = {p:.3g} (acceptance {acceptance:.3f})"
