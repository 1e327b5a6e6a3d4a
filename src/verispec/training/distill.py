"""Self-distillation text: the target answers training prompts through the batched engine, and each answer is
appended to a JSONL corpus (prompt turns + answer + how it was made). Resumable: a task whose id is in the file is
not asked again. ``verispec distill`` runs it; the corpus is the text. With ``--features DIR`` the same forwards
that write each answer also keep a draft head's training inputs for every position of it, prompt included (the
target's hidden states after the head's layers and its top-k log-probabilities: training/capture.py), as shards that
`train-head --features DIR` reads without an extraction pass; otherwise features are rebuilt from the text when a
head trains.

Many requests run at once (continuous batching: a step of 8 rows costs ~3 one-row steps on 2 cores), half of them
greedy and half sampled at a temperature in [0.7, 1.0] (a head serves both). Magpie turns are written by the target
first (sampled, T 1.0), cleaned and deduplicated, then answered like any other prompt.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import torch

from ..config import SamplingParams
from ..errors import VerispecError
from . import tasks as T

BLOCK_SIZE = 16


def read_corpus(path: Path) -> dict[str, dict]:
    """Every record of the corpus by id: the packed ``path``.xz (what the repository holds) and ``path`` (what runs
    since appended); a line cut short by a stop is skipped (its prompt is asked again)."""
    import lzma

    records = {}
    packed = path.with_suffix(path.suffix + ".xz")
    for f, opener in ((packed, lzma.open), (path, open)):
        if f.exists():
            with opener(f, "rt", encoding="utf-8") as fh:
                for line in fh:
                    try:
                        r = json.loads(line)
                        records[r["id"]] = r
                    except (ValueError, KeyError):
                        continue
    return records


def magpie_prefix(codec, lead: str) -> list[int]:
    """The chat template up to the user's turn, then ``lead``: token ids the target continues as a user would."""
    text = codec.tok.apply_chat_template([{"role": "user", "content": "\x00"}], tokenize=False,
                                         add_generation_prompt=False)
    return list(codec.tok(text.split("\x00")[0] + lead, add_special_tokens=False).input_ids)


