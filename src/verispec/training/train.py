"""Training a draft head on extracted features: EAGLE-3's recipe, sized for a CPU.

Loss: per unrolled step j (training-time test, the head fed its own outputs), the cross-entropy between the head's
distribution over the draft vocabulary and the target's (its top-k, renormalised over the draft vocabulary),
weighted 0.8^j. AdamW with warm-up and cosine decay; the LM head is the target's rows, frozen. A checkpoint every
``ckpt_every`` steps holds the head, the optimizer and the step; the data order is a function of (seed, step), so
``--resume`` continues bit for bit. Held-out acceptance (greedy, per chain position) is printed as it goes.
Under torchrun (WORLD_SIZE > 1) each rank takes its own sequences of every step and DDP averages the gradients.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..errors import VerispecError
from ..models.eagle import EagleHead, HeadConfig, frozen_rows, save_head
from ..models.linear import fast_bf16_matmul
from .extract import shards

STEP_WEIGHT = 0.8  # EAGLE-3: step j's loss weighted 0.8^j


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


def load_split(features_dir: Path, split: str) -> dict[str, torch.Tensor]:
    """Every shard of one split, stacked: tokens [N, T], features [N, T, F], topk_ids / topk_logp [N, T, k]."""
    from safetensors.torch import load_file

    files = shards(features_dir, split)
    if not files:
        raise VerispecError(f"{features_dir}: no {split} features (run the extraction first)")
    parts = [load_file(str(f)) for f in files]
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def draft_vocabulary(top1: torch.Tensor, size: int, vocab_size: int, always: tuple[int, ...]) -> torch.Tensor:
    """The ``size`` tokens the target predicts most often in the data (ties by id), plus ``always`` -> sorted ids."""
    counts = torch.bincount(top1.flatten().long(), minlength=vocab_size).double()
    counts[list(always)] = float("inf")
    order = torch.sort(-counts, stable=True).indices[:size]
    return torch.sort(order).values


def init_head(head: EagleHead, target, init: str, seed: int) -> None:
    """Weights before training; the LM head is always the target's rows for the draft vocabulary (frozen)."""
    gen = torch.Generator().manual_seed(seed)
    D = head.config.hidden_size
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
            elif "norm" in name:
                p.fill_(1.0)
            else:
                p.zero_()
        head.lm_head.weight.copy_(frozen_rows(target.lm_head, head.d2t).float())
        head.lm_head.weight.requires_grad_(False)
        head.norm.weight.copy_(target.norm.weight.float())
        if init == "target":
            last, m = target.layers[-1], head.midlayer
            a, ta = m.self_attn, last.self_attn
            qkv = ta.qkv_proj.dense_weight().float()  # [(H + 2 Hkv) hd, D]
            q, k, v = qkv.split([a.h * a.hd, a.hkv * a.hd, a.hkv * a.hd])
            for proj, w in ((a.q_proj, q), (a.k_proj, k), (a.v_proj, v)):
                proj.weight[:, D:] = w  # the hidden half reads as the target's layer does; the token half is new
            if ta.qkv_proj.bias is not None and a.q_proj.bias is not None:
                for proj, b in zip((a.q_proj, a.k_proj, a.v_proj),
                                   ta.qkv_proj.bias.float().split([a.h * a.hd, a.hkv * a.hd, a.hkv * a.hd])):
                    proj.bias.copy_(b)
            a.o_proj.weight.copy_(ta.o_proj.dense_weight().float())
            gate, up = last.mlp.gate_up_proj.dense_weight().float().split(last.mlp.inter)
            m.gate_proj.weight.copy_(gate)
            m.up_proj.weight.copy_(up)
            m.down_proj.weight.copy_(last.mlp.down_proj.dense_weight().float())
            for norm in (m.hidden_norm, m.input_layernorm):
                norm.weight.copy_(last.input_layernorm.weight.float())
            m.post_attention_layernorm.weight.copy_(last.post_attention_layernorm.weight.float())
            n = len(head.config.layers)
            head.fc.weight.mul_(0.1)
            head.fc.weight[:, (n - 1) * D:] += torch.eye(D)  # start from the highest layer's features


