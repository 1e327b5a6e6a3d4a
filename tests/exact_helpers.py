"""Shared by the exactness tests: the chi-square statistic, a float64 reference of the sampling
transform, deliberately broken verifiers for the negative controls, a toy prefix-dependent logits processor
(BanLast), and the bf16 bits the C++ kernels must write.

``variant_verify(bug)`` is a compact re-implementation of speculative sampling (Leviathan et al.
2022, Algorithm 1) with one switchable mistake; ``bug=None`` is the correct rule, so the harness can
show that the copy itself passes and only the mistake makes a test fail.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from scipy.stats import chisquare

from verispec.sampling import LogitsProcessor, row_prefixes
from verispec.spec.verify import PLACEHOLDER_TOKEN_ID, Verdict

ALPHA = 1e-3

BUGS = {
    None: "correct rule (the copy itself)",
    "always_accept": "every draft accepted, bonus from p_{K+1}",
    "recover_from_p": "recovered token drawn from p instead of norm(max(0, p - q))",
    "bonus_from_p_K": "bonus token drawn from p_K instead of p_{K+1} (off by one)",
    "shared_u": "one uniform per round shared by all K positions instead of one per position",
    "committed_prefix_only": "every row's processors given the committed context, ignoring the drafts before it",
}


def variant_verify(bug: str | None):
    assert bug in BUGS, bug

    def verify(target_logits, draft_tokens, draft_probs, chain, generator, contexts=None) -> Verdict:
        B, K = draft_tokens.shape
        if chain.prefix_independent or contexts is None:
            prefixes = None
        elif bug == "committed_prefix_only":
            prefixes = [ctx for ctx in contexts for _ in range(K + 1)]
        else:
            prefixes = row_prefixes(contexts, draft_tokens)  # row i: context + drafts[:i]
        p = chain.probs(prefixes, target_logits)  # [B, K+1, V]
        V = p.shape[-1]
        q = F.one_hot(draft_tokens, V).to(p.dtype) if draft_probs is None else draft_probs  # [B, K, V]
        x = draft_tokens[..., None]
        p_x, q_x = p[:, :K].gather(-1, x)[..., 0], q.gather(-1, x)[..., 0]  # [B, K]
        if chain.greedy:
            u = torch.zeros_like(p_x)
        elif bug == "shared_u":
            u = torch.rand((B, 1), generator=generator).expand(B, K)
        else:
            u = torch.rand((B, K), generator=generator)
        accepted = u * q_x < p_x
        if bug == "always_accept":
            accepted = torch.ones_like(accepted)
        n = accepted.long().cumprod(-1).sum(-1)  # [B]
        rows = torch.arange(B)
        rejected = n < K
        p_n = p[rows, n]  # [B, V]
        if bug == "bonus_from_p_K":
            p_n = torch.where(rejected[:, None], p_n, p[:, K - 1])
        q_n = q[rows, n.clamp(max=K - 1)] * rejected[:, None] if K else torch.zeros_like(p_n)  # K = 0: no draft
        residual = (p_n - q_n).clamp(min=0)
        if bug == "recover_from_p":
            residual = p_n
        mass = residual.sum(-1, keepdim=True)
        residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_n)
        extra = residual.argmax(-1) if chain.greedy else torch.multinomial(residual, 1, generator=generator)[:, 0]
        tokens = torch.full((B, K + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.long)
        keep = torch.arange(K)[None] < n[:, None]
        tokens[:, :K] = torch.where(keep, draft_tokens, PLACEHOLDER_TOKEN_ID)
        tokens[rows, n] = extra
        return Verdict(tokens, n)

    verify.__name__ = f"verify_{bug or 'copy'}"
    return verify


class BanLast(LogitsProcessor):
    """A toy prefix-dependent processor: the token that ends the prefix never comes next (logits [V] -> [V])."""

    def __call__(self, prefix, logits):
        return logits.index_fill(-1, torch.tensor([prefix[-1]], device=logits.device), float("-inf"))


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square of observed counts against exact cell probabilities (any shape), cells with
    expected < 5 pooled; 0.0 if a draw hit a zero-probability cell (an impossible outcome is a certain
    failure, not a statistical one). Same statistic as tests/exactness/test_ar_distribution.py."""
    obs = counts.ravel().astype(float)
    exp = probs.ravel() / probs.sum() * obs.sum()
    if obs[exp == 0].sum() > 0:
        return 0.0
    big = exp >= 5
    o, e = list(obs[big]), list(exp[big])
    small_e, small_o = exp[~big & (exp > 0)].sum(), obs[~big & (exp > 0)].sum()
    if small_e >= 5:
        o.append(small_o)
        e.append(small_e)
    elif small_e > 0:  # too little to stand alone: fold into the smallest big cell
        j = int(np.argmin(e))
        o[j] += small_o
        e[j] += small_e
    e = np.array(e) * (sum(o) / sum(e))
    return float(chisquare(o, e).pvalue)


