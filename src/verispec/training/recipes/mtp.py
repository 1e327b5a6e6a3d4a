"""The MTP module's training recipe (DeepSeek-V3's multi-token prediction at depth 1): fed the target's last hidden
state at r and the token x_{r+1}, predict x_{r+2}, cross-entropy against the target's distribution there. The LM head
is the target's rows for the draft vocabulary (frozen); the decoder layer may start as the target's last layer and the
projection as the hidden half alone. The module itself: heads/mtp.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...heads.mtp import MtpHead
from .base import Recipe, start
from .eagle3 import chain_loss, copy_last_layer


def init(head: MtpHead, target: nn.Module, init: str, seed: int) -> None:
    """Weights before training; ``init`` "target": the layer is the target's last, input_proj passes the hidden state."""
    start(head, target, seed, head.final_layernorm)
    if init != "target":
        return
    D = head.config.hidden_size
    with torch.no_grad():
        last = target.layers[-1]
        copy_last_layer(head.layer, head.layer.self_attn, last, D_in=0)
        head.layer.input_layernorm.weight.copy_(last.input_layernorm.weight.float())
        head.layer.post_attention_layernorm.weight.copy_(last.post_attention_layernorm.weight.float())
        head.input_proj.weight.mul_(0.1)
        head.input_proj.weight[:, D:] += torch.eye(D)  # start from the target's own hidden state


def unroll(head: MtpHead, features: torch.Tensor, tokens: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """One step, teacher-forced: row r reads f_r and x_{r+1}, attends causally to rows <= r, and its logits [B, T, Vd]
    predict x_{r+2} (rows past the end read padding: the loss masks them). ``steps`` unused: depth 1."""
    B, T, _ = features.shape
    next_tokens = torch.cat([tokens[:, 1:], torch.zeros_like(tokens[:, :1])], dim=1)  # [B, T]: x_{r+1}
    x = head.inputs(next_tokens, head.fuse(features))  # [B, T, D]
    layer, a = head.layer, head.layer.self_attn
    cos, sin = head.rope(torch.arange(T, device=features.device)[None].expand(B, T), x.dtype)
    q, k, v = a.qkv(layer.input_layernorm(x), cos, sin)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=a.h != a.hkv)
    h = x + a.out(o)
    h = h + layer.mlp(layer.post_attention_layernorm(h))
    return [head.logits(h)]


RECIPE = Recipe(head=MtpHead, init=init, unroll=unroll, loss=chain_loss)
