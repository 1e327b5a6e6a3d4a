"""EAGLE-3's training recipe (Li et al. 2025): the head unrolled on its own outputs (training-time test), each
step's cross-entropy against the target's distribution weighted 0.8^j; the LM head is the target's rows, frozen,
and the decoder layer may start as the target's last layer. The head itself: heads/eagle3.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...heads.eagle3 import Eagle3Head
from ...heads.peagle import PEagleHead
from ...models.llama import MASKED
from .base import Labels, Recipe, start



def init(head: Eagle3Head, target: nn.Module, init: str, seed: int) -> None:
    """Weights before training; the LM head is always the target's rows for the draft vocabulary (frozen)."""
    start(head, target, seed, head.norm)
    if init != "target":
        return
    D = head.config.hidden_size
    with torch.no_grad():
        last, m = target.layers[-1], head.midlayer
        copy_last_layer(m, m.self_attn, last, D_in=D)  # the hidden half reads as the target's layer does
        for norm in (m.hidden_norm, m.input_layernorm):
            norm.weight.copy_(last.input_layernorm.weight.float())
        m.post_attention_layernorm.weight.copy_(last.post_attention_layernorm.weight.float())
        for layer in head.extra:  # a deeper head: each later layer the target's last, its residual branches at
            copy_last_layer(layer, layer.self_attn, last, D_in=0)  # zero, so it starts as the one-layer head
            layer.input_layernorm.weight.copy_(last.input_layernorm.weight.float())
            layer.post_attention_layernorm.weight.copy_(last.post_attention_layernorm.weight.float())
            layer.self_attn.o_proj.weight.zero_()
            layer.down_proj.weight.zero_()
        n = len(head.config.layers)
        head.fc.weight.mul_(0.1)
        head.fc.weight[:, (n - 1) * D:] += torch.eye(D)  # start from the highest layer's features


def copy_last_layer(layer: nn.Module, a: nn.Module, last: nn.Module, D_in: int) -> None:
    """The target's last layer into a head's: q/k/v into the columns from ``D_in`` on (EAGLE-3: the hidden half of
    its [embedding, hidden] input, whose token half is new; MTP: all), o_proj, the MLP (gate / up / down)."""
    ta = last.self_attn
    qkv = ta.qkv_proj.dense_weight().float()  # [(H + 2 Hkv) hd, D]
    q, k, v = qkv.split([a.h * a.hd, a.hkv * a.hd, a.hkv * a.hd])
    for proj, w in ((a.q_proj, q), (a.k_proj, k), (a.v_proj, v)):
        proj.weight[:, D_in:] = w
    if ta.qkv_proj.bias is not None and a.q_proj.bias is not None:
        for proj, b in zip((a.q_proj, a.k_proj, a.v_proj),
                           ta.qkv_proj.bias.float().split([a.h * a.hd, a.hkv * a.hd, a.hkv * a.hd])):
            proj.bias.copy_(b)
    a.o_proj.weight.copy_(ta.o_proj.dense_weight().float())
    gate, up = last.mlp.gate_up_proj.dense_weight().float().split(last.mlp.inter)
    layer.gate_proj.weight.copy_(gate)
    layer.up_proj.weight.copy_(up)
    layer.down_proj.weight.copy_(last.mlp.down_proj.dense_weight().float())


