"""The load generator of `verispec bench-serve` (serve.py): closed-loop workers streaming chat completions with
httpx, timing each response, and /metrics scrapes around each level.

Per request, times in ms from sending it: TTFT to the first chunk with text, ITL between chunks with text (one chunk
may carry several tokens: a speculative step commits several), e2e to [DONE], and TPOT = (e2e - TTFT) /
(completion_tokens - 1) with the count from the usage chunk.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

from ..errors import VerispecError


def requests_per_level(args, c: int) -> int:
    return args.requests_per_level or max(8, 2 * c)


def headers(args) -> dict:
    return {"Authorization": f"Bearer {args.api_key}"} if args.url and args.api_key else {}


async def sweep(args, servers: dict, modes: list[str], levels: list[int], messages: list, records: list,
                level_runs: list, save) -> None:
    import httpx
    from tqdm import tqdm

    limits = httpx.Limits(max_connections=max(levels) + 4, max_keepalive_connections=max(levels) + 4)
    async with httpx.AsyncClient(timeout=None, limits=limits, trust_env=False, headers=headers(args)) as client:
        for mode in modes:  # warm-up: not counted, not compared
            url, model = servers[mode]
            for i in range(args.warmup):
                rec = await one_request(client, url, body(args, model, messages, i), args.timeout)
                if not rec["ok"]:
                    raise VerispecError(f"{mode}: the warm-up request failed: {rec['error']}")
        total = sum(requests_per_level(args, c) for c in levels) * len(modes)
        with tqdm(total=total, desc="bench-serve", unit="req", file=sys.stderr) as bar:
            for c in levels:
                for mode in modes:
                    bar.set_postfix_str(f"{mode} c={c}")
                    url, model = servers[mode]
                    before = await scrape(client, url)
                    t0 = time.perf_counter()
                    recs = await closed_loop(client, url, args, model, messages, c, requests_per_level(args, c), bar)
                    wall = time.perf_counter() - t0
                    after = await scrape(client, url)
                    records += [{"mode": mode, "concurrency": c, **r} for r in recs]
                    level_runs.append({"mode": mode, "concurrency": c, "wall_s": wall, "metrics_before": before,
                                       "metrics_after": after})
                    save()


def body(args, model: str, messages: list, i: int) -> dict:
    _, msgs = messages[i % len(messages)]
    b = {"model": model, "messages": msgs, "max_tokens": args.max_tokens, "temperature": args.temperature,
         "stream": True, "stream_options": {"include_usage": True}}
    if args.ignore_eos:
        b["ignore_eos"] = True
    if args.temperature > 0:
        b["seed"] = args.seed + i % len(messages)
    return b


async def closed_loop(client, url: str, args, model: str, messages: list, concurrency: int, n: int, bar) -> list:
    """``concurrency`` workers, each sending its next request when the last one ends, until ``n`` are done."""
    todo, out = iter(range(n)), []

    async def worker():
        for i in todo:  # one shared iterator: each index is taken once
            rec = await one_request(client, url, body(args, model, messages, i), args.timeout)
            out.append({"index": i, "prompt_id": messages[i % len(messages)][0], **rec})
            bar.update()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return sorted(out, key=lambda r: r["index"])


async def one_request(client, url: str, body: dict, timeout: float) -> dict:
    """Stream one chat completion: times (ms) of the first content chunk and between content chunks, the text,
    usage and the server's speculative stats; ``ok`` False with ``error`` for a non-200, an error event, a stream
    without [DONE] or usage, or a timeout."""
    import httpx

    rec = {"ok": False, "error": None, "ttft_ms": None, "e2e_ms": None, "tpot_ms": None, "itl_ms": [],
           "completion_tokens": None, "prompt_tokens": None, "finish_reason": None, "spec": None, "text": ""}
    pieces, done, last = [], False, None
    t0 = time.perf_counter()
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
                if resp.status_code != 200:
                    rec["error"] = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:200]}"
                    return rec
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    now, chunk = time.perf_counter(), json.loads(data)
                    if "error" in chunk:
                        rec["error"] = f"error event: {chunk['error'].get('message')}"
                        return rec
                    for choice in chunk.get("choices") or []:
                        text = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
                        if text:
                            if last is None:
                                rec["ttft_ms"] = 1e3 * (now - t0)
                            else:
                                rec["itl_ms"].append(1e3 * (now - last))
                            last = now
                            pieces.append(text)
                        rec["finish_reason"] = choice.get("finish_reason") or rec["finish_reason"]
                    if chunk.get("usage"):
                        rec["completion_tokens"] = chunk["usage"].get("completion_tokens")
                        rec["prompt_tokens"] = chunk["usage"].get("prompt_tokens")
                    if (chunk.get("metrics") or {}).get("speculative_decoding"):
                        rec["spec"] = chunk["metrics"]["speculative_decoding"]
    except TimeoutError:
        rec["error"] = f"timeout after {timeout:g} s"
        return rec
    except (httpx.HTTPError, ValueError) as e:  # a dropped connection, a chunk that is not JSON
        rec["error"] = f"{type(e).__name__}: {e}"
        return rec
    rec["e2e_ms"], rec["text"] = 1e3 * (time.perf_counter() - t0), "".join(pieces)
    n = rec["completion_tokens"]
    if not done or n is None:
        rec["error"] = "the stream ended without [DONE]" if not done else "no usage chunk"
        return rec
    if n > 1 and rec["ttft_ms"] is not None:
        rec["tpot_ms"] = (rec["e2e_ms"] - rec["ttft_ms"]) / (n - 1)
    rec["ok"] = True
    return rec


async def scrape(client, url: str) -> str | None:
    """GET /metrics: the Prometheus text, or None when the server has none."""
    import httpx

    try:
        r = await client.get(f"{url}/metrics", timeout=30)
    except httpx.HTTPError:
        return None
    return r.text if r.status_code == 200 else None
