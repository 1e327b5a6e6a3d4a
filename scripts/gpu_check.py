#!/usr/bin/env python3
"""One-shot check of verispec's CUDA path: exactness on tiny models, one chi-square test, timings.

    PYTHONPATH=src python3 scripts/gpu_check.py --out DIR            # on a CUDA machine (~3 min on an H200)
    PYTHONPATH=src python3 scripts/gpu_check.py --out DIR --small    # quick logic check, falls back to CPU

Never crashes as a whole: each check runs in its own try/except and prints one line
``PASS|FAIL|INFO|SKIP name: reason``; everything measured goes to DIR/gpu_check.json.

a. greedy token identity, AR vs speculative (draft K = 1, 2, 4, 8; ngram; auto), tiny random models
   (tests/tiny.py), float32 and bfloat16. In bf16 a mismatch is reported as INFO (a numerics finding:
   the verify pass runs K+1 rows where AR runs one, so matrix kernels may sum in another order).
b. one chi-square test of speculative sampling against exact AR probabilities (real networks on the
   device, tests/exactness/test_speculative_distribution.py's "T1-K2" case), plus its negative
   control (a verifier that accepts every draft), which must be rejected.
c. timings with random weights of Qwen2.5-1.5B / 0.5B shapes in bf16: target forward over k new
   tokens with a warm cache, draft step, AR and speculative (draft = the target's own weights) tokens/s,
   and transformers' Qwen2 on the same weights for comparison.
"""

from __future__ import annotations

import argparse
import importlib.abc
import itertools
import json
import platform
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT / "tests", ROOT / "src"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

RESULTS: list[dict] = []
SUMMARY: dict = {"checks": RESULTS}


class _BlockExtension(importlib.abc.MetaPathFinder):
    """--no-ext: make ``verispec._C`` unimportable, as on a machine whose torch the build does not match."""

    def find_spec(self, name, path=None, target=None):
        if name == "verispec._C":
            raise ImportError("verispec._C blocked by --no-ext")
        return None


def record(name: str, status: str, reason: str, **data) -> None:
    RESULTS.append(dict(name=name, status=status, reason=reason, **data))
    print(f"{status} {name}: {reason}", flush=True)


def run_check(name: str, fn, *args, **kw) -> None:
    t0 = time.perf_counter()
    try:
        fn(name, *args, **kw)
    except Exception as e:  # one check failing must not stop the others
        tb = traceback.format_exc()
        print(tb, file=sys.stderr, flush=True)
        msg = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        record(name, "FAIL", f"{type(e).__name__}: {msg}", traceback=tb[-3000:])
    print(f"     ({name}: {time.perf_counter() - t0:.1f} s)", flush=True)


