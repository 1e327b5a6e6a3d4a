"""Features captured while the target writes: a draft head's training inputs from the forwards that commit the answer.

`verispec distill --features DIR` has the engine keep, for every position of each answered prompt (the prompt's rows
from prefill included), the target's residual streams after the head's layers and its top-k log-probabilities
(``Engine.add(..., capture=Capture(...))``). When an answer is done its rows join a buffer per split (held out by the
record's id, as training/corpus.py holds documents out), which is cut into sequences of ``seq_len`` rows and written
as the shards feature extraction writes (training/extract.py), so `train-head --features DIR` trains on them with no
extraction pass. Rows still buffered when a run stops are not written (the text is in the corpus: extraction can
rebuild them).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..engine import Capture
from .corpus import Document
from .extract import SHARD_SEQS, _write_shard, read_settings, record_settings, shard_name, shards

CAPTURED = "verispec distill"  # features.json's "captured": shards written while generating, not by extraction


class FeatureWriter:
    """Shards of captured rows under ``directory`` (features.json records how they were made; a directory holding
    other settings is an error, not a mix)."""

    def __init__(self, directory: Path, capture: Capture, seq_len: int, target: str, hidden_size: int):
        self.dir, self.capture, self.seq_len = Path(directory), capture, seq_len
        settings = {"layers": list(capture.layers), "seq_len": seq_len, "topk": capture.topk, "target": target,
                    "hidden_size": hidden_size, "captured": CAPTURED}
        record_settings(self.dir, settings)
        self.pending: dict[str, list[dict[str, torch.Tensor]]] = {"train": [], "heldout": []}
        self.index = {split: len(shards(self.dir, split)) for split in self.pending}
        self.written = {split: 0 for split in self.pending}  # rows written this run

    def add(self, name: str, rows: dict[str, torch.Tensor]) -> None:
        """One answered prompt's rows (tokens [n], features [n, F], topk_ids / topk_logp [n, k]), position by
        position; shards are written whenever a split holds enough for one (held-out: one sequence a shard, as one
        record in HELDOUT_EVERY is held out)."""
        split = "heldout" if Document(name).heldout else "train"
        self.pending[split].append({k: v.cpu() for k, v in rows.items()})
        per_shard = SHARD_SEQS if split == "train" else 1
        whole = self.seq_len * per_shard
        if sum(len(r["tokens"]) for r in self.pending[split]) < whole:
            return
        joined = {k: torch.cat([r[k] for r in self.pending[split]]) for k in self.pending[split][0]}
        n = len(joined["tokens"]) // whole * whole
        for at in range(0, n, whole):
            seqs = [{k: v[at + i * self.seq_len: at + (i + 1) * self.seq_len] for k, v in joined.items()}
                    for i in range(per_shard)]
            _write_shard(self.dir / shard_name(split, 0, self.index[split]), seqs)
            self.index[split] += 1
            self.written[split] += whole
        self.pending[split] = [{k: v[n:] for k, v in joined.items()}] if n < len(joined["tokens"]) else []


def captured(directory: Path) -> dict | None:
    """The settings of a directory of captured shards (features.json), or None if it holds none."""
    settings = read_settings(directory)
    return settings if settings is not None and settings.get("captured") == CAPTURED else None
