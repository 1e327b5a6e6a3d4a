"""`verispec bench`: per-category acceptance and speedup of every method against our own AR, with
transformers' ``generate()`` (plain, ``assistant_model=``, ``prompt_lookup_num_tokens=``) in the same run.

Per prompt, interleaved: our AR (the baseline), the transformers peers, then every speculative method
at every K; one warm-up each first. Speedup = AR wall time / method wall time for the same prompt,
prefill included; medians per category and overall. A draft model may start from its KV cache of the prompt
before, as far as the two prompts agree (the chat template's system prompt), as a server's would; never from
the same prompt's earlier runs. The JSON report is rewritten after every prompt,
so an interrupted run keeps what it measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

from ..errors import VerispecError


def add_bench_parser(sub) -> None:
    from ..flags import add_model_args

    b = sub.add_parser("bench", help="per-category acceptance and speedup of speculative methods, peers side by side")
    add_model_args(b, compare_draft_quant=True)
    b.add_argument("--methods", default=None,
                   help="comma-separated: ar plus speculative methods (default: ar and every available one)")
    b.add_argument("--num-draft-tokens", default="4", help="K for speculative methods: one value or a list, e.g. 2,4,6,8 "
                                                          "(adaptive runs and auto use the largest as their maximum)")
    b.add_argument("--adaptive", action="store_true",
                   help="run each method both with fixed K (METHOD:K=k) and adaptive K (METHOD:K<=max), not only as "
                        "it runs by default (fixed K for draft and ngram, adaptive for the draft heads)")
    b.add_argument("--min-draft-tokens", type=int, default=1, help="smallest K an adaptive round may use")
    b.add_argument("--early-stop", default="on", choices=["on", "off", "both"],
                   help="draft-model rounds end early when the draft is unsure (on, the default); off: always K; "
                        "both: run each draft-model method both ways (off labelled METHOD:K=k:full)")
    b.add_argument("--ngram-max", type=int, default=4, help="n-gram lookup: longest suffix tried first")
    b.add_argument("--ngram-min", type=int, default=1, help="n-gram lookup: shortest suffix that may match")
    b.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    b.add_argument("--top-k", type=int, default=0, help="0 = off")
    b.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
    b.add_argument("--seed", type=int, default=0, help="sampling seed (temperature > 0)")
    b.add_argument("--max-new-tokens", type=int, default=64)
    b.add_argument("--prompts", default=None, help="JSONL prompt file: verispec {id, category, prompt}, Spec-Bench "
                                                    "question.jsonl or SPEED-Bench (default: the built-in suite)")
    b.add_argument("--categories", default=None, help="comma-separated categories to run (default: all)")
    b.add_argument("--limit-per-category", type=int, default=None, help="at most N prompts per category")
    b.add_argument("--limit", type=int, default=None, help="at most N prompts in all (categories interleaved)")
    b.add_argument("--peers", default="hf", type=_peer_list,
                   help="comma-separated peers run on the same prompts: hf = transformers generate() (plain, "
                        "assistant_model=, prompt_lookup_num_tokens=), llamacpp = llama.cpp on the same GGUF file "
                        "(plain, prompt lookup; needs llama-cpp-python); none (default: hf)")
    b.add_argument("--peer-timeout", type=float, default=600.0,
                   help="seconds one peer run may take; past it, or when a peer fails on a prompt, the failure is "
                        "recorded for that prompt and peer and the run goes on (default: 600)")
    chat = b.add_mutually_exclusive_group()
    chat.add_argument("--chat", dest="chat", action="store_true", default=None,
                      help="apply the tokenizer's chat template (default: on when the tokenizer has one)")
    chat.add_argument("--no-chat", dest="chat", action="store_false", help="feed prompts as raw text")
    b.add_argument("--json", dest="json_out", default=None, help="write the report here (rewritten after every prompt)")
    b.add_argument("--plot", default=None, help="write a PNG: speedup per category, per-position acceptance, tau")
    b.add_argument("--quick", action="store_true", help="one prompt per category, 32 new tokens (a few minutes)")


PEERS = ("hf", "llamacpp")


def _peer_list(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    if names == ["none"]:
        return []
    bad = [n for n in names if n not in PEERS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown peer {bad[0] if bad else text!r} (choose from {', '.join(PEERS)}, "
                                         "comma-separated, or none)")
    return list(dict.fromkeys(names))


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise VerispecError(f"{flag} takes integers, e.g. 2,4,6,8; got {text!r}") from None
    if not values or min(values) < 1:
        raise VerispecError(f"{flag} values must be >= 1, got {text!r}")
    return values


def _prompts(args):
    from .prompts import builtin_suite, load_prompts, select

    for flag, value in (("--limit-per-category", args.limit_per_category), ("--limit", args.limit)):
        if value is not None and value < 1:
            raise VerispecError(f"{flag} must be >= 1, got {value}")
    prompts = load_prompts(args.prompts) if args.prompts else builtin_suite()
    cats = [c.strip() for c in args.categories.split(",") if c.strip()] if args.categories else None
    per_cat = 1 if args.quick and args.limit_per_category is None else args.limit_per_category
    return select(prompts, cats, per_cat)[: args.limit]


def _spec_runs(args, llm) -> list[tuple]:
    from .. import drafters
    from ..config import SpecConfig

    opts = dict(min_draft_tokens=args.min_draft_tokens, ngram_min=args.ngram_min, ngram_max=args.ngram_max,
                early_stop=args.early_stop != "off")
    ks = _int_list(args.num_draft_tokens, "--num-draft-tokens")
    SpecConfig("check", max(ks), **opts)  # bad option values: a one-line error before anything loads
    if args.methods is None:  # ar plus every speculative method whose drafter can be built here
        names = []
        for name, make in drafters.METHODS.items():
            try:
                make(llm, SpecConfig(name, max(ks), **opts))
                names.append(name)
            except VerispecError:
                pass
    else:
        names = [m.strip() for m in args.methods.split(",") if m.strip()]
        unknown = [m for m in names if m != "ar" and m not in drafters.METHODS]
        if unknown or "ar" not in names:
            raise VerispecError(f"--methods must include ar and may add {', '.join(drafters.METHODS)}; "
                                f"got {args.methods!r}")
        names = [m for m in names if m != "ar"]
    formats = args.draft_quant.split(",")
    # one LLM per draft format, sharing the target; the first is ``llm`` itself
    variants = [(fmt, llm if i == 0 else llm.with_draft_quant(fmt)) for i, fmt in enumerate(formats)]
    runs = []  # (label, SpecConfig, LLM): fixed K per value; adaptive (and self-adapting drafters) up to the largest
    for name in names:
        for fmt, owner in variants:
            # building it loads the draft model now, not inside a timed run; errors surface here
            drafter = drafters.METHODS[name](owner, SpecConfig(name, max(ks), **opts))
            uses_draft = _uses_draft_model(drafter)
            if fmt != formats[0] and not uses_draft:
                continue  # the draft format changes nothing for this method: one run is enough
            tag = f"{name}@{fmt}" if len(formats) > 1 and uses_draft else name
            # each method as it runs by default (fixed K per value, or adaptive up to the largest); --adaptive: both
            by_default = drafter.adaptive or drafter.adaptive_by_default
            labelled = [] if drafter.adaptive or (by_default and not args.adaptive) else \
                [(f"{tag}:K={k}", SpecConfig(name, k, adaptive=False, **opts)) for k in ks]
            if by_default or args.adaptive:
                labelled.append((f"{tag}:K<={max(ks)}", SpecConfig(name, max(ks), adaptive=True, **opts)))
            if args.early_stop == "both" and _stops_early(drafter):
                labelled += [(f"{label}:full", dataclasses.replace(spec, early_stop=False)) for label, spec in labelled]
            runs += [(label, spec, owner) for label, spec in labelled]
    return runs


def _drafters(drafter) -> tuple:
    """The drafter and the ones it delegates to (auto)."""
    return (drafter, *drafter.delegates().values())


def _uses_draft_model(drafter) -> bool:
    from ..drafters import DraftModelDrafter

    return any(isinstance(d, DraftModelDrafter) for d in _drafters(drafter))


def _stops_early(drafter) -> bool:
    """Whether the drafter, or one it delegates to (auto), ends rounds early (DraftModelDrafter.early_stop)."""
    return any(d.early_stop for d in _drafters(drafter))


def _native(model) -> list:
    """The model's matrices kept in GGUF blocks (weights="native")."""
    return [m.native for m in model.modules() if getattr(m, "native", None) is not None]