class Distiller:
    def __init__(self, llm, out: Path, concurrency: int = 8, max_new_tokens: int = 384, magpie_share: float = 0.5,
                 follow_up_share: float = 0.2, seed: int = 0, kv_cache_tokens: int = 24576,
                 tasks: list[T.Task] | None = None, features=None):
        from ..engine import Engine

        self.llm, self.out, self.concurrency, self.max_new = llm, out, concurrency, max_new_tokens
        self.features = features  # a FeatureWriter (training/capture.py): keep each answer's rows, or None
        self.rng = random.Random(seed)
        self.magpie_share, self.follow_up_share = magpie_share, follow_up_share
        self.engine = Engine(llm.target.model, kv_cache_tokens // BLOCK_SIZE, BLOCK_SIZE, max_num_seqs=concurrency,
                             max_num_batched_tokens=512, logit_mask=llm.logit_mask, eos_token_ids=llm.eos_token_ids)
        self.suite = T.suite_shingles()
        corpus = read_corpus(out)
        self.done = set(corpus)
        self.by_category: dict[str, int] = {}  # answer tokens per category: magpie turns go where they are fewest
        for r in corpus.values():
            self.by_category[r["category"]] = self.by_category.get(r["category"], 0) + r["answer_tokens"]
        self.seen_turns: set[str] = set()
        self.queue = [t for t in (T.seeded_tasks(seed) if tasks is None else tasks) if t.id not in self.done]
        self.follow_ups: list[T.Task] = []
        self.live: dict[int, tuple[T.Task, SamplingParams, object, list[int]]] = {}
        self.n_magpie = 0
        self.written_tokens = 0
        # Magpie turn writing: decode work whose tokens are not in the corpus
        self.turn_tokens, self.turns_written, self.turns_kept = 0, 0, 0

    def _next_task(self) -> T.Task | None:
        if self.follow_ups:
            return self.follow_ups.pop()
        if self.magpie_share and (self.rng.random() < self.magpie_share or not self.queue):
            self.n_magpie += 1
            return T.magpie_task(self.rng, self.n_magpie, self.by_category)
        while self.queue:
            task = self.queue.pop()
            if not T.overlaps_suite(task.messages[-1]["content"], self.suite):
                return task
        return None

    def _add(self, task: T.Task) -> None:
        codec = self.llm.codec
        if task.magpie_lead is not None:  # the target writes the user's turn
            ids = magpie_prefix(codec, task.magpie_lead)
            params = SamplingParams(max_new_tokens=160, temperature=1.0, top_p=0.95,
                                    seed=self.rng.randrange(1 << 31))
        else:
            ids = codec.encode(task.messages)
            greedy = self.rng.random() < 0.5
            params = SamplingParams(max_new_tokens=self.max_new, temperature=0.0 if greedy else
                                    round(self.rng.uniform(0.7, 1.0), 2), seed=None if greedy else
                                    self.rng.randrange(1 << 31))
        if len(ids) + params.max_new_tokens > 4096:
            return
        capture = self.features.capture if self.features is not None and task.magpie_lead is None else None
        req = self.engine.add(ids, params, capture=capture)
        self.live[req.request_id] = (task, params, req, ids)

    def _finish(self, task: T.Task, params: SamplingParams, req, ids: list[int], fh) -> None:
        out_ids = [t for t in req.output_ids if t not in self.llm.eos_token_ids]
        text = self.llm.codec.decode(out_ids)
        if task.magpie_lead is not None:
            self.turn_tokens, self.turns_written = self.turn_tokens + len(req.output_ids), self.turns_written + 1
            turn = T.clean_user_turn(task.magpie_lead + text)
            key = " ".join((turn or "").lower().split()[:12])
            if turn and key not in self.seen_turns and not T.overlaps_suite(turn, self.suite):
                self.turns_kept += 1
                self.seen_turns.add(key)
                self.follow_ups.append(T.Task(T._id("magpie-turn", turn), task.category, "magpie",
                                              [{"role": "user", "content": turn}]))
            return
        record = {"id": task.id, "category": task.category, "source": task.source, "messages": task.messages,
                  "answer": text, "finish_reason": req.finish_reason, "temperature": params.temperature,
                  "prompt_tokens": len(ids), "answer_tokens": len(req.output_ids)}
        fh.write(json.dumps(record, ensure_ascii=False) + "\n")
        fh.flush()
        if self.features is not None:  # every fed position: all but the last token
            n = len(ids) + len(req.output_ids) - 1
            self.features.add(task.id, {"tokens": torch.tensor(req.seq.tokens[:n], dtype=torch.int32),
                                        "features": req.features[:n].to(torch.bfloat16),
                                        "topk_ids": req.topk_ids[:n], "topk_logp": req.topk_logp[:n]})
        self.written_tokens += len(req.output_ids)
        self.by_category[task.category] = self.by_category.get(task.category, 0) + len(req.output_ids)
        if task.source != "follow-up" and text.strip() and self.rng.random() < self.follow_up_share:
            self.follow_ups.append(T.follow_up(task, text, self.rng))

    @property
    def turns_dropped(self) -> int:
        return self.turns_written - self.turns_kept

    def turn_summary(self) -> str:
        return f"turns {self.turns_kept} kept / {self.turns_dropped} dropped, {self.turn_tokens} tokens"

    def run(self, tokens: int, progress: bool = True) -> int:
        """Answer prompts until ``tokens`` answer tokens are written this run; return how many were."""
        from tqdm import tqdm

        self.out.parent.mkdir(parents=True, exist_ok=True)
        bar = tqdm(total=tokens, unit="tok", desc="distill", disable=not progress, smoothing=0.05)
        with self.out.open("a", encoding="utf-8") as fh:
            while self.written_tokens < tokens:
                while len(self.live) < self.concurrency:
                    task = self._next_task()
                    if task is None:
                        break
                    self._add(task)
                if not self.live:
                    break
                before = self.written_tokens
                for req in self.engine.step():
                    if req.finished:
                        self._finish(*self.live.pop(req.request_id), fh)
                if self.written_tokens != before:
                    bar.set_postfix_str(self.turn_summary(), refresh=False)
                bar.update(min(self.written_tokens, tokens) - min(before, tokens))
        bar.close()
        return self.written_tokens


