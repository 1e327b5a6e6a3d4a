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
    loss_on: str = "all"  # "answers": only rows whose next token the target wrote in an assistant turn; "all"


def load_split(features_dir: Path, split: str, pick: tuple[int, ...] | None = None, stored: int = 1,
               files: list[Path] | None = None, turns: tuple[tuple[int, ...], tuple[int, ...]] | None = None
               ) -> dict[str, torch.Tensor]:
    """Every shard of one split (or ``files``), stacked: tokens [N, T], features [N, T, F], topk_ids / topk_logp
    [N, T, k]. ``pick``: keep only these of the ``stored`` layers (features are ``stored`` blocks of D, one a layer).
    ``turns`` (an assistant turn's opening ids, the ids that end a turn): also ``answer`` [N, T] (answer_rows)."""
    from safetensors.torch import load_file

    files = shards(features_dir, split) if files is None else files
    if not files:
        raise VerispecError(f"{features_dir}: no {split} features (run the extraction first)")
    parts = [load_file(str(f)) for f in files]
    if pick is not None:
        for p in parts:  # [n, T, stored D] -> [n, T, len(pick) D]
            p["features"] = p["features"].unflatten(-1, (stored, -1))[..., list(pick), :].flatten(-2)
    out = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    if turns is not None:
        out["answer"] = answer_rows(out["tokens"], *turns)
    return out


def answer_rows(tokens: torch.Tensor, opening: tuple[int, ...], ends: tuple[int, ...]) -> torch.Tensor:
    """tokens [N, T], the sequences of a split in the order they were cut from one stream (as distill and a
    one-process extraction write them) -> [N, T] bool: row t's next token x_{t+1} lies in an assistant turn (after
    ``opening``, the chat template's generation prompt, up to and including a token of ``ends``), i.e. the target
    wrote it: the rows a drafter meets at inference. A split with no assistant turn (plain text): every row."""
    flat = tokens.flatten().tolist()
    n, inside, written = len(opening), False, [False] * len(flat)  # written[i]: x_i in an assistant turn
    for i, x in enumerate(flat):
        if inside:
            written[i] = True
            inside = x not in ends
        elif n and i >= n - 1 and x == opening[-1] and flat[i - n + 1:i + 1] == list(opening):
            inside = True
    if not any(written):
        return torch.ones(tokens.shape, dtype=torch.bool)
    return torch.tensor(written[1:] + [False]).view(tokens.shape)


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
                 rank: int = 0, world: int = 1, log=print, started: bool = False, suite: list[dict] | None = None):
        """``started``: the head was trained before (continual training): held-out figures at step 0 first.
        ``suite``: evaluation rows of other text (extract.suite_answers), scored beside the held-out split."""
        self.head, self.cfg, self.train, self.heldout, self.out = head, cfg, train, heldout, out
        self.started, self.suite = started, suite or []
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
        if self.step == 0 and self.started:  # a head trained before (--init HEAD_DIR): where it starts
            self.evaluate(None, None)
        t0, done0 = time.perf_counter(), self.step
        while self.step < c.steps:
            idx = self.batch_indices(self.step)
            batch = {k: v[idx] for k, v in self.train.items()}
            for g in self.opt.param_groups:
                g["lr"] = self.lr_at(self.step)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
                loss, hits, reached = self.recipe.loss(self.model, batch, self.labels, c.ttt_steps, c.step_weight,
                                                       c.loss_on == "answers")
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
    def evaluate(self, train_loss: float | None, tok_s: float | None) -> dict:
        """Held-out loss and greedy acceptance per chain position, on the rows ``answer`` marks where the data has
        them (what a drafter meets at inference); ``train_loss`` / ``tok_s`` None: before the first step."""
        if self.rank:
            return {}
        h = self.heldout
        rates, loss = self.score([{k: v[i:i + 1] for k, v in h.items()} for i in range(h["tokens"].shape[0])])
        rec = {"step": self.step, "train_loss": None if train_loss is None else round(train_loss, 4),
               "heldout_loss": round(loss, 4),
               "heldout_acceptance": [round(a, 4) for a in rates], "heldout_tau": round(expected_tokens(rates), 3),
               "train_tokens_per_s": None if tok_s is None else round(tok_s, 1)}
        if self.suite:
            rec["suite_acceptance"] = [round(a, 4) for a in self.score([{k: v[None] for k, v in r.items()}
                                                                        for r in self.suite])[0]]
        self.history.append(rec)
        then = "" if train_loss is None else f" / {train_loss:.3f} train, {tok_s:.0f} tokens/s"
        suite = "; suite answers " + " / ".join(f"{a:.3f}" for a in rec["suite_acceptance"]) if self.suite else ""
        self.log(f"step {self.step}/{self.cfg.steps}: held-out acceptance per position "
                 f"{' / '.join(f'{a:.2f}' for a in rates)} (tau {rec['heldout_tau']:.2f}), loss {rec['heldout_loss']:.3f} "
                 f"held-out{then}{suite}")
        return rec

    def score(self, batches: list[dict]) -> tuple[list[float], float]:
        """Greedy acceptance per chain step (EAGLE-3) or head (Medusa) over ``batches``, and their mean loss."""
        hits, reached, losses = [], [], []
        for batch in batches:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
                loss, hh, rr = self.recipe.loss(self.forward, batch, self.labels, self.cfg.ttt_steps, self.cfg.step_weight,
                                                self.cfg.loss_on == "answers")
            losses.append(loss.item())
            hits = [a + b for a, b in itertools.zip_longest(hits, hh, fillvalue=0)]
            reached = [a + b for a, b in itertools.zip_longest(reached, rr, fillvalue=0)]
        return acceptance(hits, reached), sum(losses) / len(losses)

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
