"""The EAGLE-3 head drafter (drafters/head.py) keeps the output exactly the target's.

Greedy: method="eagle" gives token for token the AR output with native GGUF targets (bf16: verify chunks run
the fused C++ layer; fp32) and a dequantized one, for a random head and a trained one, K = 1, 2, 4, 8, and with the
default adaptive K (the head as auto's one delegate). The hidden states the fused and native paths return (which
the head reads) equal the per-op path's.

Sampling: the chi-square harness of test_speculative_distribution.py (a 16-token target as a table of logits;
the table hands the head the token embeddings as "hidden states", which decides nothing about exactness: the
verifier must make any q exact) with a random head over 12 of the 16 tokens (q is zero on the other four) and a
trained head, at fixed K and with the default adaptive K, and a broken verifier that must fail.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from exact_helpers import ALPHA, chi2_pvalue, variant_verify
from test_speculative_distribution import N_NEG, PROMPT, N, TableModel, V, exact_joint

import verispec.engine.engine

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
import test_speculative_distribution as base
from eagle_helpers import random_head
from gguf import GGMLQuantizationType as Q
from gguf_tiny import write_gguf
from tiny import make_hf_model

from verispec import LLM, SamplingParams, kernels
from verispec.config import SpecConfig
from verispec.drafters import AutoDrafter, HeadDrafter, NgramDrafter
from verispec.heads import Eagle3Config, Eagle3Head
from verispec.models.kv_cache import KVCache

model_dirs, tables = base.model_dirs, base.tables

DIMS = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
TYPES = {"attn_q.weight": Q.Q4_K, "attn_k.weight": Q.Q6_K, "attn_v.weight": Q.Q8_0, "attn_output.weight": Q.Q8_0,
         "ffn_gate.weight": Q.Q4_K, "ffn_up.weight": Q.Q6_K, "ffn_down.weight": Q.Q4_K, "output.weight": Q.Q6_K,
         "token_embd.weight": Q.Q8_0}
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], list(b"Hello, world. Hello, world!")]
NEW = 24
# the trained head learns from the target as inference runs it: native bf16 (the CPU default) where the kernels are
TRAIN_KEY = ("native", "bfloat16") if kernels.available() else ("dequantized", "float32")


def trained_head(path: Path, llm: LLM, steps: int = 150, prompts: list = ()) -> Path:
    """A head trained (training/trainer.py, recipes/eagle3.py) on the target's own greedy and sampled continuations of random
    prompts, and (four times each: self-distillation of what the tests ask) its greedy continuations of
    ``prompts``."""
    from verispec.training.extract import features_of
    from verispec.training.recipes import RECIPES
    from verispec.training.trainer import TrainConfig, Trainer, draft_vocabulary

    model, cfg = llm.target.model, llm.target.config
    hc = Eagle3Config.for_target(cfg, None, cfg.vocab_size)
    seqs = []
    for seed in range(24):
        prompt = [int(t) for t in torch.randint(0, cfg.vocab_size, (4,), generator=torch.Generator().manual_seed(seed))]
        params = SamplingParams(temperature=0.0 if seed % 2 else 1.0, max_new_tokens=44, seed=seed, ignore_eos=True)
        seqs.append(features_of(model, prompt + llm.generate(prompt, params).token_ids, hc.layers, 8))
    for prompt in prompts:
        params = SamplingParams(max_new_tokens=48 - len(prompt), ignore_eos=True)
        seqs[:0] = 4 * [features_of(model, prompt + llm.generate(prompt, params).token_ids, hc.layers, 8)]
    data = {k: torch.stack([s[k] for s in seqs]) for k in seqs[0]}
    train = {k: v[:-4] for k, v in data.items()}
    held = {k: v[-4:] for k, v in data.items()}
    head = Eagle3Head(hc)
    head.d2t = draft_vocabulary(train["topk_ids"][..., 0], hc.draft_vocab_size, cfg.vocab_size, ())
    RECIPES["eagle3"].init(head, model, "random", 0)
    head.attach_embedding(model.embed_tokens)
    path.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(head, TrainConfig(steps=steps, lr=3e-3, eval_every=steps, ckpt_every=steps, warmup=10),
                      train, held, path, log=lambda line: None)
    trainer.autocast = False
    trainer.run(progress=False)
    return path


# ---------------------------------------------------------------------------------------------------------------
# greedy identity, bitwise: native GGUF targets (bf16 fused / fp32) and a dequantized one
# ---------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gguf_target(tmp_path_factory):
    path = tmp_path_factory.mktemp("eagle_native") / "target.gguf"
    write_gguf(path, "qwen2", make_hf_model("qwen2", seed=11, **DIMS), TYPES, seed=5, kquant_scale=2.0)
    return path


@pytest.fixture(scope="module")
def heads(gguf_target, tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle_heads")
    llm = LLM(target=str(gguf_target), dtype=TRAIN_KEY[1], weights=TRAIN_KEY[0], progress=False)
    cfg = llm.target.config
    return {"random": random_head(root / "random", cfg, rows=list(range(0, cfg.vocab_size, 2)) + [1]),
            "trained": trained_head(root / "trained", llm, prompts=PROMPTS)}


@pytest.fixture(scope="module")
def llms(gguf_target, heads):
    needs_kernels = not kernels.available()
    out = {}
    for weights, dtype in (("native", "bfloat16"), ("native", "float32"), ("dequantized", "float32")):
        if weights == "native" and needs_kernels:
            continue
        for name, path in heads.items():
            out[weights, dtype, name] = LLM(target=str(gguf_target), dtype=dtype, weights=weights, head=str(path),
                                            progress=False)
    return out


def test_the_trained_head_drafts_better_than_the_random_one(llms):
    """The trained case is what it claims: it gets accepted far more often than a random head."""
    key = TRAIN_KEY
    rates = {}
    for name in ("random", "trained"):
        out = [llms[(*key, name)].generate(p, SamplingParams(max_new_tokens=NEW, ignore_eos=True), method="eagle",
                                           num_draft_tokens=4, adaptive=False) for p in PROMPTS]
        rates[name] = sum(o.stats["accepted_tokens"] for o in out) / sum(o.stats["drafted_tokens"] for o in out)
    assert rates["trained"] > 0.15 and rates["trained"] > 2 * rates["random"] + 0.05, rates


@pytest.mark.parametrize("K", [1, 2, 4, 8])
@pytest.mark.parametrize("head", ["random", "trained"])
def test_greedy_identity(llms, head, K):
    for (weights, dtype, name), llm in llms.items():
        if name != head:
            continue
        for prompt in PROMPTS:
            want = llm.generate(prompt, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
            got = llm.generate(prompt, SamplingParams(max_new_tokens=NEW, ignore_eos=True), method="eagle",
                               num_draft_tokens=K, adaptive=False)
            assert got.token_ids == want.token_ids, (weights, dtype, prompt)
            assert got.stats["drafted_tokens"] > 0


def test_a_head_method_chooses_k_per_round_by_default(llms):
    """method="eagle" alone drafts with adaptive K (auto with the head as its one delegate, never a plain step);
    adaptive=False drafts the fixed K; draft and ngram stay fixed by default. Greedy: the AR tokens either way."""
    llm = llms[(*TRAIN_KEY, "trained")]
    default = llm.make_drafter(SpecConfig("eagle", 4))
    assert isinstance(default, AutoDrafter) and not default.allow_no_spec and set(default.delegates()) == {"eagle"}
    assert isinstance(llm.make_drafter(SpecConfig("eagle", 4, adaptive=False)), HeadDrafter)
    assert isinstance(llm.make_drafter(SpecConfig("ngram", 4)), NgramDrafter)
    for prompt in PROMPTS:
        params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
        got = llm.generate(prompt, params, method="eagle", num_draft_tokens=4)
        assert got.token_ids == llm.generate(prompt, params).token_ids and got.stats["drafted_tokens"] > 0


@pytest.mark.skipif(not kernels.available(), reason="C++ kernels not built")
def test_fused_and_native_hidden_states_equal_the_per_op_path(llms):
    """The head reads the target's residual streams: the fused C++ layer (bf16, <= 16 rows) and the native
    kernels return the same hidden states as the per-op Python path over the same weights."""
    llm = llms["native", "bfloat16", "random"]
    model, layers = llm.target.model, llm.draft_head().config.layers
    ids = torch.tensor([PROMPTS[1][:12]])

    def run(fused: bool):
        model.fused_quantized = fused
        cache = KVCache.for_model(model.config, 1, 16, model.dtype)
        return model(ids, torch.arange(12)[None], cache, hidden_layers=layers)

    try:
        (_, hf), (_, hp) = run(True), run(False)
    finally:
        model.fused_quantized = True
    for i in layers:
        torch.testing.assert_close(hf[i], hp[i], rtol=0.02, atol=0.02)
        assert hf[i].shape == (1, 12, model.config.hidden_size)
    assert hf.keys() == hp.keys() == set(layers)


def test_features_handed_to_the_drafter_are_the_committed_positions(llms, monkeypatch):
    """DraftRequest.features rows 0..n-1 are the target's states at the committed positions: bitwise those of
    feeding the committed context one token at a time (prefill and verify chunks are row-exact on this path)."""
    llm = llms["native", "bfloat16", "random"] if ("native", "bfloat16", "random") in llms else next(iter(llms.values()))
    seen = []
    real = HeadDrafter.propose

    def spy(self, request):
        seen.append((list(request.context), request.features[:len(request.context) - 1].clone()))
        return real(self, request)

    monkeypatch.setattr(HeadDrafter, "propose", spy)
    llm.generate(PROMPTS[0], SamplingParams(max_new_tokens=NEW, ignore_eos=True), method="eagle", num_draft_tokens=3)
    model, layers = llm.target.model, llm.draft_head().config.layers
    context, feats = seen[-1]
    n = len(context) - 1
    cache = KVCache.for_model(model.config, 1, n, model.dtype)
    rows = []
    for p in range(n):
        _, hidden = model(torch.tensor([context[p:p + 1]]), torch.tensor([[p]]), cache, hidden_layers=layers)
        rows.append(torch.cat([hidden[i][0] for i in layers], dim=-1))  # [1, nD]
    torch.testing.assert_close(feats, torch.cat(rows), rtol=0, atol=0)
    assert len(seen) > 3


# ---------------------------------------------------------------------------------------------------------------
# sampling: chi-square against the exact law, and a broken verifier that must fail
# ---------------------------------------------------------------------------------------------------------------

class FeatureTable(TableModel):
    """The table target, also handing out "hidden states" (the token embeddings) for every layer asked for."""

    def __call__(self, input_ids, positions, cache, mask=None, num_logits=None, hidden_layers=()):
        logits, _ = super().__call__(input_ids, positions, cache, mask, num_logits)
        emb = self.embed_tokens(input_ids).detach()  # [1, T, D]
        return logits, {i: emb * (1 + i) for i in hidden_layers}

    def forward_paged(self, input_ids, batch, cache, logit_rows=None, hidden_layers=()):
        logits, _ = super().forward_paged(input_ids, batch, cache, logit_rows)
        emb = self.embed_tokens(input_ids).detach()  # [N, D]
        return logits, {i: emb * (1 + i) for i in hidden_layers}


@pytest.fixture(scope="module")
def table_heads(model_dirs, tables, tmp_path_factory):
    """{name: LLM}: the 16-token target as a table, with a random head (12 of 16 tokens) or a trained one."""
    root = tmp_path_factory.mktemp("eagle16")
    real = LLM(target=str(model_dirs["target"]), dtype="float32", progress=False)
    paths = {"random": random_head(root / "random", real.target.config, rows=list(range(12)), scale=0.3),
             "trained": trained_head(root / "trained", real, steps=120)}
    return {name: table_llm_with(model_dirs, tables, path) for name, path in paths.items()}


def table_llm_with(model_dirs, tables, head: Path) -> LLM:
    """The 16-token target as a table (FeatureTable), drafting with the head in ``head``."""
    llm = LLM(target=str(model_dirs["target"]), dtype="float32", head=str(head), progress=False)
    llm.draft_head()  # loaded on the real network (its embedding and norm), before the table stands in
    llm.target.model = FeatureTable(llm.target.model, tables["target"])
    return llm


def draw(llm, K: int, params: SamplingParams, n: int, method: str = "eagle", adaptive: bool | None = False):
    """n draws at fixed K, seeded; or with adaptive K (None: the head's default) unseeded, from torch's generator
    seeded once: a seeded sample under adaptive K drafts the fixed K (drafters/auto.py), so only unseeded draws
    take the rounds whose K the measured costs choose."""
    counts = np.zeros((V, V, V), dtype=np.int64)
    drafted = accepted = 0
    torch.manual_seed(0)
    for seed in range(n):
        out = llm.generate(PROMPT, dataclasses.replace(params, max_new_tokens=K + 2,
                                                       seed=seed if adaptive is False else None),
                           method=method, num_draft_tokens=K, adaptive=adaptive)
        a, b, c = out.token_ids[:3]
        counts[a, b, c] += 1
        drafted += out.stats["drafted_tokens"]
        accepted += out.stats["accepted_tokens"]
    return counts, accepted / max(drafted, 1)


CASES = {"random-T1-K2": ("random", 2, dict(temperature=1.0)),
         "trained-T0.8-top_k6-K2": ("trained", 2, dict(temperature=0.8, top_k=6))}


def check_greedy_identity(llm, method: str, K: int, prompts=PROMPTS, new: int = NEW) -> None:
    """``method`` at a fixed K gives token for token the AR output on every prompt, having drafted."""
    for prompt in prompts:
        want = llm.generate(prompt, SamplingParams(max_new_tokens=new, ignore_eos=True))
        got = llm.generate(prompt, SamplingParams(max_new_tokens=new, ignore_eos=True), method=method,
                           num_draft_tokens=K, adaptive=False)
        assert got.token_ids == want.token_ids, (method, K, prompt)
        assert got.stats["drafted_tokens"] > 0


def check_law(llm, tables, name: str, K: int, kw: dict, method: str = "eagle", adaptive: bool | None = False) -> None:
    """N draws of 3 tokens match the exact AR law (chi-square), with acceptance neither ~0 nor ~1."""
    params = SamplingParams(**kw)
    counts, acceptance = draw(llm, K, params, N, method, adaptive)
    assert 0.02 < acceptance < 0.98, f"{name}: acceptance {acceptance:.3f}"
    p = chi2_pvalue(counts, exact_joint(tables, params))
    assert p > ALPHA, f"{name}: chi-square p = {p:.3g} (acceptance {acceptance:.3f})"


def check_broken_verifier_fails(llm, tables, monkeypatch, K: int, kw: dict, method: str = "eagle",
                                adaptive: bool | None = False) -> None:
    """The negative control: a verifier that accepts every draft is rejected by the same chi-square test."""
    params = SamplingParams(**kw)
    monkeypatch.setattr(verispec.engine.engine, "verify", variant_verify("always_accept"))
    counts, _ = draw(llm, K, params, N_NEG, method, adaptive)
    assert chi2_pvalue(counts, exact_joint(tables, params)) < ALPHA


@pytest.mark.parametrize("name", list(CASES))
def test_eagle_sampling_matches_exact_distribution(table_heads, tables, name):
    head, K, kw = CASES[name]
    check_law(table_heads[head], tables, name, K, kw)


@pytest.mark.parametrize("name", list(CASES))
def test_negative_control_broken_verifier_fails(table_heads, tables, monkeypatch, name):
    head, K, kw = CASES[name]
    check_broken_verifier_fails(table_heads[head], tables, monkeypatch, K, kw)


def test_default_adaptive_k_sampling_matches_exact_distribution(table_heads, tables):
    """The default path (K per round, the head as auto's one delegate), unseeded: the exact law; its control fails."""
    check_law(table_heads["trained"], tables, "adaptive trained-T0.8-top_k6-K2", 2, dict(temperature=0.8, top_k=6),
              adaptive=None)


def test_default_adaptive_k_negative_control_fails(table_heads, tables, monkeypatch):
    check_broken_verifier_fails(table_heads["trained"], tables, monkeypatch, 2, dict(temperature=0.8, top_k=6),
                                adaptive=None)