def add_distill_parser(sub) -> None:
    from ..models.registry import DEFAULT_TARGET
    from .cli import _layers

    p = sub.add_parser("distill", help="the target answers training prompts (self-distillation text for draft heads)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=DEFAULT_TARGET, help=f"model name, HF directory or .gguf (default: {DEFAULT_TARGET})")
    p.add_argument("--out", required=True, help="JSONL corpus to append to (resumes: prompts already answered are skipped)")
    p.add_argument("--tokens", type=int, default=100_000, help="answer tokens to write in this run (default 100000)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight (default 8)")
    p.add_argument("--max-new-tokens", type=int, default=384, help="longest answer (default 384)")
    p.add_argument("--seed", type=int, default=0, help="task order and sampling (default 0)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's choice)")
    p.add_argument("--features", default=None, metavar="DIR",
                   help="also keep a draft head's training inputs from the same forwards, as shards in DIR that "
                        "`train-head --features DIR` reads (hidden states after --layers, top-k log-probabilities)")
    p.add_argument("--layers", type=_layers, default=None, metavar="I,J,K",
                   help="with --features: target residual streams to keep (default: the EAGLE-3 head's, 2, L/2, L-3)")
    p.add_argument("--topk", type=int, default=16, help="with --features: log-probabilities kept per position")
    p.add_argument("--seq-len", type=int, default=512, help="with --features: tokens per training sequence")
    p.add_argument("--pack", action="store_true",
                   help="instead: compress --out to OUT.xz with a manifest (tokens per category and source)")


def pack(path: Path) -> dict:
    """Compress the corpus (``path``.xz and ``path``) to ``path``.xz, what is committed, and write ``manifest.json``
    beside it; ``path`` is then emptied."""
    import lzma
    from collections import Counter

    records = list(read_corpus(path).values())
    tokens = Counter()
    for r in records:
        tokens[("category", r["category"])] += r["answer_tokens"]
        tokens[("source", r["source"])] += r["answer_tokens"]
        tokens[("sampling", "greedy" if r["temperature"] == 0 else "sampled")] += r["answer_tokens"]
    manifest = {"records": len(records), "answer_tokens": sum(r["answer_tokens"] for r in records),
                "prompt_tokens": sum(r["prompt_tokens"] for r in records)}
    for kind in ("category", "source", "sampling"):
        manifest[f"answer_tokens_by_{kind}"] = {k: v for (t, k), v in sorted(tokens.items()) if t == kind}
    manifest["how"] = ("verispec distill: the target (greedy or T 0.7-1.0) answers prompts made from local text (code "
                       "from installed Python sources, Debian's documentation), user turns it wrote itself (Magpie) "
                       "and follow-ups; prompts sharing an 8-word run with the bench suite are dropped "
                       "(training/tasks.py)")
    with lzma.open(path.with_suffix(path.suffix + ".xz"), "wt", encoding="utf-8", preset=9) as fh:
        for r in records:
            fh.write(json.dumps(r, ensure_ascii=False) + "\n")
    (path.parent / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    path.unlink(missing_ok=True)
    return manifest


def run_distill(args) -> int:
    import torch

    from ..llm import LLM

    out = Path(args.out)
    if args.pack:
        if not read_corpus(out):
            raise VerispecError(f"--out {out}: no records (neither it nor {out.name}.xz exists)")
        m = pack(out)
        print(f"packed {m['records']} records, {m['answer_tokens']} answer tokens", file=sys.stderr)
        return 0
    if args.threads is not None and args.threads < 1:
        raise VerispecError(f"--threads must be >= 1, got {args.threads}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.open("a").close()
    except OSError as e:
        raise VerispecError(f"--out {out}: not writable ({e.strerror or e})") from None
    for name in ("tokens", "concurrency", "max_new_tokens"):
        if getattr(args, name) < 1:
            raise VerispecError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(args.target)
    writer = None
    if args.features is not None:
        from ..engine import Capture
        from ..heads.eagle3 import Eagle3Config
        from .capture import FeatureWriter
        for name in ("topk", "seq_len"):
            if getattr(args, name) < 1:
                raise VerispecError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
        layers = Eagle3Config.for_target(llm.target.config, args.layers, 1).layers  # checks the layer numbers
        writer = FeatureWriter(Path(args.features), Capture(tuple(layers), args.topk), args.seq_len,
                               str(llm.target.source), llm.target.config.hidden_size)
    d = Distiller(llm, out, concurrency=args.concurrency, max_new_tokens=args.max_new_tokens, seed=args.seed,
                  features=writer)
    n = d.run(args.tokens)
    print(f"wrote {n} answer tokens to {out}; Magpie {d.turn_summary()} written outside it", file=sys.stderr)
    return 0
