"""Draft-head fixtures shared by the exactness and CLI tests."""

from __future__ import annotations

from pathlib import Path

import torch

from verispec.models.config import ModelConfig
from verispec.heads import Eagle3Config, Eagle3Head, save_head


def random_head(path: Path, target_cfg: ModelConfig, rows: list[int] | None = None, seed: int = 0,
                scale: float = 0.15) -> Path:
    """A random head for a target (its draft vocabulary: ``rows``, default all), saved without an LM head (the
    loader takes the target's rows)."""
    rows = list(range(target_cfg.vocab_size)) if rows is None else rows
    head = Eagle3Head(Eagle3Config.for_target(target_cfg, None, len(rows)))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale if p.dim() == 2 else 1 + 0.1 * torch.randn(p.shape, generator=g))
    head.d2t = torch.tensor(sorted(rows))
    save_head(head, path, int8=False)
    return path
