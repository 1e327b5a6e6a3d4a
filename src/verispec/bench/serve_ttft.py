"""The TTFT phase of `verispec bench-serve` (serve.py): time to first token on one long prompt, ours against
llama.cpp on the same GGUF file and the same token ids.

The prompt: the built-in suite's summarization and RAG passages (each ~250-350 tokens) under one instruction,
"Summarize these documents (set k):", trimmed by the target's tokenizer so the chat-templated ids are about
``--ttft-prompt-tokens`` long (Spec-Bench's summarization / RAG size by default). ``k`` differs per request: the
server reuses whole 256-token chunks of earlier prompts (prefix caching), so one prompt sent twice would time a
cache hit, not a prefill; llama.cpp is reset before every run. Set 0 is one untimed warm-up per side.

Then, ``--ttft-repeats`` times, interleaved (ours, llama.cpp, ours, ...) on set 1, 2, ...: ours = one streamed chat
completion with max_tokens 1 through the first mode's server, sending -> the first chunk with text (the client's
TTFT, as in the sweep), plus the server's own TTFT histogram (/metrics before and after); llama.cpp =
``LlamaCppPeer.generate(ids, 1)`` wall seconds on exactly the ids the server encodes (their counts must agree).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from ..errors import VerispecError
from .serve_load import headers, one_request, scrape
from .serve_report import metrics_diff

INSTRUCTION = "Summarize these documents (set {}):\n\n"
CATEGORIES = ("summarization", "rag")
SERVER_TTFT = ("verispec:time_to_first_token_seconds", "vllm:time_to_first_token_seconds")


def check_ttft_args(args) -> None:
    """Bad TTFT flags, and a llama.cpp peer that cannot run (not installed, not a GGUF target): a VerispecError
    before any model loads."""
    for flag, value, low in (("--ttft-prompt-tokens", args.ttft_prompt_tokens, 0),
                             ("--ttft-repeats", args.ttft_repeats, 1)):
        if value < low:
            raise VerispecError(f"{flag} must be >= {low}, got {value}")
    if args.peers != "llamacpp":
        return
    if args.ttft_prompt_tokens == 0:
        raise VerispecError("--peers llamacpp compares time to first token: --ttft-prompt-tokens 0 turns that off")
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        raise VerispecError("--peers llamacpp needs llama-cpp-python: pip install llama-cpp-python") from None
    from ..models import registry
    from . import peer_llamacpp

    if args.url is None and args.target not in registry.REGISTRY:  # a registry name resolves to its GGUF later
        peer_llamacpp.gguf_file(args.target)


def passages() -> list[str]:
    """The suite's summarization texts and RAG contexts, alternating, in suite order."""
    from .prompts import builtin_suite

    by_cat = {c: [] for c in CATEGORIES}
    for p in builtin_suite():
        if p.category == "summarization":  # "Summarize the following ...:\n\n<text>"
            by_cat[p.category].append(p.text.split("\n\n", 1)[-1])
        elif p.category == "rag":  # "Answer using only the context below.\n\nContext:\n<documents>\n\nQuestion: ..."
            by_cat[p.category].append(p.text.split("Context:\n", 1)[-1].split("\n\nQuestion:", 1)[0])
    return [t for pair in zip(*by_cat.values()) for t in pair]


def ttft_prompt(codec, n: int, k: int) -> tuple[list[dict], list[int]]:
    """Set ``k``: one user message whose chat-templated ids are at most ``n`` (and nearly always exactly ``n``)
    tokens, and those ids. Deterministic."""
    head, texts = INSTRUCTION.format(k), passages()
    body = "\n\n".join(texts)
    while len(body) < 8 * n:  # a tokenizer takes at most one token per character here (bytes at worst)
        body += "\n\n" + "\n\n".join(texts)
    body_ids = codec.tok.encode(body, add_special_tokens=False)
    keep = n - len(codec.encode([{"role": "user", "content": head}]))
    for _ in range(16):  # a cut may re-tokenize across the boundary: shorten until it fits
        if keep < 1:
            break
        messages = [{"role": "user", "content": head + codec.decode(body_ids[:keep])}]
        ids = codec.encode(messages)
        if len(ids) <= n:
            return messages, ids
        keep -= len(ids) - n
    raise VerispecError(f"--ttft-prompt-tokens {n} leaves no room for documents after the instruction and the "
                        "chat template")


def source_codec(source: str):
    """--url: the tokenizer of ``source`` alone (no weights): a registry name, .gguf file or HF directory; None when
    there is none."""
    from ..models import registry
    from ..models.loader import TOKENIZER_FILES
    from ..tokenizer import Codec, load_tokenizer

    path = Path(source).expanduser()
    if source in registry.REGISTRY and registry.is_cached(source):
        tok = load_tokenizer(registry.model_dir(source))
    elif source in registry.REGISTRY or path.suffix.lower() == ".gguf" and path.is_file():
        gguf = registry.gguf_path(source) if source in registry.REGISTRY else path
        tok = load_tokenizer(gguf.parent, gguf_file=gguf.name)
    elif path.is_dir() and any((path / f).is_file() for f in TOKENIZER_FILES):
        tok = load_tokenizer(path)
    else:
        return None
    return Codec(tok, len(tok))


