"""The exactness suite with native GGUF weights: targets (and drafts) whose matrices stay in their
Q4_K / Q5_K / Q6_K / Q8_0 / Q4_0 / Q5_0 blocks and run on csrc/linear_gguf.cpp.

Greedy: speculative output (draft K = 1, 2, 4, 8; n-gram; auto) is token for token the AR output, in bf16
(the CPU default: chunks of <= 16 tokens run each layer in one C++ call) and in fp32, with three drafts: the
target itself ("same": every draft accepted, so each verify pass over K + 1 rows must give the logits the
draft's one-row steps gave), the target's dequantized weights plus noise ("near": mostly F16, which loads
dequantized and is quantized to int8 by the default draft_quant, plus three Q8_0 / Q5_0 matrices that stay
native; rounds end anywhere) and an unrelated native llama file ("other": nearly every draft rejected). In
bf16 the verify pass is bitwise the AR computation (test_verify_logits_are_the_ar_logits_bitwise), which is
what makes the identity exact rather than likely.

Sampling: the chi-square harness of test_speculative_distribution.py (tables of logits stand in for the
networks during the 10k draws; the real networks must make the same draws seed for seed), with a native
target of 16 tokens and hidden size 256, and its negative control (always_accept) that must be rejected.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q

import verispec.engine.engine
from exact_helpers import ALPHA, chi2_pvalue, variant_verify, varied_stop

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))  # gguf_tiny lives with the GGUF loader tests
from gguf_tiny import write_gguf  # noqa: E402
from test_speculative_distribution import DEPTH, N, N_NEG, N_SAME, PROMPT, V, TableModel, draw, exact_joint
from tiny import make_hf_model
from verispec import LLM, SamplingParams, kernels
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.models.kv_cache import KVCache
from verispec.models.linear import Linear
from verispec.models.llama import Block

pytestmark = pytest.mark.skipif(not kernels.available(), reason="C++ kernels not built")

DIMS = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
TARGET_TYPES = {  # Q4_K_M-like; q/k/v of three types fused into one native matrix
    "attn_q.weight": Q.Q4_K, "attn_k.weight": Q.Q6_K, "attn_v.weight": Q.Q8_0, "attn_output.weight": Q.Q8_0,
    "ffn_gate.weight": Q.Q4_K, "ffn_up.weight": Q.Q6_K, "ffn_down.weight": Q.Q4_K, "output.weight": Q.Q6_K,
    "token_embd.weight": Q.Q8_0}
OTHER_TYPES = {  # the other three native types
    "attn_q.weight": Q.Q5_K, "attn_k.weight": Q.Q4_0, "attn_v.weight": Q.Q5_0, "attn_output.weight": Q.Q6_K,
    "ffn_gate.weight": Q.Q5_0, "ffn_up.weight": Q.Q4_0, "ffn_down.weight": Q.Q5_K, "output.weight": Q.Q8_0}
NEAR_TYPES = {"attn_output.weight": Q.Q8_0, "ffn_gate.weight": Q.Q5_0, "ffn_up.weight": Q.Q8_0}  # the rest F16
DTYPES = ["bfloat16", "float32"]
DRAFTS = ["same", "near", "other"]
KS = [1, 2, 4, 8]
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], list(b"Hello, world. Hello, world!")]  # prefill of 8 (fused) and 27 tokens
NEW = 24


def noisy_copy(expected: dict, model, scale: float, seed: int):
    """A transformers model holding the expected (dequantized) weights plus relative noise on each matrix."""
    g = torch.Generator().manual_seed(seed)
    sd = {k: torch.from_numpy(v) for k, v in expected.items()}
    sd = {k: v + scale * v.std() * torch.randn(v.shape, generator=g) if v.dim() == 2 else v for k, v in sd.items()}
    model.load_state_dict(sd)
    return model


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    root = tmp_path_factory.mktemp("native_exact")
    paths = {d: root / f"{d}.gguf" for d in ("target", "near", "other")}
    expected = write_gguf(paths["target"], "qwen2", make_hf_model("qwen2", seed=11, **DIMS), TARGET_TYPES, seed=5,
                          kquant_scale=2.0)
    write_gguf(paths["near"], "qwen2", noisy_copy(expected, make_hf_model("qwen2", seed=11, **DIMS), 0.02, 1),
               NEAR_TYPES, seed=6)
    write_gguf(paths["other"], "llama", make_hf_model("llama", seed=12, **DIMS), OTHER_TYPES, seed=7,
               kquant_scale=2.0)
    return paths


@pytest.fixture(scope="module")
def llms(ggufs):
    """{(dtype, draft): LLM with weights="native"}; each also serves as its own AR reference."""
    out = {}
    for dtype in DTYPES:
        for d in DRAFTS:
            src = ggufs["target" if d == "same" else d]
            out[dtype, d] = LLM(target=str(ggufs["target"]), draft=str(src), dtype=dtype, weights="native",
                                draft_weights="native",
                                progress=False)
    return out


def ar(llm, prompt, **kw):
    return llm.generate(prompt, SamplingParams(**kw))


def spec(llm, prompt, method="draft", K=4, opts=None, **kw):
    """Always K drafts a round unless opts say otherwise (early stops: test_early_stop.py)."""
    opts = {"early_stop": False, **(opts or {})}
    return llm.generate(prompt, SamplingParams(**kw), method=method, num_draft_tokens=K, **opts)


def best_forwards(n: int, K: int) -> int:
    """Target forwards for n tokens when every draft is accepted: the prefill, then K + 1 per round."""
    return 1 + -(-(n - 1) // (K + 1))


def test_the_models_are_what_the_tests_claim(llms):
    for dtype in DTYPES:
        t = llms[dtype, "same"].target.model
        assert t.layers[0].self_attn.qkv_proj.native.types == ["Q4_K", "Q6_K", "Q8_0"]
        assert t.lm_head.native.types == ["Q6_K"] and t.fused_quantized
        assert all(m.native is not None for m in t.layers.modules() if isinstance(m, Linear))
        assert llms[dtype, "same"].draft.model.layers[1].mlp.down_proj.native.types == ["Q4_K"]
        # near: F16 matrices load dequantized and get int8 (draft_quant); its Q8_0/Q5_0 ones stay native, so
        # in bf16 its fused layer calls mix both kernels
        near = llms[dtype, "near"].draft.model.layers[0]
        assert near.mlp.down_proj.native is None and near.mlp.down_proj.qop is not None
        assert near.self_attn.qkv_proj.native is None and near.self_attn.qkv_proj.qop is not None
        assert near.self_attn.o_proj.native.types == ["Q8_0"] and near.mlp.gate_up_proj.native.types == ["Q5_0", "Q8_0"]
        assert llms[dtype, "near"].draft.model.fused_quantized
        other = llms[dtype, "other"].draft.model
        assert other.layers[0].self_attn.qkv_proj.native.types == ["Q5_K", "Q4_0", "Q5_0"]
    # lively enough that identity means something: varied greedy text
    for p in PROMPTS:
        assert len(set(ar(llms["bfloat16", "same"], p, max_new_tokens=NEW, ignore_eos=True).token_ids)) >= 8


@pytest.mark.parametrize("K", KS)
@pytest.mark.parametrize("draft", DRAFTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_identity(llms, dtype, draft, K):
    llm = llms[dtype, draft]
    for prompt in PROMPTS:
        want = ar(llm, prompt, max_new_tokens=NEW, ignore_eos=True)
        out = spec(llm, prompt, K=K, max_new_tokens=NEW, ignore_eos=True)
        assert out.token_ids == want.token_ids, f"{dtype} {draft} K={K} {prompt}"
        s = out.stats
        assert s["new_tokens"] == NEW == s["accepted_tokens"] + s["target_forwards"]
        if draft == "same" and len(prompt) <= kernels.MAX_ROWS:  # verify rows == the draft's rows: all accepted
            assert s["acceptance_rate"] == 1.0 and s["target_forwards"] == best_forwards(NEW, K)
        elif draft == "same":
            # a long prompt's prefill runs the Python layer (SDPA attention) for the target, while the draft
            # computes the prompt's last token alone, in the fused layer: two attention summation orders, and
            # the int8 activation rounding can turn one bf16 ulp into a visible logit change. Most drafts
            # are still accepted; exactness (the token identity above) does not depend on it.
            assert s["acceptance_rate"] > 0.5, s["acceptance_rate"]
        elif draft == "near":
            assert 0.05 < s["acceptance_rate"] < 0.98, s["acceptance_rate"]
        else:
            assert s["acceptance_rate"] < 0.25, s["acceptance_rate"]


NGRAM_PROMPTS = [list(b"abc abc abc abd abc ab"), [10, 11, 12, 13, 14] * 3 + [10, 11], PROMPTS[1]]
RUNS = [("ngram", 1, {}), ("ngram", 3, {}), ("ngram", 8, {}), ("auto", 4, {}), ("auto", 8, dict(adaptive=True)),
        ("draft", 6, dict(adaptive=True))]


@pytest.mark.parametrize("method,K,opts", RUNS, ids=[f"{m}-K{k}{'-adaptive' if o else ''}" for m, k, o in RUNS])
@pytest.mark.parametrize("dtype", DTYPES)
def test_ngram_and_auto_greedy_identity(llms, dtype, method, K, opts):
    drafted = accepted = 0
    for draft in ("same", "other") if method != "ngram" else ("same",):
        llm = llms[dtype, draft]
        for prompt in NGRAM_PROMPTS:
            want = ar(llm, prompt, max_new_tokens=32, ignore_eos=True)
            out = spec(llm, prompt, method, K, opts, max_new_tokens=32, ignore_eos=True)
            assert out.token_ids == want.token_ids, f"{dtype} {method} K={K} {opts} {draft} {prompt}"
            s = out.stats
            assert s["new_tokens"] == 32 == s["accepted_tokens"] + s["target_forwards"]
            drafted += s["drafted_tokens"]
            accepted += s["accepted_tokens"]
    assert 0 < accepted < drafted, (accepted, drafted)  # drafts were made, some accepted, some rejected


@pytest.mark.parametrize("method", ["draft", "auto"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_identity_with_early_stops(llms, monkeypatch, dtype, method):
    """Rounds ending at varied lengths (a draft-side rule standing in for the timing-based one) verify passes of
    every size; native weights make each the logits AR would compute, so the output is the AR output."""
    stop = varied_stop(3)
    monkeypatch.setattr(DraftModelDrafter, "stop_now", stop)
    rounds = drafted = 0
    for draft in ("same", "near"):
        llm = llms[dtype, draft]
        for prompt in PROMPTS:
            want = ar(llm, prompt, max_new_tokens=NEW, ignore_eos=True)
            out = spec(llm, prompt, method, 8, {"early_stop": True}, max_new_tokens=NEW, ignore_eos=True)
            assert out.token_ids == want.token_ids, f"{dtype} {method} {draft} {prompt}"
            rounds += out.stats["per_position_reached"][0]
            drafted += out.stats["drafted_tokens"]
    assert rounds < drafted < 8 * rounds, (rounds, drafted)
    assert True in stop.decisions and False in stop.decisions  # rounds ended early, and others went on


@pytest.mark.parametrize("draft", ["same", "other"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_max_new_tokens_mid_chunk(llms, dtype, draft):
    llm, K = llms[dtype, draft], 4
    full = ar(llm, PROMPTS[0], max_new_tokens=13, ignore_eos=True).token_ids
    for n in range(1, 14):  # every remainder modulo K + 1
        out = spec(llm, PROMPTS[0], K=K, max_new_tokens=n, ignore_eos=True)
        assert out.token_ids == full[:n], f"max_new_tokens={n}"
        assert out.finish_reason == "length" and out.stats["new_tokens"] == n
        if draft == "same":  # no forward wasted past the budget
            assert out.stats["target_forwards"] == best_forwards(n, K), f"max_new_tokens={n}"


def test_verify_logits_are_the_ar_logits_bitwise(llms, monkeypatch):
    """bf16, all matrices native: a position's logits are bitwise the same whether it is computed alone (an
    AR step) or inside a chunk of up to 16 (a verify pass), because each layer's C++ call is batch-invariant."""
    model = llms["bfloat16", "same"].target.model
    chunk_sizes = []
    real = Block.forward_fused

    def spy(self, x, *args):
        chunk_sizes.append(x.shape[0])  # x: [T, D]
        return real(self, x, *args)

    monkeypatch.setattr(Block, "forward_fused", spy)
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(3))

    def run(chunks, P=20):
        cache = KVCache.for_model(model.config, 1, 40, torch.bfloat16)
        out, pos = [], 0
        for n in [P, *chunks]:
            logits, _ = model(ids[:, pos:pos + n], torch.arange(pos, pos + n)[None], cache)
            out.append(logits[0])
            pos += n
        return torch.cat(out)[P:]

    one_by_one = run([1] * 20)
    assert chunk_sizes and set(chunk_sizes) == {1}  # the fused path ran (the 20-token prefill did not)
    for chunks in ([16, 4], [9, 9, 2], [2, 3, 5, 7, 3]):
        assert torch.equal(run(chunks), one_by_one), chunks
    assert max(chunk_sizes) == 16