def naive_probs(row: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """float64, written out step by step: temperature, top-k (ties kept), softmax, top-p (boundary kept)."""
    z = row / temperature
    if 0 < top_k < len(z):
        z = np.where(z >= np.sort(z)[::-1][top_k - 1], z, -np.inf)
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p < 1.0:
        keep, mass = np.zeros(len(p), bool), 0.0
        for i in sorted(range(len(p)), key=lambda i: (-p[i], i)):
            if mass >= top_p:
                break
            keep[i], mass = True, mass + p[i]
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    return p


def use_fused_quantized_draft(llm, source: str, bits: int):
    """Give a float32 ``llm`` a bf16 draft with quantized matrices, so that its draft steps take the fused
    C++ decoder layer (csrc/decoder_layer.cpp) while the target stays exact float32."""
    from verispec.models import loader

    draft = loader.load(source, torch.bfloat16)
    assert draft.model.quantize_weights(bits), "the C++ kernels are not built"
    llm.draft = draft
    return llm


def varied_stop(period: int):
    """A draft-side early-stop rule for ``DraftModelDrafter.stop_now``: ends a round at about one position in
    ``period``, chosen by the draft's confidence digits, so rounds end at varied lengths (the real rule decides
    from timings, which a test cannot script). Any draft-side rule must leave the output exact. Its
    ``decisions`` list records every call's answer, ``t_drafts`` the draft cost it was given."""

    def stop_now(self, confidences, t_draft, request) -> bool:
        stop = int(confidences[-1] * 1e7) % period == 0
        stop_now.decisions.append(stop)
        stop_now.t_drafts.append(t_draft)
        return stop

    stop_now.decisions = []  # every decision, so a test can check that rounds both ended early and went on
    stop_now.t_drafts = []  # the draft cost each call was given (the store's, None before one was measured)
    return stop_now


def special_bias(n: int, seed: int = 0) -> torch.Tensor:
    """A random fp32 bias [n] with NaNs whose payload plain rounding would carry into the sign bit
    (0x7FFFFFFF -> 0x8000, 0xFFFFFFFF -> 0x0000) and infinities, in the first tile of 4 columns and in the
    last column (a partial tile when n % 4 != 0)."""
    bias = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    nan, neg_nan = torch.tensor([0x7FFFFFFF, -1], dtype=torch.int32).view(torch.float32)
    bias[1], bias[2], bias[3], bias[n - 2], bias[n - 1] = nan, float("inf"), neg_nan, float("-inf"), nan
    return bias


def bf16_bits(y: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 bits (int16) as at::BFloat16(float) rounds: to nearest even, every NaN -> 0x7FC0 (torch's
    vectorized .to() writes 0xFFFF for a NaN instead): the rule of the kernels' bf16 outputs."""
    u = y.contiguous().view(torch.int32).long() & 0xFFFFFFFF
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
    r = torch.where(y.isnan(), torch.full_like(r, 0x7FC0), r)
    return torch.where(r >= 0x8000, r - 0x10000, r).to(torch.int16)