def unroll(head: Eagle3Head, features: torch.Tensor, tokens: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """The chain unrolled on its own outputs (EAGLE-3's training-time test). features [B, T, F] (target positions
    0..T-1), tokens [B, T] (the token at each position).

    Step j's row r sits at position r + j, reads token x_{r+j+1} and (j = 0) fc(f_r) or (j > 0) its own
    step j-1 output, and in every decoder layer attends to step 0's rows at positions <= r plus its own chain
    (steps 1..j at r), as the drafter's cache holds them. Returns per step the logits [B, T, Vd]; step j row r
    predicts token x_{r+j+2} (rows past the end read padding: the caller masks them)."""
    B, T, _ = features.shape
    m = head.midlayer
    pad = torch.zeros(B, steps, dtype=tokens.dtype, device=tokens.device)
    next_tokens = torch.cat([tokens[:, 1:], pad, pad[:, :1]], dim=1)  # [B, T + steps]: x_{r+1}, 0 past the end
    hidden = head.fuse(features)  # [B, T, D]
    causal = torch.ones(T, T, dtype=torch.bool, device=features.device).tril()  # [T, T]
    keys, first = [[] for _ in range(1 + len(head.extra))], None  # per decoder layer, per step: (k, v) [B, Hkv, T, hd]
    out = []
    for j in range(steps):
        positions = torch.arange(j, T + j, device=features.device)[None].expand(B, T)
        cos, sin = head.rope(positions, hidden.dtype)

        def attend(a, x, cache):
            return chain_attention(a, x, cos, sin, cache, causal)

        emb, hidden = head.step_inputs(j, head.embed(next_tokens[:, j:j + T]).to(hidden.dtype), hidden, first)
        hidden = m.finish(hidden, attend(m.self_attn, m.inputs(emb, hidden), keys[0]))  # x: [B, T, 2D]
        for layer, cache in zip(head.extra, keys[1:]):
            hidden = layer(hidden, lambda a, x, cache=cache: attend(a, x, cache))
        first = hidden if j == 0 else first  # [B, T, D]: step 0's output, what P-EAGLE's mask rows may read
        out.append(head.logits(hidden))
    return out


def chain_attention(a, x: torch.Tensor, cos, sin, keys: list, causal: torch.Tensor) -> torch.Tensor:
    """One layer's attention for chain step j = len(keys): x [B, T, D_in] -> [B, T, D]. Row r attends to step 0's rows
    at positions <= r and to its own rows of steps 1..j (``keys`` holds the earlier steps' (k, v); this one's joins)."""
    B, T, _ = x.shape
    G = a.h // a.hkv
    q, k, v = a.qkv(x, cos, sin)  # [B, H, T, hd], [B, Hkv, T, hd]
    keys.append((k, v))
    qg = q.view(B, a.hkv, G, T, a.hd)
    k0, v0 = keys[0]
    scores = [torch.einsum("bkgtd,bksd->bkgts", qg, k0).masked_fill(~causal, MASKED)]  # [B, Hkv, G, T, T]
    scores += [torch.einsum("bkgtd,bktd->bkgt", qg, ki)[..., None] for ki, _ in keys[1:]]  # [.., T, 1] each
    probs = torch.softmax(torch.cat(scores, dim=-1).float() * a.hd ** -0.5, dim=-1).to(q.dtype)
    o = torch.einsum("bkgts,bksd->bkgtd", probs[..., :T], v0)
    for i, (_, vi) in enumerate(keys[1:]):
        o = o + probs[..., T + i, None] * vi[:, :, None]
    return a.out(o.reshape(B, a.h, T, a.hd))


def chain_loss(model: nn.Module, batch: dict, labels: Labels, steps: int, weight: float = 0.8,
               answers_only: bool = False):
    """model(features, tokens, steps) -> unroll's logits. -> (loss, step j's weighted ``weight`` ** j as in EAGLE-3;
    [steps] rows where the chain's greedy pick matched so far; [steps] rows reached). Where the batch marks the rows
    whose next token the target wrote (``answer`` [B, T]), acceptance counts those rows (a chain that leaves them
    stops), and ``answers_only`` keeps the loss to them too."""
    tokens, feats = batch["tokens"].long(), batch["features"].float()
    p, top1 = labels(batch["topk_ids"], batch["topk_logp"])  # [B, T, Vd], [B, T]
    T = tokens.shape[1]
    answer = batch.get("answer")  # [B, T] bool or None
    counted = torch.ones_like(tokens, dtype=torch.bool) if answer is None else answer.bool()
    step_logits = model(feats, tokens, steps)
    loss, hits, reached = 0.0, [], []
    alive = None
    for j, logits in enumerate(step_logits):
        n = T - j - 1  # rows r with a label at r + j + 1
        lg, pj, tj, cj = logits[:, :n], p[:, j + 1:], top1[:, j + 1:], counted[:, j + 1:]
        ce = -(pj * F.log_softmax(lg.float(), -1)).sum(-1)  # [B, n]
        if answers_only:
            w = cj.float()
            loss = loss + weight ** j * (ce * w).sum() / w.sum().clamp(min=1.0)
        else:
            loss = loss + weight ** j * ce.mean()
        with torch.no_grad():
            ok = (lg.argmax(-1) == tj) & cj  # [B, n]
            reached.append(int(cj.sum()) if alive is None else int((alive[:, :n] & cj).sum()))
            alive = ok if alive is None else alive[:, :n] & ok  # rows whose chain matched the target so far
            hits.append(int(alive.sum()))
    return loss, hits, reached


RECIPE = Recipe(head=Eagle3Head, init=init, unroll=unroll, loss=chain_loss)
# P-EAGLE (heads/peagle.py): the same recipe; its head's steps 1.. read the learned mask inputs (step_inputs), which
# random_init starts at zero and training learns
PEAGLE = Recipe(head=PEagleHead, init=init, unroll=unroll, loss=chain_loss)