def plan_ttft(args, codec, context: int, served: str | None = None) -> tuple[list | None, object | None]:
    """The prompt sets (warm-up first) and the llama.cpp peer, or (None, None) with a note when the phase cannot
    run. ``served``: --url, the model name the server answers to; the phase needs it to be --target (then the
    tokenizer and, for the peer, the GGUF file are known). Peer errors surface here, before the sweep."""
    n = args.ttft_prompt_tokens
    if n == 0:
        return None, None
    if served is not None and served != args.target:
        print(f"verispec: no TTFT phase{' and no llama.cpp peer' if args.peers == 'llamacpp' else ''}: the server "
              f"serves {served!r}, not --target {args.target!r}; give --target as the server's model (its GGUF file "
              "for the peer)", file=sys.stderr)
        return None, None
    if codec is None or not codec.has_tokenizer or not getattr(codec.tok, "chat_template", None):
        print(f"verispec: no TTFT phase: {args.target} has no tokenizer with a chat template here", file=sys.stderr)
        return None, None
    if n + 1 > context:
        print(f"verispec: no TTFT phase: --ttft-prompt-tokens {n} + 1 new token exceed the context ({context} "
              "tokens)", file=sys.stderr)
        return None, None
    prompts = [ttft_prompt(codec, n, k) for k in range(args.ttft_repeats + 1)]
    peer = None
    if args.peers == "llamacpp":
        import torch

        from . import peer_llamacpp

        longest = max(len(ids) for _, ids in prompts)
        peer = peer_llamacpp.LlamaCppPeer(args.target, torch.get_num_threads(), context=max(longest + 8, 512))
    return prompts, peer


async def measure_ttft(args, url: str, model: str, prompts: list, peer) -> list[dict]:
    """Set 0 untimed on each side, then per set ours and the peer's, one after the other: one record per run."""
    import httpx

    trials = []
    async with httpx.AsyncClient(timeout=None, trust_env=False, headers=headers(args)) as client:
        for k, (messages, ids) in enumerate(prompts):
            body = {"model": model, "messages": messages, "max_tokens": 1, "temperature": 0.0, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}
            before = await scrape(client, url)
            rec = await one_request(client, url, body, args.timeout)
            if not rec["ok"]:
                raise VerispecError(f"TTFT phase: the request failed: {rec['error']}")
            if rec["prompt_tokens"] != len(ids):
                raise VerispecError(f"TTFT phase: the server counted {rec['prompt_tokens']} prompt tokens, the "
                                    f"tokenizer here {len(ids)}: not the same model")
            diff = metrics_diff(before, await scrape(client, url)) or {}
            server = next((diff[f"{m}_sum"] for m in SERVER_TTFT if diff.get(f"{m}_count") == 1), None)
            if k > 0:  # set 0 warms up
                trials.append({"side": "verispec", "set": k, "prompt_tokens": len(ids),
                               "ttft_ms": rec["ttft_ms"] if rec["ttft_ms"] is not None else rec["e2e_ms"],
                               "first_chunk": "text" if rec["ttft_ms"] is not None else "[DONE] (no text)",
                               "server_ttft_ms": None if server is None else 1e3 * server})
            if peer is not None:
                _, seconds = peer.generate(ids, 1)
                if k > 0:
                    trials.append({"side": "llamacpp", "set": k, "prompt_tokens": len(ids), "ttft_ms": 1e3 * seconds})
    return trials


def summarize_ttft(args, trials: list[dict], mode: str) -> dict:
    def side(name: str) -> dict | None:
        runs = [t for t in trials if t["side"] == name]
        if not runs:
            return None
        ms = [t["ttft_ms"] for t in runs]
        server = [t["server_ttft_ms"] for t in runs if t.get("server_ttft_ms") is not None]
        out = {"runs": len(runs), "median_ms": round(statistics.median(ms), 3), "min_ms": round(min(ms), 3),
               "ms_per_prompt_token": round(statistics.median(t["ttft_ms"] / t["prompt_tokens"] for t in runs), 4)}
        if name == "verispec":
            out["server_median_ms"] = round(statistics.median(server), 3) if server else None
        return out

    ours, peer = side("verispec"), side("llamacpp")
    return {
        "mode": mode, "target_prompt_tokens": args.ttft_prompt_tokens, "repeats": args.ttft_repeats,
        "prompt_tokens": int(statistics.median(t["prompt_tokens"] for t in trials)),
        "prompt": f"built-in suite's {' and '.join(CATEGORIES)} passages after {INSTRUCTION.strip()!r}, chat "
                  "template applied, trimmed by the target's tokenizer; a new set k per request (no prefix-cache "
                  "hits), set 0 an untimed warm-up per side",
        "verispec": ours, "llamacpp": peer,
        "ratio_median": round(ours["median_ms"] / peer["median_ms"], 4) if peer else None,
        "ratio_min": round(ours["min_ms"] / peer["min_ms"], 4) if peer else None,
        "trials": trials,
    }


def ttft_table(t: dict) -> str:
    lines = [f"Time to first token, a {t['prompt_tokens']}-token prompt (summarization + RAG passages), "
             f"{t['repeats']} repeat(s)" + (", interleaved with llama.cpp on the same ids" if t["llamacpp"] else ""),
             "", "| side | median ms | min ms | ms per prompt token | server TTFT median ms |", "|---|---|---|---|---|"]
    for name, label in (("verispec", f"verispec ({t['mode']})"), ("llamacpp", "llama.cpp")):
        s = t[name]
        if s:
            server = s.get("server_median_ms")
            lines.append(f"| {label} | {s['median_ms']:.1f} | {s['min_ms']:.1f} | {s['ms_per_prompt_token']:.3f} | "
                         + ("-" if server is None else f"{server:.1f}") + " |")
    if t["ratio_median"] is not None:
        lines.append(f"- verispec / llama.cpp: {t['ratio_median']:.2f}x (median), {t['ratio_min']:.2f}x (min); "
                     "below 1 = ours first")
    return "\n".join(lines)