def sync(device) -> None:
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def median_time(fn, device, reps: int, warmup: int = 2) -> float:
    """Median seconds of fn() over reps runs, synchronized before and after each."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# --------------------------------------------------------------------------------------------------
# a. greedy identity


def check_environment(name, device):
    import torch

    import verispec
    from verispec import kernels

    info = dict(python=platform.python_version(), torch=torch.__version__, device=device,
                cuda=torch.version.cuda, kernels_available=kernels.available(), kernels_isa=kernels.isa(),
                verispec_file=verispec.__file__)
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(0)
        info["tf32_matmul"] = torch.backends.cuda.matmul.allow_tf32
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except Exception as e:  # noqa: BLE001
        info["transformers"] = f"unavailable ({type(e).__name__})"
    SUMMARY["environment"] = info
    record(name, "INFO", ", ".join(f"{k}={v}" for k, v in info.items() if k != "verispec_file"))


def tiny_dirs(root: Path) -> dict:
    from tiny import make_hf_dir

    return {"target": make_hf_dir(root / "qwen2_s0", "qwen2", seed=0),
            "other": make_hf_dir(root / "llama_s5", "llama", seed=5)}


def check_greedy_identity(name, device, dtype, dirs, small):
    from verispec import LLM, SamplingParams

    N = 24
    prompts = ["Hello, world", "def f(x):\n    return", "abc abc abc abd abc abc abc"]
    runs = [("draft", K) for K in (1, 2, 4, 8)] + [("ngram", 4), ("ngram", 8), ("auto", 8)]
    llms = {d: LLM(target=str(dirs["target"]), draft=str(dirs[d]), dtype=dtype, device=device, draft_quant="none",
                   progress=False)
            for d in ("target", "other")}
    assert llms["target"].target.model.embed_tokens.weight.device.type == device.split(":")[0]
    params = SamplingParams(max_new_tokens=N, ignore_eos=True)
    total = mismatched = 0
    first_bad = []
    same_acceptance = []
    for draft, llm in llms.items():
        for prompt in prompts:
            want = llm.generate(prompt, params).token_ids
            for method, K in runs:
                if method != "draft" and draft != "target":
                    continue  # ngram ignores the draft; auto once is enough
                out = llm.generate(prompt, params, method=method, num_draft_tokens=K)
                total += 1
                if method == "draft" and draft == "target":
                    same_acceptance.append(out.stats["acceptance_rate"])
                if out.token_ids != want:
                    mismatched += 1
                    at = next((i for i, (a, b) in enumerate(zip(out.token_ids, want)) if a != b), None)
                    first_bad.append(dict(draft="same" if draft == "target" else draft, method=method, K=K,
                                          prompt=prompt, first_diff_at=at))
    data = dict(runs=total, mismatched=mismatched, mismatches=first_bad[:10],
                same_draft_acceptance_min=min(same_acceptance), same_draft_acceptance_mean=statistics.mean(same_acceptance))
    if mismatched == 0:
        record(name, "PASS", f"{total} speculative runs token-identical to AR ({dtype}, {device}); "
                             f"same-draft acceptance min {min(same_acceptance):.3f}", **data)
    elif dtype == "bfloat16":
        record(name, "INFO", f"{mismatched}/{total} runs differ from AR in bf16 (numerics: verify runs K+1 rows); "
                             f"first: {first_bad[0]}", **data)
    else:
        record(name, "FAIL", f"{mismatched}/{total} runs differ from AR; first: {first_bad[0]}", **data)


def check_cpu_vs_device_ar(name, device, dirs):
    """float32 greedy AR on the device equals float32 greedy AR on the CPU (same weights)."""
    from verispec import LLM, SamplingParams

    if not device.startswith("cuda"):
        record(name, "SKIP", "device is the CPU")
        return
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    cpu = LLM(target=str(dirs["target"]), dtype="float32", device="cpu", progress=False)
    dev = LLM(target=str(dirs["target"]), dtype="float32", device=device, progress=False)
    diffs = []
    for prompt in ["Hello, world", "def f(x):\n    return", "The quick brown fox"]:
        a, b = cpu.generate(prompt, params).token_ids, dev.generate(prompt, params).token_ids
        if a != b:
            diffs.append(dict(prompt=prompt, first_diff_at=next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)))
    if diffs:
        record(name, "FAIL", f"{len(diffs)}/3 prompts differ between CPU and {device}: {diffs[0]}", diffs=diffs)
    else:
        record(name, "PASS", f"float32 greedy AR on {device} equals CPU on 3 prompts x 32 tokens")


# --------------------------------------------------------------------------------------------------
# b. chi-square

V16 = 16
PROMPT16 = [3, 1, 4, 1, 5, 9, 2, 6]
TINY16 = dict(vocab_size=V16, eos_token_id=None, num_hidden_layers=1, hidden_size=32, intermediate_size=64,
              num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)


def exact_joint16(hf_target, params):
    """[V, V, V] P(first three tokens) under AR sampling, from transformers' float32 logits on the CPU."""
    import torch

    from verispec.sampling import logits_to_probs

    table = {}
    with torch.no_grad():
        for d in range(3):
            hists = list(itertools.product(range(V16), repeat=d))
            logits = hf_target(torch.tensor([PROMPT16 + list(h) for h in hists])).logits[:, -1]
            table.update(zip(hists, logits))
    p1 = logits_to_probs(table[()].double(), params)
    p2 = logits_to_probs(torch.stack([table[(a,)] for a in range(V16)]).double(), params)
    p3 = logits_to_probs(torch.stack([table[h] for h in itertools.product(range(V16), repeat=2)]).double(), params)
    joint = (p1[:, None, None] * p2[:, :, None] * p3.reshape(V16, V16, V16)).numpy()
    return joint / joint.sum()


