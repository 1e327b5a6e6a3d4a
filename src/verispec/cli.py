"""`verispec` command line: generate, models list/pull, bench.

Bad input ends in one line on stderr ("verispec: error: ...") and exit status 2; no tracebacks
(set VERISPEC_DEBUG=1 to see one for an unexpected internal error).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .config import DRAFT_QUANT_BITS
from .errors import VerispecError

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of usage + message
        raise VerispecError(f"{self.prog.split()[-1] if ' ' in self.prog else 'verispec'}: {message}")


def run_tool(parser: argparse.ArgumentParser, argv, body) -> int:
    """``python -m verispec.<tool>``: parse, run ``body(args)``; a VerispecError is one line and exit 2."""
    try:
        body(parser.parse_args(argv))
    except VerispecError as e:
        print(f"verispec: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    return 0


def _add_model_args(p: argparse.ArgumentParser, compare_draft_quant: bool = False) -> None:
    """The model flags; ``compare_draft_quant`` (bench) lets --draft-quant take several formats."""
    from .models.registry import DEFAULT_TARGET

    p.add_argument("--target", default=DEFAULT_TARGET, help="model name, HF directory or .gguf file "
                                                             f"(default: {DEFAULT_TARGET})")
    p.add_argument("--draft", default=None, help="draft model for speculative methods (name, directory, .gguf)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="auto (default): bfloat16 on a GPU, on a CPU with bf16 hardware (avx512_bf16/AMX) and for "
                        "native GGUF weights; float32 otherwise (bf16 products are emulated there)")
    p.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda when available")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's choice)")
    if compare_draft_quant:
        p.add_argument("--draft-quant", default="int4", type=_draft_quant_list, metavar="FORMAT[,FORMAT...]",
                       help="draft model matrices: int4 (default), int8 or none; several (e.g. int8,int4) run every "
                            "draft-model method once per format, interleaved per prompt (labels METHOD@FORMAT:K=k)")
    else:
        p.add_argument("--draft-quant", default="int4", choices=DRAFT_QUANTS,
                       help="draft model matrices in 4 bits (int4, default) or int8 on CPU, or as loaded (none); "
                            "exactness is unaffected")
    p.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                   help="draft proposes only its N most frequent tokens: a cheaper LM head, possibly lower "
                        "acceptance (default: 49152 for the default draft, which ships a table, else all; "
                        "0 = all tokens); exactness is unaffected")
    p.add_argument("--weights", default="auto", choices=["auto", "native", "dequantized"],
                   help="GGUF target (the default one too): 'native' runs its Q4_K/Q6_K/Q8_0/... matrices as they are "
                        "on CPU (int8 activations; 1.1 instead of 3.1 GB read per token for the default target), "
                        "'dequantized' converts them to --dtype; auto (default): "
                        "native on CPU in bfloat16")
    p.add_argument("--draft-weights", default="dequantized", choices=["dequantized", "native"],
                   help="the same for the draft model (default: dequantized, then --draft-quant)")
    p.add_argument("--draft-vocab-table", default=None, metavar="FILE",
                   help="token-frequency table for --draft-vocab (python -m verispec.draft_vocab)")


DRAFT_QUANTS = (*DRAFT_QUANT_BITS, "none")  # what --draft-quant takes


def _draft_quant_list(text: str) -> str:
    """--draft-quant for bench: comma-separated formats, each checked; kept as the text."""
    formats = [f.strip() for f in text.split(",") if f.strip()]
    bad = [f for f in formats if f not in DRAFT_QUANTS]
    if not formats or bad or len(set(formats)) < len(formats):
        raise argparse.ArgumentTypeError(f"takes distinct formats out of {', '.join(DRAFT_QUANTS)}, got {text!r}")
    return ",".join(formats)


def engine_options(args) -> dict:
    """LLM(...) keyword arguments from the model flags."""
    return dict(target=args.target, draft=args.draft, dtype=args.dtype, device=args.device, threads=args.threads,
                draft_quant=args.draft_quant.split(",")[0],  # bench may list several: the first is the LLM's own
                draft_vocab=args.draft_vocab, draft_vocab_table=args.draft_vocab_table,
                weights=args.weights, draft_weights=args.draft_weights)


def _add_spec_args(p: argparse.ArgumentParser) -> None:
    a = p.add_mutually_exclusive_group()
    a.add_argument("--adaptive", dest="adaptive", action="store_true", default=False,
                   help="choose K per round from live acceptance and costs, up to --num-draft-tokens")
    a.add_argument("--no-adaptive", dest="adaptive", action="store_false", help="fixed K (default)")
    e = p.add_mutually_exclusive_group()
    e.add_argument("--early-stop", dest="early_stop", action="store_true", default=True,
                   help="the draft model ends a round before K once its own confidence says another token is not "
                        "worth a draft step and a verify row (default)")
    e.add_argument("--no-early-stop", dest="early_stop", action="store_false", help="always draft K tokens")
    p.add_argument("--min-draft-tokens", type=int, default=1, help="smallest K an adaptive round may use (default: 1)")
    p.add_argument("--ngram-max", type=int, default=4, help="n-gram lookup: longest suffix tried first (default: 4)")
    p.add_argument("--ngram-min", type=int, default=1, help="n-gram lookup: shortest suffix that may match (default: 1)")


def spec_options(args) -> dict:
    return dict(adaptive=args.adaptive, min_draft_tokens=args.min_draft_tokens, ngram_min=args.ngram_min,
                ngram_max=args.ngram_max, early_stop=args.early_stop)


def _add_sampling_args(p: argparse.ArgumentParser, max_new_tokens: int = 128) -> None:
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
    p.add_argument("--seed", type=int, default=None)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="verispec", description="Lossless speculative decoding for LLMs.")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)

    g = sub.add_parser("generate", help="generate a completion")
    g.add_argument("prompt", nargs="?", help="prompt text ('-' reads stdin); leave out with --messages")
    _add_model_args(g)
    g.add_argument("--method", default="ar", help="decoding method: ar (default), draft (a draft model proposes), "
                                                   "ngram (lookup in prompt + output) or auto (the best per round)")
    g.add_argument("--num-draft-tokens", type=int, default=4,
                   help="K: tokens drafted per round (default: 4; with --adaptive, the most a round may draft)")
    _add_spec_args(g)
    _add_sampling_args(g)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable; \\n, \\t are escapes)")
    g.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    g.add_argument("--system", default=None, help="system message for --chat")
    g.add_argument("--messages", default=None, metavar="FILE",
                   help='a conversation instead of a prompt: a JSON list of {"role": "system" | "user" | "assistant", '
                        '"content": ...} ending with the user\'s, put through the chat template (\'-\' reads stdin)')
    g.add_argument("--json", action="store_true", help='print {"text", "token_ids", "stats"} as the last line')
    g.add_argument("--no-stream", action="store_true", help="print the text at the end instead of streaming")

    m = sub.add_parser("models", help="list or pull the default models")
    msub = m.add_subparsers(dest="models_command", parser_class=_Parser)
    msub.add_parser("list", help="names, sizes, cached or not")
    pull = msub.add_parser("pull", help="assemble, verify and convert a default model")
    pull.add_argument("name")

    from .bench.cli import add_bench_parser

    add_bench_parser(sub)
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


def cmd_generate(args) -> int:
    from . import LLM, SamplingParams

    prompt = read_prompt(args)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, stop=[unescape(s) for s in args.stop])
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
    if args.json:
        print(json.dumps({"text": out.text, "token_ids": out.token_ids, "stats": out.stats}))
    else:
        s = out.stats
        spec = (f", tau {s['mean_accepted_length']:.2f}, alpha {s['acceptance_rate']:.2f}"
                if "acceptance_rate" in s else "")
        print(f"[{args.method}: {s['new_tokens']} tokens, {s['tokens_per_s']:.2f} tok/s, prefill {s['prefill_s']:.2f}s, "
              f"{s['decode_ms_per_token']:.1f} ms/token{spec}, stop: {out.finish_reason}]", file=sys.stderr)
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
        handler = {"generate": cmd_generate, "models": cmd_models, "bench": _bench}[args.command]
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


def _bench(args) -> int:
    from .bench.cli import run_bench

    return run_bench(args)


if __name__ == "__main__":
    sys.exit(main())
