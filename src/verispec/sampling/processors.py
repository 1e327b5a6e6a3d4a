"""Logits processors: each one is applied to ONE row's logits given that row's prefix, and a chain of them ends in
the sampler's own transforms (temperature, top-k, top-p).

A row's prefix is every token before the token the row chooses: the committed context, plus, in a verify pass,
the drafts before the row (row i of a verify pass: context + x_1..x_{i-1}). A penalty, a logit bias or a grammar
mask is a function of that prefix, so it must see the drafts: that is what keeps speculative decoding exact with
any processor (spec/verify.py).

The chain, in order (vLLM's and transformers' order: processors, then the warpers):

1. the vocabulary padding mask (PaddingMask), then any extra processors, then the params' own (the response
   format's grammar mask: grammar.py; logit bias, penalties, min-p), on the logits;
2. temperature, top-k, softmax, top-p (``logits_to_probs``: top-p is a filter on probabilities, so it comes
   after the softmax; greedy params give the one-hot argmax instead).

Fast path: a processor that ignores the prefix says so with the class attribute ``prefix_independent = True``
and is then called once on every row at once; the others are called row by row.
"""

from __future__ import annotations

import math

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

from ..config import SamplingParams
from ..errors import ConfigError
from .transforms import logits_to_probs, mask_logits


class LogitsProcessor(Protocol):
    """``__call__(prefix, logits) -> logits``: one row's logits [V] given its prefix -> the processed row [V] (a new
    tensor: never modify ``logits``, which may be the caller's). ``prefix`` is valid during the call only.

    Subclass it to inherit the defaults. A processor with ``prefix_independent = True`` is instead called once with
    every row, ``logits`` [..., V], and ``prefix`` None.
    """

    prefix_independent: ClassVar[bool] = False

    def __call__(self, prefix: Sequence[int] | None, logits: torch.Tensor) -> torch.Tensor: ...


class PaddingMask(LogitsProcessor):
    """Rows of the embedding that are not real tokens (mask [V], True = padding) can never be chosen."""

    prefix_independent = True

    def __init__(self, mask: torch.Tensor):
        self.mask = mask  # [V] bool

    def __call__(self, prefix: Sequence[int] | None, logits: torch.Tensor) -> torch.Tensor:
        return mask_logits(logits, self.mask)


class Prefix(Sequence[int]):
    """The token ids before one row, ``context + drafts``, as a read-only sequence that copies neither (a verify
    pass has K + 1 of them over a context of any length). ``drafts``: ints, a 1-D tensor or one-element tensors,
    read (a device sync) only when a processor looks at them."""

    __slots__ = ("context", "drafts")

    def __init__(self, context: Sequence[int], drafts: Sequence[int] | torch.Tensor = ()):
        self.context, self.drafts = context, drafts

    def __len__(self) -> int:
        return len(self.context) + len(self.drafts)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"prefix index {i} out of range for length {n}")
        i %= n
        c = len(self.context)
        return self.context[i] if i < c else int(self.drafts[i - c])


    def tail(self, start: int) -> list[int]:
        """``list(self[start:])`` without a Python loop over the context (a penalty reads the output so far)."""
        c = len(self.context)
        drafts = self.drafts.tolist() if isinstance(self.drafts, torch.Tensor) else [int(t) for t in self.drafts]
        return list(self.context[start:]) + drafts[max(start - c, 0):]


class LogitBias(LogitsProcessor):
    """OpenAI's ``logit_bias``: a fixed amount added to chosen tokens' logits (-100 bans, +100 all but forces)."""

    prefix_independent = True

    def __init__(self, bias: dict[int, float]):
        self.ids = torch.tensor(sorted(bias), dtype=torch.long)
        self.values = torch.tensor([float(bias[i]) for i in sorted(bias)])

    def __call__(self, prefix, logits: torch.Tensor) -> torch.Tensor:
        ids, values = self.ids.to(logits.device), self.values.to(logits.device, logits.dtype)
        return logits.index_add(-1, ids, values.expand(*logits.shape[:-1], -1))


class Penalties(LogitsProcessor):
    """Repetition, frequency and presence penalties (vLLM's and OpenAI's rules) from the row's own prefix, drafts
    before the row included: the repetition penalty r divides a positive logit (multiplies a negative one) of any
    token seen in prompt or output; then each token the output holds loses ``frequency`` per occurrence and
    ``presence`` once. The output starts at ``prompt_len``."""

    def __init__(self, prompt_len: int, presence: float = 0.0, frequency: float = 0.0, repetition: float = 1.0):
        self.prompt_len, self.presence, self.frequency, self.repetition = prompt_len, presence, frequency, repetition

    def __call__(self, prefix, logits: torch.Tensor) -> torch.Tensor:
        V = logits.shape[-1]
        out = torch.tensor(prefix.tail(self.prompt_len) if isinstance(prefix, Prefix) else list(prefix)[self.prompt_len:],
                           dtype=torch.long, device=logits.device)
        logits = logits.clone()
        if self.repetition != 1.0:
            seen = torch.zeros(V, dtype=torch.bool, device=logits.device)
            whole = prefix.tail(0) if isinstance(prefix, Prefix) else list(prefix)
            seen[torch.tensor(whole, dtype=torch.long, device=logits.device)] = True
            hit = logits[seen]
            logits[seen] = torch.where(hit > 0, hit / self.repetition, hit * self.repetition)
        if len(out) and (self.frequency or self.presence):
            counts = torch.bincount(out, minlength=V)[:V].to(logits.dtype)
            logits -= self.frequency * counts + self.presence * (counts > 0).to(logits.dtype)
        return logits