def draw16(llm, K, params, n, budget_s, first_seed=0):
    import dataclasses

    import numpy as np

    counts = np.zeros((V16, V16, V16), dtype=np.int64)
    accepted = drafted = done = 0
    t0 = time.perf_counter()
    for seed in range(first_seed, first_seed + n):
        out = llm.generate(PROMPT16, dataclasses.replace(params, max_new_tokens=K + 2, seed=seed),
                           method="draft", num_draft_tokens=K)
        a, b, c = out.token_ids[:3]
        counts[a, b, c] += 1
        accepted += out.stats["accepted_tokens"]
        drafted += out.stats["drafted_tokens"]
        done += 1
        if time.perf_counter() - t0 > budget_s:
            break
    return counts, accepted / max(drafted, 1), done, time.perf_counter() - t0


def cpu_variant_verify(bug):
    """exact_helpers.variant_verify (CPU-only code) run on CPU copies of the device tensors."""
    import torch

    from exact_helpers import variant_verify
    from verispec.spec.verify import Verdict

    inner = variant_verify(bug)
    gen = torch.Generator().manual_seed(12345)

    def verify(target_logits, draft_tokens, draft_probs, chain, generator, contexts=None):
        dev = target_logits.device
        v = inner(target_logits.cpu(), draft_tokens.cpu(), None if draft_probs is None else draft_probs.cpu(),
                  chain, gen, contexts)
        return Verdict(v.tokens.to(dev), v.num_accepted.to(dev))

    return verify


def check_chi_square(name, device, root, small):
    from exact_helpers import ALPHA, chi2_pvalue
    from tiny import make_hf_model
    import verispec.engine.engine as engine_module
    from verispec import LLM, SamplingParams

    target = make_hf_model("qwen2", 1, **TINY16)
    target.save_pretrained(str(root / "t16"), safe_serialization=True)
    make_hf_model("llama", 2, **TINY16).save_pretrained(str(root / "o16"), safe_serialization=True)
    params = SamplingParams(temperature=1.0)
    joint = exact_joint16(target, params)
    llm = LLM(target=str(root / "t16"), draft=str(root / "o16"), dtype="float32", device=device, draft_quant="none",
              progress=False)
    n, budget = (400, 60) if small else (8000, 50)
    counts, acceptance, done, secs = draw16(llm, 2, params, n, budget)
    p3, p2 = chi2_pvalue(counts, joint), chi2_pvalue(counts.sum(2), joint.sum(2))
    data = dict(draws=done, seconds=round(secs, 1), ms_per_generate=round(1e3 * secs / done, 2), p_joint3=p3,
                p_first2=p2, acceptance=acceptance, alpha=ALPHA)
    ok = p3 > ALPHA and p2 > ALPHA and 0.35 < acceptance < 0.75  # nan (too few draws) is not a pass
    record(name, "PASS" if ok else "FAIL", f"T=1 K=2 unrelated draft on {device}: {done} draws, p = {p3:.3g} (first "
           f"3 tokens, {V16 ** 3} cells) and {p2:.3g} (first 2), need > {ALPHA}; acceptance {acceptance:.3f} "
           f"(test bounds 0.35..0.75), {1e3 * secs / done:.1f} ms/generate", **data)

    # negative control: a verifier that accepts every draft must be rejected by the same statistic
    saved = engine_module.verify
    engine_module.verify = cpu_variant_verify("always_accept")
    try:
        n, budget = (300, 60) if small else (2000, 20)
        counts, acceptance, done, secs = draw16(llm, 2, params, n, budget, first_seed=10_000)
    finally:
        engine_module.verify = saved
    p3, p2 = chi2_pvalue(counts, joint), chi2_pvalue(counts.sum(2), joint.sum(2))
    rejected = p3 < ALPHA or p2 < ALPHA
    record(name + "/negative_control", "PASS" if rejected else "FAIL",
           f"always-accept verifier: {done} draws, p = {p3:.3g} (first 3 tokens) / {p2:.3g} (first 2): "
           f"{'rejected' if rejected else 'NOT rejected'} at {ALPHA}", draws=done, p_joint3=p3, p_first2=p2)


# --------------------------------------------------------------------------------------------------
# c. timings

TARGET_1P5B = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                   num_attention_heads=12, num_key_value_heads=2)
DRAFT_0P5B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2)
SMALL_TARGET = dict(vocab_size=2000, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=2)
SMALL_DRAFT = dict(vocab_size=2000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2)
QWEN2_COMMON = dict(model_type="qwen2", max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
                    tie_word_embeddings=False, hidden_act="silu", use_sliding_window=False, eos_token_id=None,
                    bos_token_id=None)


