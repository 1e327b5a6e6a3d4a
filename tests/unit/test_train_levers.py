"""The training levers train-head exposes beside K and the data: the learning-rate schedule after warm-up and the
weight of each unroll step's loss (EAGLE-3: 0.8 ** j)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from verispec.training.recipes.eagle3 import chain_loss
from verispec.training.trainer import TrainConfig, Trainer


def lr_at(**cfg) -> list[float]:
    c = TrainConfig(**cfg)
    return [Trainer.lr_at(type("T", (), {"cfg": c})(), s) for s in range(c.steps)]


def test_cosine_falls_to_a_tenth_and_constant_stays():
    cos, const = lr_at(steps=100, lr=1.0, warmup=10), lr_at(steps=100, lr=1.0, warmup=10, schedule="constant")
    assert cos[:10] == const[:10] == [(s + 1) / 10 for s in range(10)]  # the same warm-up
    assert cos[10] == pytest.approx(1.0) and cos[-1] == pytest.approx(0.1, abs=1e-3)
    assert all(a >= b for a, b in zip(cos[10:], cos[11:]))
    assert const[10:] == [1.0] * 90


def test_step_weight_scales_each_unroll_steps_loss():
    """weight 0 keeps step 0's loss alone, weight 1 sums the steps, 0.5 halves each later step."""
    g = torch.Generator().manual_seed(0)
    B, T, V, steps = 1, 6, 5, 3
    logits = [torch.randn(B, T, V, generator=g) for _ in range(steps)]
    p = torch.softmax(torch.randn(B, T, V, generator=g), -1)
    batch = {"tokens": torch.zeros(B, T), "features": torch.zeros(B, T, 2), "topk_ids": None, "topk_logp": None}
    labels = lambda ids, logp: (p, p.argmax(-1))  # noqa: E731
    per_step = [-(p[:, j + 1:] * F.log_softmax(logits[j][:, :T - j - 1], -1)).sum(-1).mean() for j in range(steps)]
    for w in (0.0, 0.5, 1.0):
        loss, _, _ = chain_loss(lambda f, t, n: logits, batch, labels, steps, w)
        assert loss == pytest.approx(float(sum(w ** j * per_step[j] for j in range(steps))), rel=1e-6), w
