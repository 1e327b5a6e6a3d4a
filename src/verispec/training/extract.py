"""Feature extraction: the target reads the corpus and we keep what a draft head trains on, in shards on disk.

Per sequence of T tokens: the tokens [T] int32, the residual stream after the head's layers [T, n*D] bf16 (the
same weights and numerics as inference: native GGUF kernels on CPU), and the target's next-token distribution at
each position as its top-k log-probabilities [T, k] (ids int32, values fp16). Shards are written whole (to a
temporary name, then renamed); a rerun skips the sequences that the shards on disk already hold, so extraction
resumes where it stopped. Under torchrun each rank extracts every world-th sequence into its own shards.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from ..config import SamplingParams
from ..errors import VerispecError
from ..models.kv_cache import KVCache
from .corpus import Document, read_corpus, sequences

SHARD_SEQS = 8  # sequences per shard file


def shard_name(split: str, rank: int, index: int) -> str:
    return f"{split}-r{rank}-{index:05d}.safetensors"


def shards(features_dir: Path, split: str) -> list[Path]:
    return sorted(features_dir.glob(f"{split}-r*-*.safetensors"))


def make_encoder(llm, max_new_tokens: int, cache_file: Path | None = None):
    """Document -> token ids: plain text as is, conversations through the chat template, prompts answered by the
    target (greedy; any exact method gives the same tokens: the draft model's when there is one)."""
    tok = llm.codec.tok
    answers: dict[str, list[int]] = {}  # self-distilled sequences, kept on disk so that a resumed run reuses them
    if cache_file is not None and cache_file.exists():
        for line in cache_file.read_text().splitlines():
            rec = json.loads(line)
            answers[rec["name"]] = rec["ids"]

    def encode(doc: Document) -> list[int]:
        if doc.text is not None:
            return list(tok(doc.text).input_ids)
        if doc.messages is not None:
            ids = tok.apply_chat_template(doc.messages, tokenize=True, add_generation_prompt=False)
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        if doc.name not in answers:
            prompt = llm.codec.encode(doc.prompt, chat=True)
            out = llm.generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens), method="auto")
            answers[doc.name] = prompt + out.token_ids
            if cache_file is not None:
                with cache_file.open("a") as f:
                    f.write(json.dumps({"name": doc.name, "ids": answers[doc.name]}) + "\n")
        return answers[doc.name]

    return encode


@torch.inference_mode()
def features_of(model, ids: list[int], layers: tuple[int, ...], topk: int) -> dict[str, torch.Tensor]:
    """One sequence through the target -> the tensors one shard row holds."""
    T = len(ids)
    tokens = torch.tensor([ids], device=model.embed_tokens.weight.device)  # [1, T]
    cache = KVCache.for_model(model.config, 1, T, model.dtype, tokens.device)
    logits, hidden = model(tokens, torch.arange(T, device=tokens.device)[None], cache, hidden_layers=layers)
    logp = torch.log_softmax(logits[0].float(), dim=-1)  # [T, V]
    top = logp.topk(topk, dim=-1)
    return {"tokens": tokens[0].int().cpu(),
            "features": torch.cat([hidden[i][0] for i in layers], dim=-1).to(torch.bfloat16).cpu(),  # [T, n D]
            "topk_ids": top.indices.int().cpu(), "topk_logp": top.values.half().cpu()}


def suite_answers(llm, limit: int, layers: tuple[int, ...], topk: int, max_new_tokens: int = 128) -> list[dict]:
    """The bench suite's prompts (``limit`` a category) answered by the target (greedy), as evaluation rows: what
    features_of keeps, and ``answer`` [T] marking the rows whose next token the target wrote. An evaluation set:
    never training data."""
    from ..bench.prompts import builtin_suite, select

    out, context = [], llm.target.config.max_position_embeddings
    for p in select(builtin_suite(), None, limit):
        ids = llm.codec.encode(p.text, chat=True)
        room = min(max_new_tokens, context - len(ids))  # a short context (a tiny model): shorter answers
        if room < 2:
            continue
        answer = llm.generate(ids, SamplingParams(temperature=0.0, max_new_tokens=room)).token_ids
        row = features_of(llm.target.model, list(ids) + list(answer), layers, topk)
        row["answer"] = torch.arange(len(ids) + len(answer)) >= len(ids) - 1
        row["answer"][-1] = False  # the last row's next token is not there
        out.append(row)
    return out