def run_bench(args) -> int:
    import torch
    from tqdm import tqdm

    from .. import LLM, SamplingParams
    from ..flags import engine_options
    from . import peer_llamacpp
    from .hardware import environment, read_bandwidth_gbs
    from .peers import HFPeer
    from .report import markdown, summarize
    from ..models.kv_cache import common_prefix
    from .runner import peer_error, run_prompt, verify_cost_curve

    n_new = 32 if args.quick else args.max_new_tokens
    if n_new < 2:
        raise VerispecError("--max-new-tokens must be >= 2 for a decode benchmark")
    if not args.peer_timeout > 0:
        raise VerispecError(f"--peer-timeout must be > 0 seconds, got {args.peer_timeout}")
    _int_list(args.num_draft_tokens, "--num-draft-tokens")  # bad values: an error before anything loads
    params = SamplingParams(max_new_tokens=n_new, ignore_eos=True, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed)
    prompts = _prompts(args)
    if args.plot and importlib.util.find_spec("matplotlib") is None:  # fail before the long run, not after
        raise VerispecError("--plot needs matplotlib: pip install 'verispec[bench]'")
    llm = LLM(**engine_options(args))
    if not llm.codec.has_tokenizer:
        raise VerispecError("the benchmark needs a model with a tokenizer")
    spec_runs = _spec_runs(args, llm)
    has_template = bool(getattr(llm.codec.tok, "chat_template", None))
    if args.chat and not has_template:
        raise VerispecError(f"--chat: {args.target} has no chat template")
    chat = has_template if args.chat is None else args.chat
    context = llm.target.config.max_position_embeddings
    encoded = [llm.codec.encode(p.text, chat=chat) for p in prompts]
    fits = [(p, ids) for p, ids in zip(prompts, encoded) if len(ids) + n_new <= context]
    if not fits:
        raise VerispecError(f"no prompt fits the target's context ({context} tokens) with {n_new} new tokens")
    if len(fits) < len(prompts):
        skipped = sorted({p.id for p in prompts} - {p.id for p, _ in fits})
        print(f"verispec: skipping {len(skipped)} prompt(s) longer than the context ({context} tokens) with "
              f"{n_new} new tokens: {', '.join(skipped[:5])}{', ...' if len(skipped) > 5 else ''}", file=sys.stderr)
    prompts, encoded = [p for p, _ in fits], [ids for _, ids in fits]
    masked = [] if llm.logit_mask is None else llm.logit_mask.nonzero().flatten().tolist()
    peers = []
    if "hf" in args.peers:
        draft_src = llm.draft.source if llm.draft is not None else None
        peers.append(HFPeer(args.target, llm.dtype, llm.device, masked, draft=draft_src, timeout=args.peer_timeout))
    if "llamacpp" in args.peers:
        context = peer_llamacpp.context_for(max(len(ids) for ids in encoded), n_new)  # the longest prompt + new tokens
        peers.append(peer_llamacpp.LlamaCppPeer(args.target, torch.get_num_threads(), context=context,
                                                timeout=args.peer_timeout))

    bandwidths = [read_bandwidth_gbs(device=llm.device)]  # measured again at the end: the best is the floor
    curve = verify_cost_curve(llm)
    warm = SamplingParams(max_new_tokens=4, ignore_eos=True)
    llm.generate(encoded[0], warm)
    for _, spec, owner in spec_runs:
        owner.generate(encoded[0], warm, **dataclasses.asdict(spec))
    for peer in peers:
        for mode in peer.modes:
            try:
                peer.generate(encoded[0], 4, mode)
            except Exception as e:  # its runs record their own failures
                print(f"verispec: peer {mode} failed its warm-up: {peer_error(e)}", file=sys.stderr)

    report = {
        "command": "verispec " + " ".join(sys.argv[1:]) if Path(sys.argv[0]).name == "verispec" else None,
        "target": args.target, "draft": llm.draft.source if llm.draft else None,
        "dtype": str(llm.dtype).removeprefix("torch."),
        "draft_quant": args.draft_quant, "weights": "native" if _native(llm.target.model) else "dequantized",
        "draft_weights": args.draft_weights, "draft_vocab": llm.draft_vocab_rows, "device": llm.device, "max_new_tokens": n_new,
        "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "seed": args.seed, "chat": chat,
        "prompts": args.prompts or "built-in suite", "num_prompts": len(prompts),
        "environment": environment(), "time": time.strftime("%Y-%m-%d %H:%M:%S"), "complete": False,
        "runs": [], "peer_runs": [],
    }
    weight_bytes = llm.target.config.weight_bytes(llm.dtype.itemsize)
    native = _native(llm.target.model)
    # GGUF blocks read as they are (weights="native"): their own bytes instead of dtype's
    weight_bytes += sum(w.nbytes - w.out_features * w.in_features * llm.dtype.itemsize for w in native)

    def finish(final: bool) -> None:
        if not report["runs"]:
            return
        report["summary"], report["peers"] = summarize(report["runs"], report["peer_runs"], weight_bytes, bandwidths,
                                                       curve, greedy=params.greedy)
        if args.json_out:  # atomic rewrite: an interrupt never leaves half a file
            tmp = Path(args.json_out + ".tmp")
            tmp.write_text(json.dumps(report, indent=2))
            os.replace(tmp, args.json_out)
        if final and args.plot:
            from .plot import plot_report

            plot_report(report, args.plot)

    try:
        for i, (p, ids) in enumerate(tqdm(list(zip(prompts, encoded)), desc="bench", unit="prompt", file=sys.stderr)):
            shared = common_prefix(ids, encoded[i - 1]) if i else 0  # the draft's cache may keep this much
            runs, peer_runs = run_prompt(llm, p, ids, params, spec_runs, peers, shared)
            report["runs"] += runs
            report["peer_runs"] += peer_runs
            finish(final=False)
    except KeyboardInterrupt:
        print(f"verispec: interrupted after {len({r['prompt_id'] for r in report['runs']})} of {len(prompts)} "
              "prompts; reporting those", file=sys.stderr)
    else:
        report["complete"] = True
        bandwidths.append(read_bandwidth_gbs(device=llm.device))
    finish(final=True)
    if report["runs"]:
        print(markdown(report))
    return 0 if report["complete"] else 130