def own_random_model(shape: dict, dtype, device):
    """verispec's Transformer with N(0, 0.02) matrices (HF's initializer_range), built on the device."""
    import torch

    from verispec.models.config import ModelConfig
    from verispec.models.llama import Transformer, rope_inv_freq

    cfg = ModelConfig.from_hf({**QWEN2_COMMON, **shape})
    torch.manual_seed(0)
    with torch.device(device):
        model = Transformer(cfg)
    model = model.to(dtype).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.02)
            elif n.endswith("bias"):
                p.normal_(0, 0.02)
    model.inv_freq = rope_inv_freq(cfg).to(device)
    return model, cfg


def hf_random_model(shape: dict, dtype, device):
    """transformers' Qwen2ForCausalLM with its own random init on the device, and verispec's Transformer
    built from the very same tensors through the loader (models/loader.py build_model)."""
    import torch
    import transformers

    from verispec.models.config import ModelConfig
    from verispec.models.loader import build_model

    torch.manual_seed(0)
    hf_cfg = transformers.Qwen2Config(**{k: v for k, v in {**QWEN2_COMMON, **shape}.items() if k != "model_type"})
    with torch.device(device):
        hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype, attn_implementation="sdpa")
    hf = hf.to(device).eval()
    cfg = ModelConfig.from_hf(hf_cfg.to_dict())
    ours = build_model(cfg, ((k, t.detach()) for k, t in hf.state_dict().items()), dtype, device)
    return hf, ours, cfg


def fake_load(models: dict):
    """Replace verispec.llm.load so that LLM(target=NAME) takes an in-memory model (no files)."""
    import verispec.llm
    from verispec.models.loader import LoadedModel

    def load(source, dtype, device, progress=True, **_):  # weights=: these models are in memory already
        model, cfg = models[source]
        return LoadedModel(model, cfg, None, source)

    verispec.llm.load = load


