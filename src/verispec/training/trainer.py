"""Training a draft head of any family on extracted features, sized for a CPU. The family's own parts (initial
weights, the training forward, the loss) come from its recipe, RECIPES[head.config.family] (training/recipes/).

AdamW with warm-up and cosine decay on the head's trainable weights. A checkpoint every
``ckpt_every`` steps holds the head, the optimizer and the step; the data order is a function of (seed, step), so
``--resume`` continues bit for bit. Held-out acceptance (greedy, per chain position) is printed as it goes.
Under torchrun (WORLD_SIZE > 1) each rank takes its own sequences of every step and DDP averages the gradients.
"""

from __future__ import annotations

import itertools
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from ..errors import VerispecError
from ..heads.base import DraftHead
from ..heads.io import save_head
from ..models.linear import fast_bf16_matmul
from ..spec.costs import expected_tokens
from .extract import shards
from .recipes import RECIPES, Labels


@dataclass
class TrainConfig:
    steps: int = 2000
    lr: float = 3e-4
    batch: int = 1  # sequences per step and rank
    ttt_steps: int = 3
    draft_vocab: int = 16384  # rows a CPU-sized corpus fills (the top-1 tokens of ~250k tokens: ~15k distinct)
    seed: int = 0
    init: str = "target"  # "target": the head's layer starts as the target's last layer; "random"
    ckpt_every: int = 100
    eval_every: int = 100
    warmup: int = 50
    step_weight: float = 0.8  # EAGLE-3: the loss of unroll step j weighted step_weight ** j
    schedule: str = "cosine"  # after warm-up: "cosine" to 10% of lr, or "constant"


def load_split(features_dir: Path, split: str, pick: tuple[int, ...] | None = None, stored: int = 1,
               files: list[Path] | None = None) -> dict[str, torch.Tensor]:
    """Every shard of one split (or ``files``), stacked: tokens [N, T], features [N, T, F], topk_ids / topk_logp
    [N, T, k]. ``pick``: keep only these of the ``stored`` layers (features are ``stored`` blocks of D, one a layer)."""
    from safetensors.torch import load_file

    files = shards(features_dir, split) if files is None else files
    if not files:
        raise VerispecError(f"{features_dir}: no {split} features (run the extraction first)")
    parts = [load_file(str(f)) for f in files]
    if pick is not None:
        for p in parts:  # [n, T, stored D] -> [n, T, len(pick) D]
            p["features"] = p["features"].unflatten(-1, (stored, -1))[..., list(pick), :].flatten(-2)
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def draft_vocabulary(top1: torch.Tensor, size: int, vocab_size: int, always: tuple[int, ...]) -> torch.Tensor:
    """The ``size`` tokens the target predicts most often in the data (ties by id), plus ``always`` -> sorted ids."""
    counts = torch.bincount(top1.flatten().long(), minlength=vocab_size).double()
    counts[list(always)] = float("inf")
    order = torch.sort(-counts, stable=True).indices[:size]
    return torch.sort(order).values


def acceptance(hits: list[int], reached: list[int]) -> list[float]:
    return [h / r if r else 0.0 for h, r in zip(hits, reached)]


class Unrolled(nn.Module):
    """The recipe's training forward as a module: what DDP wraps (its hooks average the head's gradients)."""

    def __init__(self, head: DraftHead, unroll):
        super().__init__()
        self.head, self.unroll = head, unroll

    def forward(self, features: torch.Tensor, tokens: torch.Tensor, steps: int) -> list[torch.Tensor]:
        return self.unroll(self.head, features, tokens, steps)  # per step [B, T, Vd]