def read_settings(features_dir: Path) -> dict | None:
    """features.json under ``features_dir``: how its shards were made; None where there is none."""
    manifest = Path(features_dir) / "features.json"
    return json.loads(manifest.read_text()) if manifest.exists() else None


def record_settings(features_dir: Path, settings: dict, write: bool = True) -> None:
    """features.json: how the shards under ``features_dir`` were made. Written once (``write``: by one process),
    then checked: a directory holding shards made otherwise is an error, never a mix."""
    features_dir.mkdir(parents=True, exist_ok=True)
    old = read_settings(features_dir)
    if old is not None:
        if old != settings:
            diff = next(k for k in settings if old.get(k) != settings[k])
            raise VerispecError(f"{features_dir} holds features made with other settings ({diff}: "
                                f"{old.get(diff)!r} there, {settings[diff]!r} now): use another --features dir")
    elif write:  # whole or not at all: another rank may be reading it right now
        tmp = features_dir / "features.json.tmp"
        tmp.write_text(json.dumps(settings, indent=1) + "\n")
        tmp.rename(features_dir / "features.json")


def extract(llm, data: list[str], features_dir: Path, layers: tuple[int, ...], seq_len: int, max_tokens: int,
            heldout_tokens: int, topk: int, seed: int, self_distill_tokens: int = 256, rank: int = 0,
            world: int = 1, progress: bool = True) -> dict:
    """Write train-* and heldout-* shards under features_dir until max_tokens / heldout_tokens are there."""
    settings = {"layers": list(layers), "seq_len": seq_len, "topk": topk, "seed": seed, "data": list(data),
                "target": str(llm.target.source), "hidden_size": llm.target.config.hidden_size}
    record_settings(features_dir, settings, write=rank == 0)
    docs = read_corpus(data, seed)
    encode = make_encoder(llm, self_distill_tokens, features_dir / f"distilled-r{rank}.jsonl")
    sep = llm.eos_token_ids[-1] if llm.eos_token_ids else 0
    model = llm.target.model
    report = {}
    for split, budget, pick in (("heldout", heldout_tokens, True), ("train", max_tokens, False)):
        wanted = budget // seq_len  # sequences in this split, over all ranks
        mine = len(range(rank, wanted, world))  # this rank's sequences: every world-th
        written = sorted(features_dir.glob(f"{split}-r{rank}-*.safetensors"))
        done = min(sum(shard_rows(f) for f in written), mine)
        bar = _bar(progress and rank == 0, (mine - done) * seq_len, f"extract {split}")
        t0, rows, seen, index = time.perf_counter(), [], 0, len(written)
        stream = sequences([d for d in docs if d.heldout == pick], encode, seq_len, sep)
        for i, ids in enumerate(stream if done < mine else []):  # all there already: no need to read the corpus
            if i >= wanted:
                break
            if i % world != rank:
                continue
            seen += 1
            if seen <= done:  # in a shard already
                continue
            rows.append(features_of(model, ids, layers, topk))
            bar.update(seq_len)
            if len(rows) == SHARD_SEQS:
                _write_shard(features_dir / shard_name(split, rank, index), rows)
                index, rows = index + 1, []
        if rows:
            _write_shard(features_dir / shard_name(split, rank, index), rows)
        bar.close()
        seconds = time.perf_counter() - t0
        new = max(seen - done, 0)
        report[split] = {"sequences": new, "seconds": round(seconds, 1),
                         "tokens_per_s": round(new * seq_len / seconds, 1) if new and seconds else None}
    if not shards(features_dir, "train"):
        raise VerispecError(f"--data {' '.join(data)}: fewer than {seq_len} tokens of training text")
    return report


def shard_rows(path: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return f.get_slice("tokens").get_shape()[0]


def _write_shard(path: Path, rows: list[dict]) -> None:
    from safetensors.torch import save_file

    tmp = path.with_suffix(".tmp")
    save_file({k: torch.stack([r[k] for r in rows]).contiguous() for k in rows[0]}, str(tmp))
    tmp.rename(path)


def _bar(enabled: bool, total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="tok", disable=not enabled, dynamic_ncols=True)