class MinP(LogitsProcessor):
    """min-p sampling: tokens whose probability (at the request's temperature) is under ``min_p`` times the
    likeliest one's are dropped; on logits, those below max + T ln(min_p). Greedy decoding is unchanged."""

    prefix_independent = True

    def __init__(self, min_p: float, temperature: float):
        self.min_p, self.temperature = min_p, temperature

    def __call__(self, prefix, logits: torch.Tensor) -> torch.Tensor:
        top = logits.max(dim=-1, keepdim=True).values
        return logits.masked_fill(logits < top + self.temperature * math.log(self.min_p), float("-inf"))


def row_prefixes(contexts: Sequence[Sequence[int]], draft_tokens: torch.Tensor) -> list[Prefix]:
    """The prefix of every verify row, batch-major: [B * (K + 1)], row (b, i) = contexts[b] + draft_tokens[b, :i]
    for i = 0..K (draft_tokens [B, K]; contexts: B committed contexts, each the tokens before row 0)."""
    B, K = draft_tokens.shape
    if len(contexts) != B:
        raise ValueError(f"{len(contexts)} contexts for {B} rows of drafts")
    return [Prefix(contexts[b], draft_tokens[b, :i]) for b in range(B) for i in range(K + 1)]


@dataclass(frozen=True, eq=False)
class ProcessorChain:
    """Logits -> probabilities for one request: ``processors`` in order, then ``logits_to_probs(., params)``."""

    params: SamplingParams
    processors: tuple[LogitsProcessor, ...] = ()

    @classmethod
    def from_params(cls, params: SamplingParams, mask: torch.Tensor | None = None,
                    extra: Sequence[LogitsProcessor] = (), prompt_len: int = 0, grammars=None) -> ProcessorChain:
        """The padding mask (mask [V], True = padding; None: none), then ``extra``, then the params' processors
        (the response format's or grammar's mask, logit bias, penalties, min-p; the mask and the penalties read the
        output from ``prompt_len`` on), then their transforms (temperature, top-k, top-p: ``logits_to_probs``).
        ``grammars``: the model's ``grammar.Grammars``, needed by a request with a response format."""
        procs = [PaddingMask(mask)] if mask is not None else []
        procs += list(extra)
        if params.constraint is not None:
            if grammars is None:
                raise ConfigError(f"{'grammar' if params.grammar else 'response_format'} needs the model's tokenizer:"
                                  " none was given to this engine")
            procs.append(grammars.mask(params.constraint, prompt_len))
        if params.logit_bias:
            procs.append(LogitBias(dict(params.logit_bias)))
        if params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0:
            procs.append(Penalties(prompt_len, params.presence_penalty, params.frequency_penalty,
                                   params.repetition_penalty))
        if params.min_p and not params.greedy:
            procs.append(MinP(params.min_p, params.temperature))
        return cls(params, tuple(procs))

    @property
    def greedy(self) -> bool:
        return self.params.greedy

    @property
    def prefix_independent(self) -> bool:
        """True when no processor reads the prefix: callers may then pass prefixes=None."""
        return all(p.prefix_independent for p in self.processors)

    def logits(self, prefixes: Sequence[Sequence[int]] | None, logits: torch.Tensor) -> torch.Tensor:
        """logits [..., V] -> the processors' output [..., V] (the sampler's transforms not applied). prefixes: one
        per row of logits, rows in row-major order of the leading dimensions; None for a prefix-independent chain."""
        if prefixes is None and not self.prefix_independent:
            raise ValueError("a processor of this chain reads the prefix: pass one prefix per row")
        for proc in self.processors:
            if proc.prefix_independent:
                logits = proc(None, logits)
                continue
            rows = logits.reshape(-1, logits.shape[-1])  # [R, V]
            if len(prefixes) != len(rows):
                raise ValueError(f"{len(prefixes)} prefixes for {len(rows)} rows of logits")
            logits = torch.stack([proc(prefix, row) for prefix, row in zip(prefixes, rows)]).view(logits.shape)
        return logits

    def probs(self, prefixes: Sequence[Sequence[int]] | None, logits: torch.Tensor) -> torch.Tensor:
        """logits [..., V] -> probabilities [..., V] float32 (greedy: the one-hot of the processed argmax)."""
        return logits_to_probs(self.logits(prefixes, logits), self.params)