class Trainer:
    def __init__(self, head: DraftHead, cfg: TrainConfig, train: dict, heldout: dict, out: Path,
                 rank: int = 0, world: int = 1, log=print):
        self.head, self.cfg, self.train, self.heldout, self.out = head, cfg, train, heldout, out
        self.rank, self.world, self.log = rank, world, log
        self.recipe = RECIPES[head.config.family]
        self.labels = Labels(head.d2t, head.config.vocab_size)
        self.forward = Unrolled(head, self.recipe.unroll)
        self.model = self.forward
        if world > 1:
            from torch.nn.parallel import DistributedDataParallel

            self.model = DistributedDataParallel(self.forward)
        params = [p for p in head.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
        self.step = 0
        self.autocast = fast_bf16_matmul()  # bf16 products where the CPU has bf16 hardware (or on a GPU)
        self.history: list[dict] = []

    # data order: a function of (seed, step) only
    def batch_indices(self, step: int) -> list[int]:
        N = self.train["tokens"].shape[0]
        first = (step * self.world + self.rank) * self.cfg.batch
        out = []
        for g in range(first, first + self.cfg.batch):
            epoch, i = divmod(g, N)
            perm = torch.randperm(N, generator=torch.Generator().manual_seed(self.cfg.seed * 100_003 + epoch))
            out.append(int(perm[i]))
        return out

    def lr_at(self, step: int) -> float:
        c = self.cfg
        if step < c.warmup:
            return c.lr * (step + 1) / c.warmup
        if c.schedule == "constant":
            return c.lr
        t = (step - c.warmup) / max(c.steps - c.warmup, 1)
        return c.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))

    def run(self, progress: bool = True) -> dict:
        from tqdm import tqdm

        c = self.cfg
        T = self.train["tokens"].shape[1]
        bar = tqdm(total=c.steps, initial=self.step, desc="train", unit="step", disable=not progress or self.rank,
                   dynamic_ncols=True)
        t0, done0 = time.perf_counter(), self.step
        while self.step < c.steps:
            idx = self.batch_indices(self.step)
            batch = {k: v[idx] for k, v in self.train.items()}
            for g in self.opt.param_groups:
                g["lr"] = self.lr_at(self.step)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
                loss, hits, reached = self.recipe.loss(self.model, batch, self.labels, c.ttt_steps, c.step_weight)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_([p for p in self.head.parameters() if p.requires_grad], 0.5)
            self.opt.step()
            self.step += 1
            tok_s = (self.step - done0) * c.batch * self.world * T / (time.perf_counter() - t0)
            bar.set_postfix(loss=f"{loss.item():.3f}", acc="/".join(f"{a:.2f}" for a in acceptance(hits, reached)),
                            tok_s=f"{tok_s:.0f}")
            bar.update(1)
            if self.step % c.eval_every == 0 or self.step == c.steps:
                self.evaluate(loss.item(), tok_s)
            if self.step % c.ckpt_every == 0 or self.step == c.steps:
                self.save()
        bar.close()
        return self.history[-1] if self.history else {}

    @torch.no_grad()
    def evaluate(self, train_loss: float, tok_s: float) -> dict:
        if self.rank:
            return {}
        h = self.heldout
        hits, reached, losses = [], [], []  # per chain step (EAGLE-3) or head (Medusa)
        for i in range(h["tokens"].shape[0]):
            batch = {k: v[i:i + 1] for k, v in h.items()}
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
                loss, hh, rr = self.recipe.loss(self.forward, batch, self.labels, self.cfg.ttt_steps, self.cfg.step_weight)
            losses.append(loss.item())
            hits = [a + b for a, b in itertools.zip_longest(hits, hh, fillvalue=0)]
            reached = [a + b for a, b in itertools.zip_longest(reached, rr, fillvalue=0)]
        rates = acceptance(hits, reached)
        rec = {"step": self.step, "train_loss": round(train_loss, 4), "heldout_loss": round(sum(losses) / len(losses), 4),
               "heldout_acceptance": [round(a, 4) for a in rates], "heldout_tau": round(expected_tokens(rates), 3),
               "train_tokens_per_s": round(tok_s, 1)}
        self.history.append(rec)
        self.log(f"step {self.step}/{self.cfg.steps}: held-out acceptance per position "
                 f"{' / '.join(f'{a:.2f}' for a in rates)} (tau {rec['heldout_tau']:.2f}), loss {rec['heldout_loss']:.3f} "
                 f"held-out / {train_loss:.3f} train, {tok_s:.0f} tokens/s")
        return rec

    def save(self) -> None:
        if self.rank:
            return
        state = {"step": self.step, "head": self.head.state_dict(), "d2t": self.head.d2t, "opt": self.opt.state_dict(),
                 "config": asdict(self.cfg), "history": self.history}
        tmp = self.out / "checkpoint.pt.tmp"
        torch.save(state, tmp)
        tmp.rename(self.out / "checkpoint.pt")
        save_head(self.head, self.out, extra={"verispec_training": {"step": self.step, **asdict(self.cfg),
                                                                   "history": self.history[-1:]}})
        (self.out / "history.json").write_text(json.dumps(self.history, indent=1) + "\n")

    def load(self, path: Path) -> None:
        state = torch.load(path, map_location="cpu", weights_only=False)
        self.head.d2t = state["d2t"]
        self.head.load_state_dict(state["head"])
        self.opt.load_state_dict(state["opt"])
        self.step, self.history = state["step"], state["history"]