class Labels:
    """The target's distribution over the draft vocabulary, from its stored top-k."""

    def __init__(self, d2t: torch.Tensor, vocab_size: int):
        self.t2d = torch.full((vocab_size,), -1, dtype=torch.long)
        self.t2d[d2t] = torch.arange(len(d2t))
        self.Vd = len(d2t)

    def __call__(self, topk_ids: torch.Tensor, topk_logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, T, k] each -> (p [B, T, Vd] float32, the target's top-1 as a draft row or -1 [B, T])."""
        rows = self.t2d[topk_ids.long()]  # [B, T, k]
        p = topk_logp.float().exp() * (rows >= 0)
        p = p / p.sum(-1, keepdim=True).clamp(min=1e-9)
        dense = torch.zeros(*rows.shape[:2], self.Vd).scatter_add_(-1, rows.clamp(min=0), p)
        return dense, rows[..., 0]


def chain_loss(head, batch: dict, labels: Labels, steps: int):
    """-> (weighted loss, [steps] rows where the chain's greedy pick matched so far, [steps] rows reached)."""
    tokens, feats = batch["tokens"].long(), batch["features"].float()
    p, top1 = labels(batch["topk_ids"], batch["topk_logp"])  # [B, T, Vd], [B, T]
    T = tokens.shape[1]
    step_logits = head(feats, tokens, steps)
    loss, hits, reached = 0.0, [], []
    alive = None
    for j, logits in enumerate(step_logits):
        n = T - j - 1  # rows r with a label at r + j + 1
        lg, pj, tj = logits[:, :n], p[:, j + 1:], top1[:, j + 1:]
        loss = loss + STEP_WEIGHT ** j * -(pj * F.log_softmax(lg.float(), -1)).sum(-1).mean()
        with torch.no_grad():
            ok = lg.argmax(-1) == tj  # [B, n]
            reached.append(ok.numel() if alive is None else int(alive[:, :n].sum()))
            alive = ok if alive is None else alive[:, :n] & ok  # rows whose chain matched the target so far
            hits.append(int(alive.sum()))
    return loss, hits, reached


def acceptance(hits: list[int], reached: list[int]) -> list[float]:
    return [h / r if r else 0.0 for h, r in zip(hits, reached)]


def expected_length(rates: list[float]) -> float:
    """1 + sum_i prod_{j <= i} a_j: tokens per round of a chain of len(rates) greedy drafts (tau)."""
    out, run = 1.0, 1.0
    for a in rates:
        run *= a
        out += run
    return out


class Trainer:
    def __init__(self, head: EagleHead, cfg: TrainConfig, train: dict, heldout: dict, out: Path,
                 rank: int = 0, world: int = 1, log=print):
        self.head, self.cfg, self.train, self.heldout, self.out = head, cfg, train, heldout, out
        self.rank, self.world, self.log = rank, world, log
        self.labels = Labels(head.d2t, head.config.vocab_size)
        self.model = head
        if world > 1:
            from torch.nn.parallel import DistributedDataParallel

            self.model = DistributedDataParallel(head)
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
                loss, hits, reached = chain_loss(self.model, batch, self.labels, c.ttt_steps)
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
        hits, reached, losses = [0] * self.cfg.ttt_steps, [0] * self.cfg.ttt_steps, []
        for i in range(h["tokens"].shape[0]):
            batch = {k: v[i:i + 1] for k, v in h.items()}
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
                loss, hh, rr = chain_loss(self.head, batch, self.labels, self.cfg.ttt_steps)
            losses.append(loss.item())
            hits = [a + b for a, b in zip(hits, hh)]
            reached = [a + b for a, b in zip(reached, rr)]
        rates = acceptance(hits, reached)
        rec = {"step": self.step, "train_loss": round(train_loss, 4), "heldout_loss": round(sum(losses) / len(losses), 4),
               "heldout_acceptance": [round(a, 4) for a in rates], "heldout_tau": round(expected_length(rates), 3),
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
                 "config": asdict(self.cfg), "head_config": asdict(self.head.config), "history": self.history}
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


def head_config_from(state_path: Path) -> tuple[HeadConfig, torch.Tensor]:
    state = torch.load(state_path, map_location="cpu", weights_only=False)
    c = state["head_config"]
    return HeadConfig(**{**c, "layers": tuple(c["layers"])}), state["d2t"]
