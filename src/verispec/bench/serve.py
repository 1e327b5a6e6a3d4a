"""`verispec bench-serve`: a bounded, closed-loop load benchmark of the OpenAI server on the loopback interface.

Every mode (``--methods``: speculation off = ``ar``, on = ``auto`` ...) gets its own in-process server, ``create_app``
on the one LLM (weights load once) under uvicorn on 127.0.0.1 in a thread; or ``--url`` measures a server already
running. Per concurrency level, the modes take turns (level 1: ar then auto, level 2: ar then auto, ...) so the
spec-on/spec-off ratio at a level is measured minutes apart, not a whole sweep apart. A level runs ``c`` workers,
each streaming one chat completion after the other until the level's requests are done, and scrapes /metrics before
and after it. The client: serve_load.py; the results: serve_report.py (percentiles, garbled-text check, table, JSON,
PNG).

Before the sweep, the TTFT phase (serve_ttft.py): time to first token on one ~800-token prompt, ours against
llama.cpp (``--peers llamacpp``) on the same ids, interleaved. Before, not after: a peer that fails (or a prompt
that does not fit) shows in seconds, not after the sweep's minutes; the figure survives an interrupted sweep; the
peer's memory is released before the load starts. Its own warm-up covers the servers' first long prefill.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import socket
import sys
import threading
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

from ..errors import VerispecError
from .serve_load import headers
from .serve_ttft import check_ttft_args

DEFAULT_METHODS = "ar,auto"
DEFAULT_CONCURRENCY = "1,2,4,8,16"


def add_bench_serve_parser(sub) -> None:
    from ..flags import add_model_args, add_spec_args

    b = sub.add_parser("bench-serve", help="load benchmark of the HTTP server: a concurrency sweep with speculation "
                                           "on and off; throughput, TTFT / TPOT / ITL, a /metrics diff")
    add_model_args(b)
    b.add_argument("--methods", default=None, help=f"comma-separated modes, each on its own in-process server "
                                                   f"(default: {DEFAULT_METHODS}: speculation off and on)")
    b.add_argument("--num-draft-tokens", type=int, default=4, help="K: the most tokens a request drafts per step "
                                                                    "(default: 4)")
    add_spec_args(b)
    b.add_argument("--concurrency", default=DEFAULT_CONCURRENCY,
                   help=f"comma-separated levels: requests in flight (default: {DEFAULT_CONCURRENCY})")
    b.add_argument("--requests-per-level", type=int, default=None, metavar="N",
                   help="requests per level and mode (default: 2 x concurrency, at least 8)")
    b.add_argument("--max-tokens", type=int, default=64, help="max_tokens of every request (default: 64)")
    b.add_argument("--ignore-eos", action="store_true", help="every request runs to --max-tokens")
    b.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    b.add_argument("--seed", type=int, default=0, help="temperature > 0: request seed = seed + the prompt's index")
    b.add_argument("--prompts", default=None, help="JSONL prompt file, as for `verispec bench` (default: the "
                                                   "built-in suite); each prompt is one user message")
    b.add_argument("--categories", default=None, help="comma-separated categories (default: all, interleaved)")
    b.add_argument("--max-num-seqs", type=int, default=16, help="the servers' running batch (default: 16)")
    b.add_argument("--kv-cache-tokens", type=int, default=16384, help="the servers' paged KV cache (default: 16384)")
    b.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take (default: 600)")
    b.add_argument("--warmup", type=int, default=1, help="requests per mode before measuring, not counted "
                                                         "(default: 1)")
    b.add_argument("--url", default=None, help="benchmark the server running at this base URL instead (one mode; "
                                               "no model loads here)")
    b.add_argument("--model", default=None, help="--url: the model name to request (default: the first of /v1/models)")
    b.add_argument("--api-key", default=os.environ.get("VERISPEC_API_KEY"),
                   help="--url: Authorization: Bearer KEY (default: $VERISPEC_API_KEY)")
    b.add_argument("--ttft-prompt-tokens", type=int, default=800, metavar="N",
                   help="before the sweep, time to first token on one prompt of about N tokens (summarization and "
                        "RAG passages; Spec-Bench's size by default), through the first mode's server; 0 = off "
                        "(default: 800)")
    b.add_argument("--ttft-repeats", type=int, default=3, metavar="R", help="timed TTFT requests per side, after "
                                                                            "one warm-up (default: 3)")
    b.add_argument("--peers", default="none", choices=["none", "llamacpp"],
                   help="llamacpp = time the same TTFT prompt ids with llama.cpp on the same GGUF file, interleaved "
                        "with ours (needs llama-cpp-python; with --url, --target must be the server's model); none "
                        "(default)")
    b.add_argument("--out", default=None, metavar="DIR", help="write results.json (after every level) and "
                                                               "bench-serve.png here")


def int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise VerispecError(f"{flag} takes comma-separated integers, e.g. 1,2,4,8; got {text!r}") from None
    if not values or min(values) < 1 or len(set(values)) < len(values):
        raise VerispecError(f"{flag} takes distinct integers >= 1, got {text!r}")
    return values


def check_args(args) -> tuple[list[int], list[str] | None]:
    """The concurrency levels and the modes (None with --url); any bad flag is a VerispecError before work starts."""
    levels = int_list(args.concurrency, "--concurrency")
    for flag, value, low in (("--requests-per-level", args.requests_per_level, 1), ("--max-tokens", args.max_tokens, 1),
                             ("--max-num-seqs", args.max_num_seqs, 1), ("--kv-cache-tokens", args.kv_cache_tokens, 16),
                             ("--warmup", args.warmup, 0)):
        if value is not None and value < low:
            raise VerispecError(f"{flag} must be >= {low}, got {value}")
    if not args.timeout > 0:
        raise VerispecError(f"--timeout must be > 0, got {args.timeout}")
    if not 0 <= args.temperature <= 2:
        raise VerispecError(f"--temperature must be in 0..2, got {args.temperature}")
    check_ttft_args(args)
    if args.url is not None:
        if args.methods is not None:
            raise VerispecError("--methods runs in-process servers; --url measures the one server there")
        if not args.url.startswith(("http://", "https://")):
            raise VerispecError(f"--url takes http://HOST:PORT, got {args.url!r}")
        return levels, None
    modes = [m.strip() for m in (args.methods or DEFAULT_METHODS).split(",") if m.strip()]
    if not modes or len(set(modes)) < len(modes):
        raise VerispecError(f"--methods takes distinct methods, e.g. ar,auto; got {args.methods!r}")
    if max(levels) > 5 * args.max_num_seqs:  # the server queues 4 x max_num_seqs beyond the batch, then 429s
        raise VerispecError(f"--concurrency {max(levels)} is over 5 x --max-num-seqs ({args.max_num_seqs}): "
                            "the server would refuse requests")
    return levels, modes


def run_bench_serve(args) -> int:
    from .serve_load import sweep
    from .serve_report import finish_report, plot_or_note, print_table
    from .serve_ttft import measure_ttft, plan_ttft, source_codec, summarize_ttft, ttft_table

    levels, modes = check_args(args)
    missing = [m for m in ("httpx", "prometheus_client") + (() if args.url else ("uvicorn", "fastapi"))
               if importlib.util.find_spec(m) is None]
    if missing:
        raise VerispecError(f"verispec bench-serve needs {', '.join(missing)}: pip install 'verispec[serve]'")
    out = Path(args.out) if args.out else None
    if out is not None:
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise VerispecError(f"--out: cannot make the folder {out} ({e.strerror or e})") from None
    messages = prompt_messages(args)
    report = {"command": " ".join(["verispec", *sys.argv[1:]]) if Path(sys.argv[0]).name == "verispec" else None,
              "options": {k: v for k, v in vars(args).items() if k != "api_key"}, "time": time.strftime("%F %T"),
              "complete": False}
    records, level_runs = [], []

    def save() -> None:  # after every level: an interrupted run keeps what it measured
        finish_report(report, records, level_runs)
        if out is not None:
            (out / "results.json.tmp").write_text(json.dumps(report, indent=2))
            os.replace(out / "results.json.tmp", out / "results.json")

    with ExitStack() as stack:
        if args.url is None:
            from .cli import _native

            servers, llm = start_servers(args, modes, messages, stack)
            report.update(target=args.target, draft=llm.draft.source if llm.draft else None, model=args.target,
                          dtype=str(llm.dtype).removeprefix("torch."),
                          weights="native" if _native(llm.target.model) else "dequantized")
            context = min(llm.target.config.max_position_embeddings, args.kv_cache_tokens)
            ttft_prompts, peer = plan_ttft(args, llm.codec, context)
        else:
            model, context = check_url(args)
            servers, modes = {"url": (args.url.rstrip("/"), model)}, ["url"]
            report.update(url=args.url, model=model)
            known = args.ttft_prompt_tokens and model == args.target  # the tokenizer is --target's
            ttft_prompts, peer = plan_ttft(args, source_codec(args.target) if known else None, context, model)
        report.update(modes=modes, concurrency=levels, max_tokens=args.max_tokens, temperature=args.temperature,
                      num_prompts=len(messages), environment=environment(), ttft=None)
        try:
            if ttft_prompts:
                print(f"verispec: TTFT phase: {len(ttft_prompts[0][1])}-token prompt, {args.ttft_repeats} repeat(s) "
                      f"through {modes[0]}" + (", interleaved with llama.cpp" if peer else ""), file=sys.stderr)
                trials = asyncio.run(measure_ttft(args, *servers[modes[0]], ttft_prompts, peer))
                report["ttft"], peer = summarize_ttft(args, trials, modes[0]), None  # the peer's memory goes
                save()
            asyncio.run(sweep(args, servers, modes, levels, messages, records, level_runs, save))
        except KeyboardInterrupt:
            print(f"verispec: interrupted after {len(level_runs)} level run(s); reporting those", file=sys.stderr)
        else:
            report["complete"] = True
    save()
    if out is not None and level_runs:
        plot_or_note(report, out / "bench-serve.png")
    print_table(report)
    if report["ttft"]:
        print(("\n" if report["levels"] else "") + ttft_table(report["ttft"]))
    if not report["complete"]:
        return 130
    return 1 if any(lv["failed"] or lv["garbled"] for lv in report["levels"]) else 0


def prompt_messages(args) -> list[tuple[str, list[dict]]]:
    """(prompt id, chat messages) for the prompts chosen, categories interleaved."""
    from .prompts import builtin_suite, load_prompts, select

    prompts = load_prompts(args.prompts) if args.prompts else builtin_suite()
    cats = [c.strip() for c in args.categories.split(",") if c.strip()] if args.categories else None
    return [(p.id, [{"role": "user", "content": p.text}]) for p in select(prompts, cats)]


def environment() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    from .hardware import environment as machine

    env = machine()
    for pkg in ("httpx", "uvicorn", "fastapi", "prometheus-client", "llama-cpp-python"):
        try:
            env[pkg] = version(pkg)
        except PackageNotFoundError:
            env[pkg] = None
    return env


def start_servers(args, modes: list[str], messages: list, stack: ExitStack) -> tuple[dict, object]:
    """Load the LLM once, drop prompts that do not fit its context, start one server per mode: {mode: (url, name)}."""
    from .. import LLM, drafters
    from ..flags import engine_options, spec_options
    from ..server import create_app

    for mode in modes:
        drafters.check_method(mode)
    llm = LLM(**engine_options(args))
    context = min(llm.target.config.max_position_embeddings, args.kv_cache_tokens)
    fits = [(pid, msgs) for pid, msgs in messages if len(llm.codec.encode(msgs)) + args.max_tokens <= context]
    if not fits:
        raise VerispecError(f"no prompt fits the context ({context} tokens) with --max-tokens {args.max_tokens}")
    if len(fits) < len(messages):
        print(f"verispec: skipping {len(messages) - len(fits)} prompt(s) longer than the context ({context} tokens) "
              f"with {args.max_tokens} new tokens", file=sys.stderr)
    messages[:] = fits
    servers = {}
    for mode in modes:
        app = create_app(llm, args.target, method=mode, num_draft_tokens=args.num_draft_tokens,
                         spec_options=spec_options(args), max_num_seqs=args.max_num_seqs,
                         kv_cache_tokens=args.kv_cache_tokens)
        servers[mode] = (stack.enter_context(serving(app)), args.target)
    return servers, llm


@contextmanager
def serving(app):
    """Serve ``app`` with uvicorn on 127.0.0.1 (a free port) in a thread until the block ends; yields the URL."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="bench-serve-http")
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise VerispecError("the in-process server did not start")
            time.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def check_url(args) -> tuple[str, int]:
    """The model to request from --url (--model, else the first /v1/models lists) and its context (max_model_len,
    else unbounded); an unreachable server is an error."""
    import httpx

    url = args.url.rstrip("/")
    try:
        r = httpx.get(f"{url}/v1/models", headers=headers(args), timeout=10, trust_env=False)
    except httpx.HTTPError as e:
        raise VerispecError(f"--url: cannot reach {url} ({type(e).__name__}: {e})") from None
    if r.status_code != 200:
        raise VerispecError(f"--url: GET {url}/v1/models answered {r.status_code}: {r.text[:200]!r}")
    try:
        cards = {c["id"]: c for c in r.json()["data"]}
    except (ValueError, KeyError, TypeError):
        cards = {}
    model = args.model or next(iter(cards), None)
    if model is None:
        raise VerispecError(f"--url: {url}/v1/models lists no model; give --model")
    context = (cards.get(model) or {}).get("max_model_len")
    return model, context if isinstance(context, int) else sys.maxsize
