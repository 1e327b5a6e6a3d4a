"""Draft-head fixtures shared by the exactness and CLI tests."""

from __future__ import annotations

from pathlib import Path

import torch

from tiny import make_hf_model
from verispec.heads import Eagle3Config, Eagle3Head, save_head
from verispec.models.config import ModelConfig


def random_head(path: Path, target_cfg: ModelConfig, rows: list[int] | None = None, seed: int = 0,
                scale: float = 0.15) -> Path:
    """A random head for a target (its draft vocabulary: ``rows``, default all), saved without an LM head (the
    loader takes the target's rows)."""
    rows = list(range(target_cfg.vocab_size)) if rows is None else rows
    head = randomize(Eagle3Head(Eagle3Config.for_target(target_cfg, None, len(rows))), rows, seed, scale)
    save_head(head, path, int8=False)
    return path


def randomize(head, rows: list[int], seed: int = 0, scale: float = 0.15):
    """A head of any family with random weights (matrices N(0, scale), the rest 1 + N(0, 0.1)) and draft vocabulary
    ``rows``; returned."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale if p.dim() == 2 else 1 + 0.1 * torch.randn(p.shape, generator=g))
    head.d2t = torch.tensor(sorted(rows))
    return head


def successor_target(path: Path, n: int = 16, seed: int = 7) -> tuple[Path, list[int]]:
    """A tiny target whose next token is a fixed permutation sigma of the current one on tokens 0..n-1: its attention
    and MLP write nothing (output projections zero), so the last residual stream is the token's embedding, and its LM
    head is the embedding rows permuted (row sigma(x) = E[x]). Greedy text walks sigma's cycles, so what follows is a
    function a head can learn from the features (Medusa head k: x -> sigma^(k+2)(x), a linear map on n embeddings; a
    random target's next-next token is not learnable from one row). -> (path, sigma)."""
    model = make_hf_model("llama", seed)
    sigma = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        E = model.model.embed_tokens.weight
        lm = E.clone()
        lm[sigma] = E[:n]
        model.lm_head.weight.copy_(lm)
    model.save_pretrained(str(path), safe_serialization=True)
    return path, sigma


def train_head(llm, family: str, path: Path, steps: int, vocab: int) -> dict:
    """A head of ``family`` trained by its recipe (training/recipes/) and the trainer on the target's greedy
    continuations of random prompts over tokens 0..vocab-1, 4 held out (``steps`` 0: untrained) -> the last held-out
    record; the head written to ``path``."""
    from verispec import SamplingParams
    from verispec.training.extract import features_of
    from verispec.training.recipes import RECIPES
    from verispec.training.trainer import TrainConfig, Trainer, draft_vocabulary

    model, cfg = llm.target.model, llm.target.config
    recipe = RECIPES[family]
    head = recipe.build(cfg, None, cfg.vocab_size)
    hc = head.config
    seqs = []
    for seed in range(36):
        prompt = torch.randint(0, vocab, (4,), generator=torch.Generator().manual_seed(seed)).tolist()
        out = llm.generate(prompt, SamplingParams(max_new_tokens=44, ignore_eos=True)).token_ids
        seqs.append(features_of(model, prompt + out, hc.layers, 8))
    data = {k: torch.stack([s[k] for s in seqs]) for k in seqs[0]}
    held, train_ = {k: v[-4:] for k, v in data.items()}, {k: v[:-4] for k, v in data.items()}
    head.d2t = draft_vocabulary(train_["topk_ids"][..., 0], hc.draft_vocab_size, cfg.vocab_size, ())
    recipe.init(head, model, "target", 0)
    head.attach_target(model)
    path.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(head, TrainConfig(steps=max(steps, 1), lr=3e-3, eval_every=max(steps, 1),
                                        ckpt_every=max(steps, 1), warmup=10), train_, held, path, log=lambda line: None)
    trainer.autocast = False
    if steps:
        trainer.run(progress=False)
    else:
        trainer.evaluate(0.0, 0.0)
    save_head(head, path)
    return trainer.history[-1]