def check_timings(name, device, small):
    import torch

    from verispec import LLM, SamplingParams
    from verispec.models.kv_cache import KVCache

    dtype = torch.bfloat16
    tshape, dshape = (SMALL_TARGET, SMALL_DRAFT) if small else (TARGET_1P5B, DRAFT_0P5B)
    ctx_len, new, reps = (300, 32, 3) if small else (300, 128, 3)
    timings: dict = {"context_tokens": ctx_len, "new_tokens": new, "dtype": "bfloat16",
                     "target_shape": tshape, "draft_shape": dshape}
    SUMMARY["timings"] = timings

    t0 = time.perf_counter()
    hf = None
    try:
        hf, target, tcfg = hf_random_model(tshape, dtype, device)
        timings["target_weights"] = "transformers Qwen2 random init (N(0, 0.02)), loaded through build_model"
    except Exception as e:  # noqa: BLE001
        record(name + "/hf_model", "INFO", f"transformers model not built ({type(e).__name__}: {e}); own init")
        target, tcfg = own_random_model(tshape, dtype, device)
        timings["target_weights"] = "verispec Transformer, N(0, 0.02) matrices"
    draft, dcfg = own_random_model(dshape, dtype, device)
    sync(device)
    timings["build_s"] = round(time.perf_counter() - t0, 1)
    if device.startswith("cuda"):
        timings["gpu_mem_allocated_gb"] = round(torch.cuda.memory_allocated() / 2**30, 2)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, tcfg.vocab_size, (1, ctx_len), generator=gen)
    prompt_dev = prompt.to(device)

    # 1. target forward over k new tokens, warm cache of ctx_len tokens (logits for all k rows, as a verify)
    def forward_ms(model, cfg, ks):
        cache = KVCache.for_model(cfg, 1, ctx_len + 32, dtype, device)
        model(prompt_dev, torch.arange(ctx_len, device=device)[None], cache, num_logits=1)
        extra = torch.randint(0, cfg.vocab_size, (1, 32), generator=gen).to(device)
        pos = torch.arange(ctx_len, ctx_len + 32, device=device)[None]
        out = {}
        for k in ks:
            def step():
                cache.truncate(ctx_len)
                model(extra[:, :k], pos[:, :k], cache)
            out[k] = round(1e3 * median_time(step, device, reps=15 if not small else 3, warmup=3), 3)
        return out

    fwd = forward_ms(target, tcfg, (1, 2, 4, 8, 16))
    timings["target_forward_ms"] = fwd
    dstep = forward_ms(draft, dcfg, (1,))[1]
    timings["draft_step_ms"] = dstep
    timings["c_draft_over_target_step"] = round(dstep / fwd[1], 3)
    bw = tcfg.weight_bytes(2) / (fwd[1] / 1e3) / 1e9
    timings["target_T1_effective_GBps"] = round(bw, 1)
    record(name + "/forward", "INFO", "target forward ms by k: " + ", ".join(f"{k}:{v}" for k, v in fwd.items())
           + f"; draft step {dstep} ms (c = {dstep / fwd[1]:.2f}); T=1 reads weights at {bw:.0f} GB/s")

    # 2. end to end: AR and speculative (draft = the same weights), new tokens after a ctx_len prompt
    fake_load({"target": (target, tcfg), "draft": (draft, dcfg)})
    llm = LLM(target="target", draft="target", dtype="bfloat16", device=device, draft_quant="none", progress=False)
    ids = prompt[0].tolist()
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)

    def e2e(method, K=4, n_reps=reps, warm_up=True):
        outs = []
        if warm_up:
            llm.generate(ids, params, method=method, num_draft_tokens=K)
        for _ in range(n_reps):
            sync(device)
            outs.append(llm.generate(ids, params, method=method, num_draft_tokens=K))
        best = sorted(outs, key=lambda o: o.stats["wall_s"])[len(outs) // 2]
        s = best.stats
        keep = ("tokens_per_s", "decode_ms_per_token", "prefill_s", "wall_s", "target_s", "draft_s",
                "acceptance_rate", "mean_accepted_length", "target_forwards")
        return best, {k: (round(s[k], 4) if isinstance(s[k], float) else s[k]) for k in keep if k in s}

    ar_out, timings["ar"] = e2e("ar")
    spec_out, timings["spec_same_K4"] = e2e("draft", 4)
    timings["spec_same_K4_speedup"] = round(timings["spec_same_K4"]["tokens_per_s"] / timings["ar"]["tokens_per_s"], 3)
    same_tokens = spec_out.token_ids == ar_out.token_ids
    timings["spec_same_K4_tokens_equal_ar"] = same_tokens
    record(name + "/e2e", "INFO",
           f"AR {timings['ar']['tokens_per_s']:.1f} tok/s ({timings['ar']['decode_ms_per_token']:.2f} ms/token), "
           f"spec same-draft K=4 {timings['spec_same_K4']['tokens_per_s']:.1f} tok/s "
           f"(alpha {timings['spec_same_K4'].get('acceptance_rate', 0):.3f}, "
           f"tau {timings['spec_same_K4']['mean_accepted_length']:.2f}, x{timings['spec_same_K4_speedup']:.2f}); "
           f"tokens equal AR: {same_tokens}")

    # speculative with the 0.5B-shaped random draft: cost of the loop when drafts are (almost) always rejected
    # (one run, no warm-up: both models already ran)
    llm2 = LLM(target="target", draft="draft", dtype="bfloat16", device=device, draft_quant="none", progress=False)
    llm = llm2
    spec_small, timings["spec_random_small_draft_K4"] = e2e("draft", 4, n_reps=1, warm_up=False)
    record(name + "/e2e_small_draft", "INFO",
           f"spec random 0.5B-shaped draft K=4: {timings['spec_random_small_draft_K4']['tokens_per_s']:.1f} tok/s, "
           f"alpha {timings['spec_random_small_draft_K4'].get('acceptance_rate', 0):.3f} "
           f"(random draft: a cost floor, not a speed claim); tokens equal AR: {spec_small.token_ids == ar_out.token_ids}")

    # 3. transformers on the same weights: logits of one prefill and greedy generation of `new` tokens
    if hf is None:
        record(name + "/transformers", "SKIP", "no transformers model")
        return
    with torch.inference_mode():
        ref = hf(prompt_dev).logits[0, -1].float()
        cache = KVCache.for_model(tcfg, 1, ctx_len, dtype, device)
        mine = target(prompt_dev, torch.arange(ctx_len, device=device)[None], cache, num_logits=1)[0][0, -1]
    diff = (ref - mine).abs().max().item()
    timings["prefill_logits_max_abs_diff_vs_hf"] = round(diff, 5)
    timings["prefill_logits_scale"] = round(ref.abs().max().item(), 4)
    timings["prefill_argmax_equal_hf"] = bool(ref.argmax() == mine.argmax())

    def hf_generate():
        with torch.inference_mode():
            return hf.generate(prompt_dev, attention_mask=torch.ones_like(prompt_dev), max_new_tokens=new,
                               min_new_tokens=new, do_sample=False, pad_token_id=0)

    hf_generate()
    hf_times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        hf_ids = hf_generate()
        sync(device)
        hf_times.append(time.perf_counter() - t0)
    hf_s = statistics.median(hf_times)
    hf_tokens = hf_ids[0, ctx_len:].tolist()
    agree = next((i for i, (a, b) in enumerate(zip(hf_tokens, ar_out.token_ids)) if a != b), len(hf_tokens))
    timings["hf_ar"] = dict(tokens_per_s=round(new / hf_s, 2), wall_s=round(hf_s, 4),
                            greedy_prefix_equal_to_verispec=agree)
    timings["verispec_ar_over_hf"] = round(timings["ar"]["tokens_per_s"] / (new / hf_s), 3)
    record(name + "/transformers", "INFO",
           f"transformers {transformers_version()} AR {new / hf_s:.1f} tok/s vs verispec AR "
           f"{timings['ar']['tokens_per_s']:.1f} (x{timings['verispec_ar_over_hf']:.2f}); prefill logits max|diff| "
           f"{diff:.4f} (scale {timings['prefill_logits_scale']}), argmax equal {timings['prefill_argmax_equal_hf']}; "
           f"greedy tokens agree for the first {agree}/{new}")


def transformers_version() -> str:
    try:
        import transformers

        return transformers.__version__
    except Exception:  # noqa: BLE001
        return "?"


# --------------------------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """Bad flags: one line and exit 2 (not verispec.flags.Parser: importing verispec would load the extension
    before --no-ext can block it)."""

    def error(self, message):
        print(f"gpu_check: error: {message}", file=sys.stderr)
        sys.exit(2)


def main() -> int:
    ap = _Parser(prog="scripts/gpu_check.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for gpu_check.json")
    ap.add_argument("--device", default="cuda", help="cuda[:N] (default; falls back to cpu without CUDA) or cpu")
    ap.add_argument("--small", action="store_true", help="small shapes and few draws: a quick logic check")
    ap.add_argument("--no-ext", action="store_true", help="block verispec._C, as where the build does not load")
    ap.add_argument("--only", default="abc", help="which checks to run: any of a, b, c (default abc)")
    args = ap.parse_args()
    if not args.only or set(args.only) - set("abc"):
        ap.error(f"--only takes letters out of a, b, c, got {args.only!r}")
    if args.device.split(":")[0] not in ("cuda", "cpu"):
        ap.error(f"--device must be cuda, cuda:N or cpu, got {args.device!r}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.no_ext:
        sys.meta_path.insert(0, _BlockExtension())
    t_start = time.perf_counter()
    device = args.device
    try:
        import torch

        if device.startswith("cuda") and not torch.cuda.is_available():
            print("no CUDA device: falling back to cpu", flush=True)
            device = "cpu"
        # tiny models: one intra-op thread (as in tests/conftest.py); more only spin on a shared CPU
        torch.set_num_threads(1 if device == "cpu" else min(torch.get_num_threads(), 4))
    except Exception as e:  # noqa: BLE001
        record("import_torch", "FAIL", f"{type(e).__name__}: {e}")
        device = "cpu"
    SUMMARY.update(argv=sys.argv, device=device, small=args.small)

    def save():
        SUMMARY["total_s"] = round(time.perf_counter() - t_start, 1)
        (out / "gpu_check.json").write_text(json.dumps(SUMMARY, indent=2, default=str))

    run_check("environment", check_environment, device)
    save()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if "a" in args.only:
            dirs = None
            try:
                dirs = tiny_dirs(root)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                record("a/tiny_models", "FAIL", f"{type(e).__name__}: {e}")
            if dirs is not None:
                for dtype in ("float32", "bfloat16"):
                    run_check(f"a/greedy_identity_{dtype}", check_greedy_identity, device, dtype, dirs, args.small)
                    save()
                run_check("a/ar_float32_device_equals_cpu", check_cpu_vs_device_ar, device, dirs)
                save()
        if "b" in args.only:
            run_check("b/chi_square", check_chi_square, device, root, args.small)
            save()
    if "c" in args.only:
        run_check("c/timings", check_timings, device, args.small)
        save()
    save()
    fails = [r["name"] for r in RESULTS if r["status"] == "FAIL"]
    print(f"done in {time.perf_counter() - t_start:.0f} s: {len(fails)} FAIL {fails}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
