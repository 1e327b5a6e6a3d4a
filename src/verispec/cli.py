"""`verispec` command line: generate, serve, models list/pull, bench, bench-serve, train-head, distill.

Bad input ends in one line on stderr ("verispec: error: ...") and exit status 2; no tracebacks
(set VERISPEC_DEBUG=1 to see one for an unexpected internal error).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .errors import VerispecError
from .flags import (EXIT_USAGE, Parser, add_model_args, add_sampling_args, add_spec_args, engine_options,
                    spec_options)

def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="verispec", description="Lossless speculative decoding for LLMs.")
    sub = parser.add_subparsers(dest="command", parser_class=Parser)

    g = sub.add_parser("generate", help="generate a completion")
    g.add_argument("prompt", nargs="?", help="prompt text ('-' reads stdin); leave out with --messages")
    add_model_args(g)
    g.add_argument("--method", default="auto", help="decoding method: auto (default: per round the best of the drafters "
                                                     "below that can run here, or none), ar (plain decoding), draft (a draft "
                                                     "model proposes), ngram (lookup in prompt + output), eagle (a draft head "
                                                     "on the target's hidden states)")
    g.add_argument("--num-draft-tokens", type=int, default=4,
                   help="K: tokens drafted per round (default: 4; with adaptive K, the heads' default, the most a round "
                        "may draft)")
    add_spec_args(g)
    add_sampling_args(g)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable; \\n, \\t are escapes)")
    g.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    g.add_argument("--system", default=None, help="system message for --chat")
    g.add_argument("--messages", default=None, metavar="FILE",
                   help='a conversation instead of a prompt: a JSON list of {"role": "system" | "user" | "assistant", '
                        '"content": ...} ending with the user\'s, put through the chat template (\'-\' reads stdin)')
    g.add_argument("--json", action="store_true", help='print {"text", "token_ids", "stats"} as the last line')
    g.add_argument("--presence-penalty", type=float, default=0.0, help="-2..2, once per token the output holds")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="-2..2, per occurrence in the output")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="> 0, on tokens of prompt and output (1 = off)")
    g.add_argument("--min-p", type=float, default=0.0, help="0..1: drop tokens under min-p x the likeliest's probability")
    g.add_argument("--logit-bias", action="append", default=[], metavar="ID=VALUE",
                   help="add VALUE (-100..100) to token ID's logit (repeatable)")
    fmt = g.add_mutually_exclusive_group()
    fmt.add_argument("--json-object", action="store_true", help="the output is one JSON object (a grammar mask: exact "
                                                                 "under every method)")
    fmt.add_argument("--json-schema", default=None, metavar="FILE",
                     help="the output is JSON matching the schema in FILE (a JSON schema, or OpenAI's "
                          '{"name": ..., "schema": {...}})')
    g.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="each new token's log-probability and its row's N likeliest tokens (0-20): in --json's "
                        '"logprobs", else one line a token on stderr')
    g.add_argument("--no-stream", action="store_true", help="print the text at the end instead of streaming")

    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with continuous batching (the serve extra)")
    add_model_args(s)
    s.add_argument("--method", default="auto", help="decoding method per request: auto (default), ar, draft, ngram, "
                                                     "eagle (as for generate)")
    s.add_argument("--num-draft-tokens", type=int, default=4, help="K: the most tokens a request drafts per step "
                                                                    "(default: 4)")
    add_spec_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="default: 8000")
    s.add_argument("--max-num-seqs", type=int, default=16, help="requests in the running batch (default: 16); "
                                                                 "4x as many more wait, beyond that: 429")
    s.add_argument("--kv-cache-tokens", type=int, default=16384,
                   help="paged KV cache size in tokens, shared by all requests (default: 16384)")
    s.add_argument("--api-key", default=os.environ.get("VERISPEC_API_KEY"),
                   help="require Authorization: Bearer KEY on /v1 (default: $VERISPEC_API_KEY, else none)")
    s.add_argument("--served-model-name", default=None, help="the model name clients use (default: --target)")
    s.add_argument("--ray-replicas", type=int, default=0, metavar="N",
                   help="serve N copies of the engine behind Ray Serve's proxy on --host/--port, each loading its "
                        "own weights on its share of the CPUs (the ray extra; default: 0, no Ray)")
    s.add_argument("--ray-max-replicas", type=int, default=None, metavar="M",
                   help="with --ray-replicas N: autoscale between N and M (> N) replicas on ongoing requests "
                        "(about --max-num-seqs / 2 per replica)")

    m = sub.add_parser("models", help="list or pull the default models")
    msub = m.add_subparsers(dest="models_command", parser_class=Parser)
    msub.add_parser("list", help="names, sizes, cached or not")
    pull = msub.add_parser("pull", help="assemble, verify and convert a default model")
    pull.add_argument("name")

    from .bench.cli import add_bench_parser

    add_bench_parser(sub)
    from .bench.serve import add_bench_serve_parser

    add_bench_serve_parser(sub)
    from .training.cli import add_train_parser

    add_train_parser(sub)
    from .training.distill import add_distill_parser

    add_distill_parser(sub)
    return parser


def unescape(text: str) -> str:
    """Shell-typed stop strings: "\\n", "\\t", "\\r" and "\\\\" mean newline, tab, CR, backslash."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "\\" and i + 1 < len(text) and text[i + 1] in "ntr\\":
            out.append({"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}[text[i + 1]])
            i += 2
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def logit_bias(pairs: list[str]) -> dict[int, float]:
    """--logit-bias ID=VALUE, repeated -> {ID: VALUE}; one line naming the bad one."""
    out = {}
    for pair in pairs:
        token, _, value = pair.partition("=")
        try:
            out[int(token)] = float(value)
        except ValueError:
            raise VerispecError(f"--logit-bias takes ID=VALUE, got {pair!r}") from None
    return out


def response_format(args) -> dict | None:
    """--json-object / --json-schema FILE -> SamplingParams.response_format (checked there, before a model loads)."""
    if args.json_object:
        return {"type": "json_object"}
    if args.json_schema is None:
        return None
    try:
        schema = json.loads(Path(args.json_schema).read_text(encoding="utf-8"))
    except OSError as e:
        raise VerispecError(f"--json-schema: cannot read {args.json_schema} ({e.strerror or e})") from None
    except (UnicodeError, ValueError) as e:
        raise VerispecError(f"--json-schema: {args.json_schema} is not a JSON file "
                            f"({str(e).splitlines()[0]})") from None
    if not isinstance(schema, dict):
        raise VerispecError(f"--json-schema: {args.json_schema} must hold a JSON object (a schema)")
    if isinstance(schema.get("schema"), dict):  # OpenAI's json_schema object: {"name": ..., "schema": {...}}
        return {"type": "json_schema", "json_schema": schema}
    return {"type": "json_schema", "json_schema": {"name": Path(args.json_schema).stem, "schema": schema}}


def cmd_generate(args) -> int:
    from . import LLM, SamplingParams

    prompt = read_prompt(args)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, stop=[unescape(s) for s in args.stop],
                            logprobs=args.logprobs, presence_penalty=args.presence_penalty,
                            frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty,
                            min_p=args.min_p, logit_bias=logit_bias(args.logit_bias),
                            response_format=response_format(args))
    llm = LLM(**engine_options(args))
    kw = dict(method=args.method, num_draft_tokens=args.num_draft_tokens, chat=args.chat, system=args.system,
              **spec_options(args))
    if args.json or args.no_stream or not llm.codec.has_tokenizer:
        out = llm.generate(prompt, params, **kw)
        if not args.json:
            print(out.text)
    else:
        for piece in llm.stream(prompt, params, **kw):
            print(piece, end="", flush=True)
        print()
        out = llm.last_output
    logprobs = None if out.logprobs is None else [
        {"token": lp.token, "text": llm.codec.decode([lp.token]), "logprob": lp.logprob,
         "top_logprobs": [{"token": t, "text": llm.codec.decode([t]), "logprob": v} for t, v in lp.top]}
        for lp in out.logprobs]
    if args.json:
        print(json.dumps({"text": out.text, "token_ids": out.token_ids, "stats": out.stats}
                         | ({"logprobs": logprobs} if logprobs is not None else {})))
    else:
        for lp in logprobs or []:
            top = "  ".join(f"{t['text']!r} {t['logprob']:.3f}" for t in lp["top_logprobs"])
            print(f"{lp['text']!r}\t{lp['logprob']:.4f}" + (f"\t[{top}]" if top else ""), file=sys.stderr)
        s = out.stats
        spec = (f", tau {s['mean_accepted_length']:.2f}, alpha {s['acceptance_rate']:.2f}"
                if "acceptance_rate" in s else "")
        print(f"[{args.method}: {s['new_tokens']} tokens, {s['tokens_per_s']:.2f} tok/s, prefill {s['prefill_s']:.2f}s, "
              f"{s['decode_ms_per_token']:.1f} ms/token{spec}, stop: {out.finish_reason}]", file=sys.stderr)
    return 0


def cmd_serve(args) -> int:
    from .config import SpecConfig

    if not 1 <= args.port <= 65535:
        raise VerispecError(f"--port must be in 1..65535, got {args.port}")
    if args.max_num_seqs < 1 or args.kv_cache_tokens < 16:
        raise VerispecError(f"need --max-num-seqs >= 1 and --kv-cache-tokens >= 16, got {args.max_num_seqs}, "
                            f"{args.kv_cache_tokens}")
    if args.api_key is not None and not args.api_key.strip():
        raise VerispecError("--api-key is empty")
    if args.ray_replicas < 0:
        raise VerispecError(f"--ray-replicas must be >= 0, got {args.ray_replicas}")
    if args.ray_max_replicas is not None and not 0 < args.ray_replicas < args.ray_max_replicas:
        raise VerispecError(f"--ray-max-replicas M needs --ray-replicas N >= 1 and M > N, got N={args.ray_replicas}, "
                            f"M={args.ray_max_replicas}")
    SpecConfig(args.method, args.num_draft_tokens, **spec_options(args))
    try:
        import uvicorn

        from .server import create_app
    except ImportError as e:
        raise VerispecError(f"verispec serve needs {e.name}: pip install 'verispec[serve]'") from None
    from .drafters import check_method
    from .llm import LLM

    check_method(args.method)
    app_options = dict(method=args.method, num_draft_tokens=args.num_draft_tokens, spec_options=spec_options(args),
                       max_num_seqs=args.max_num_seqs, kv_cache_tokens=args.kv_cache_tokens, api_key=args.api_key)
    if args.ray_replicas:
        return serve_on_ray(args, app_options)
    llm = LLM(**engine_options(args))
    app = create_app(llm, args.served_model_name or args.target, **app_options)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0


def serve_on_ray(args, app_options: dict) -> int:
    """`verispec serve --ray-replicas N`: the same app in N Ray Serve replicas (server/ray_serve.py)."""
    try:
        import ray.serve  # noqa: F401

        from .server import ray_serve
    except ImportError as e:
        if not (e.name or "").startswith("ray"):
            raise
        raise VerispecError("verispec serve --ray-replicas needs ray: pip install 'verispec[ray]'") from None
    ray_serve.run(engine_options(args), args.served_model_name or args.target, app_options,
                  replicas=args.ray_replicas, max_replicas=args.ray_max_replicas, host=args.host, port=args.port)
    return 0


def read_prompt(args) -> str | list[dict]:
    """The prompt text, or the --messages conversation."""
    from .tokenizer import check_messages

    if args.messages is None:
        if args.prompt is None:
            raise VerispecError("give a prompt (or --messages FILE)")
        prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
        if not prompt.strip():
            raise VerispecError("empty prompt")
        return prompt
    if args.prompt is not None:
        raise VerispecError("give a prompt or --messages, not both")
    try:
        text = sys.stdin.read() if args.messages == "-" else Path(args.messages).read_text(encoding="utf-8")
        messages = json.loads(text)
    except OSError as e:
        raise VerispecError(f"--messages: cannot read {args.messages} ({e.strerror or e})") from None
    except (UnicodeError, ValueError) as e:
        raise VerispecError(f"--messages: {args.messages} is not a JSON file ({str(e).splitlines()[0]})") from None
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise VerispecError('--messages: expected a JSON list of {"role": ..., "content": ...} messages')
    return check_messages(messages)  # before any model loads


def cmd_models(args) -> int:
    from .models import registry

    if args.models_command == "pull":
        path = registry.pull(args.name)
        print(f"{args.name}: {path}")
        return 0
    if args.models_command not in (None, "list"):
        raise VerispecError(f"unknown models command {args.models_command!r}")
    print(f"{'name':32} {'gguf':>9} {'converted':>10}  {'cached':6}  source")
    for e in registry.REGISTRY.values():
        cached = registry.is_cached(e.name)
        conv = registry.dir_size(registry.model_dir(e.name)) if cached else 0
        print(f"{e.name:32} {e.gguf_bytes / 2**30:8.2f}G {(f'{conv / 2**30:.2f}G' if cached else '-'):>10}  "
              f"{'yes' if cached else 'no':6}  {e.upstream}")
    print(f"cache: {registry.cache_dir()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help()
            return EXIT_USAGE
        handler = {"generate": cmd_generate, "serve": cmd_serve, "models": cmd_models, "bench": _bench,
                   "train-head": _train_head, "bench-serve": cmd_bench_serve, "distill": _distill}[args.command]
        return handler(args)
    except VerispecError as e:
        print(f"verispec: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("verispec: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a bug, not bad input: still one line unless debugging
        if os.environ.get("VERISPEC_DEBUG"):
            raise
        msg = str(e).strip().splitlines()
        print(f"verispec: internal error: {type(e).__name__}: {msg[0] if msg else ''} "
              f"(set VERISPEC_DEBUG=1 for a traceback)", file=sys.stderr)
        return 1


def _train_head(args) -> int:
    from .training.cli import run_train

    return run_train(args)


def _distill(args) -> int:
    from .training.distill import run_distill

    return run_distill(args)


def _bench(args) -> int:
    from .bench.cli import run_bench

    return run_bench(args)


def cmd_bench_serve(args) -> int:
    from .bench.serve import run_bench_serve

    return run_bench_serve(args)


if __name__ == "__main__":
    sys.exit(main())
