"""The argparse pieces every verispec command line shares: a parser whose errors are one line, ``run_tool`` for
``python -m verispec.<tool>`` and scripts, and the model / speculation / sampling flags with their mapping onto
``LLM(...)`` and ``generate(...)`` options. ``verispec generate`` (cli.py) and ``verispec bench`` (bench/cli.py)
both take their model flags from here.
"""

from __future__ import annotations

import argparse
import sys

from .config import DRAFT_QUANT_BITS
from .errors import VerispecError

EXIT_USAGE = 2


class Parser(argparse.ArgumentParser):
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


def add_model_args(p: argparse.ArgumentParser, compare_draft_quant: bool = False) -> None:
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
    p.add_argument("--head", action="append", default=None, metavar="DIR",
                   help="draft head for --method eagle (EAGLE-3), peagle, medusa or mtp (verispec train-head, or a "
                        "public EAGLE-3 / SpecForge / Medusa / MTP checkpoint for this target); repeatable, one a family "
                        "(auto and bench use them all); default: the heads that ship for the default target (EAGLE-3, Medusa)")
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
                weights=args.weights, draft_weights=args.draft_weights, head=args.head)


def add_spec_args(p: argparse.ArgumentParser) -> None:
    a = p.add_mutually_exclusive_group()
    a.add_argument("--adaptive", dest="adaptive", action="store_true", default=None,
                   help="choose K per round from live acceptance and costs, up to --num-draft-tokens (default for "
                        "the draft heads: eagle, medusa, mtp, peagle)")
    a.add_argument("--no-adaptive", dest="adaptive", action="store_false",
                   help="fixed K (default for draft and ngram)")
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


def add_sampling_args(p: argparse.ArgumentParser, max_new_tokens: int = 128) -> None:
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
    p.add_argument("--seed", type=int, default=None)