# --- sampling: chi-square with a native target -------------------------------------------------------

V16 = dict(vocab_size=V, eos_token_id=None, num_hidden_layers=1, hidden_size=256, intermediate_size=512,
           num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
V16_TYPES = {"attn_q.weight": Q.Q4_K, "attn_k.weight": Q.Q6_K, "attn_v.weight": Q.Q8_0, "attn_output.weight": Q.Q5_K,
             "ffn_gate.weight": Q.Q4_0, "ffn_up.weight": Q.Q5_0, "ffn_down.weight": Q.Q4_K,
             "output.weight": Q.Q6_K, "token_embd.weight": Q.Q8_0}
ACCEPTANCE = (0.4, 0.75)  # measured 0.57: the noisy float draft is what it claims to be
SAMPLING = SamplingParams(temperature=1.0)
K_CHI = 2


@pytest.fixture(scope="module")
def v16_paths(tmp_path_factory):
    """A native target (all six types) of 16 tokens, and a float draft: its weights plus 30% noise (F16)."""
    root = tmp_path_factory.mktemp("native16")
    target, draft = root / "target.gguf", root / "draft.gguf"
    expected = write_gguf(target, "qwen2", make_hf_model("qwen2", 1, **V16), V16_TYPES, seed=5, kquant_scale=2.0,
                          eos_token_id=None)
    write_gguf(draft, "qwen2", noisy_copy(expected, make_hf_model("qwen2", 1, **V16), 0.3, 1), {}, seed=6,
               eos_token_id=None)
    return target, draft


def make_v16_llm(v16_paths) -> LLM:
    target, draft = v16_paths
    return LLM(target=str(target), draft=str(draft), dtype="float32", weights="native",
               draft_weights="native", draft_quant="none",
               progress=False)


def runtime_table(model) -> dict:
    """Our runtime's logits after PROMPT + every history of up to DEPTH tokens (one batched forward per depth)."""
    table = {}
    for d in range(DEPTH + 1):
        hists = list(itertools.product(range(V), repeat=d))
        ids = torch.tensor([PROMPT + list(h) for h in hists])
        cache = KVCache.for_model(model.config, len(hists), ids.shape[1], torch.float32)
        logits, _ = model(ids, torch.arange(ids.shape[1]).expand(len(hists), -1), cache, num_logits=1)
        table.update(zip(hists, logits[:, -1]))
    return table


@pytest.fixture(scope="module")
def v16(v16_paths):
    """(table-backed LLM, tables): the native target's and the draft's logits, from our runtime."""
    llm = make_v16_llm(v16_paths)
    assert llm.target.model.layers[0].mlp.gate_up_proj.native.types == ["Q4_0", "Q5_0"]
    assert llm.draft.model.layers[0].mlp.down_proj.native is None
    tables = {"target": runtime_table(llm.target.model), "draft": runtime_table(llm.draft.model)}
    llm.target.model = TableModel(llm.target.model, tables["target"])
    llm.draft.model = TableModel(llm.draft.model, tables["draft"])
    return llm, tables


def test_native_table_runs_equal_real_network_runs(v16_paths, v16):
    """Seed for seed, the real networks (native target, KV caches, verify passes over K + 1 rows) draw what
    the tables draw, so the chi-square below speaks for the native target."""
    real, (table_llm, tables) = make_v16_llm(v16_paths), v16
    assert real.target.model.lm_head.native is not None
    for seed in range(N_SAME):
        params = SamplingParams(max_new_tokens=K_CHI + 2, seed=seed, temperature=1.0)
        a = real.generate(PROMPT, params, method="draft", num_draft_tokens=K_CHI)
        b = table_llm.generate(PROMPT, params, method="draft", num_draft_tokens=K_CHI)
        assert a.token_ids == b.token_ids, f"seed {seed}"
        assert a.stats["accepted_tokens"] == b.stats["accepted_tokens"]
    # the target is lively: no first token has more than half the mass, none is negligible
    p1 = exact_joint(tables, SAMPLING).sum(axis=(1, 2))
    assert p1.max() < 0.5 and p1.min() > 1e-3


def test_native_target_matches_exact_distribution(v16):
    llm, tables = v16
    counts, acceptance = draw(llm, K_CHI, SAMPLING, N, first_seed=900_000)
    assert counts.sum() == N
    assert ACCEPTANCE[0] < acceptance < ACCEPTANCE[1], acceptance
    p = chi2_pvalue(counts, exact_joint(tables, SAMPLING))
    assert p > ALPHA, f"native target: chi-square p = {p:.3g} (acceptance {acceptance:.3f})"


def test_negative_control_always_accept_is_rejected(v16, monkeypatch):
    llm, tables = v16
    monkeypatch.setattr(verispec.engine.engine, "verify", variant_verify("always_accept"))
    counts, _ = draw(llm, K_CHI, SAMPLING, N_NEG, first_seed=900_000)
    p = chi2_pvalue(counts, exact_joint(tables, SAMPLING))
    assert p < ALPHA, f"always_accept with a native target not detected: p = {p:.3g}"
