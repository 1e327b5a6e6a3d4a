"""The public entry point: ``LLM(target=..., draft=...)``, ``generate`` and ``stream``."""

from __future__ import annotations

import copy
import dataclasses
import gc
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import draft_vocab, drafters
from .drafters import AR
from .config import DRAFT_QUANT_BITS, EngineConfig, SamplingParams, SpecConfig
from .engine import Engine
from .errors import ConfigError, VerispecError
from .heads import DraftHead, load_head
from .models.kv_cache import PrefixCache
from .models.loader import LoadedModel, auto_dtype, load
from .models.registry import DEFAULT_DRAFT, DEFAULT_HEADS, DEFAULT_TARGET
from .spec.costs import Costs
from .frontend import fit_context
from .sampling import Grammars, TokenLogprob
from .stopping import StopChecker
from .tokenizer import Codec
from .tools import Tools

BLOCK_SIZE = 16  # KV cache block of a single request's engine


@dataclass
class GenerationOutput:
    text: str
    token_ids: list[int]  # new tokens only (an EOS that ended generation included)
    stats: dict
    finish_reason: str  # "eos" | "stop" | "length"
    prompt_token_ids: list[int] = field(default_factory=list)
    # with SamplingParams(logprobs=N): one per token of token_ids, the target's own (sampling/logprobs.py)
    logprobs: list[TokenLogprob] | None = None
    # with tools=Tools(...): the calls the text holds (OpenAI's shape) and the text besides them (tools.py)
    tool_calls: list[dict] | None = None
    content: str | None = None


class LLM:
    """A target model (and, for speculative methods, a draft model) ready to generate.

    ``target``/``draft``: a default model name (see ``verispec models list``), an HF directory
    (config.json + *.safetensors), or a .gguf file. With the default target, method "draft" loads the
    default draft model on first use if ``draft`` was not given. ``draft_quant="int4"`` (default) runs
    the draft's matrices in 4 bits on CPU (``"int8"``: 8 bits, ``"none"``: as loaded): cheaper drafting,
    exactly the same output distribution. ``draft_vocab=N`` keeps the draft's LM head to its N most frequent
    tokens (FR-Spec; a table ships for the default draft, ``draft_vocab_table`` names another): cheaper draft
    steps, same output distribution, possibly less acceptance (default: 49,152 rows for the default draft,
    which ships a table; all rows for other drafts; ``draft_vocab=0``: all). ``weights="native"`` (what the
    default "auto" picks on CPU in bf16) keeps a GGUF target's quantized matrices in their GGUF blocks (Q8_0,
    Q4_0, Q5_0, Q4_K, Q5_K, Q6_K): 4.5-8.5 bits read per weight instead of 16, int8 activations per block
    of 512, and each row's logits independent of how many rows a forward carries, so greedy speculative
    output is bitwise the greedy AR output (verify passes of up to 16 tokens). ``draft_weights`` does the
    same for the draft (default: dequantized, then ``draft_quant``).
    """

    def __init__(self, target: str = DEFAULT_TARGET, draft: str | None = None, dtype: str = "auto",
                 device: str | None = None, threads: int | None = None, draft_quant: str | None = "int4",
                 draft_vocab: int | None = None, draft_vocab_table: str | None = None, weights: str = "auto",
                 draft_weights: str = "dequantized", head: str | list[str] | None = None, progress: bool = True):
        self.engine_config = EngineConfig(dtype=dtype, device=device, threads=threads, draft_quant=draft_quant,
                                          draft_vocab=draft_vocab, draft_vocab_table=draft_vocab_table,
                                          weights=weights, draft_weights=draft_weights)
        if threads:
            torch.set_num_threads(threads)
        self.device = self.engine_config.resolved_device()
        self._draft_source = draft or DEFAULT_DRAFT.get(target)
        given = [head] if isinstance(head, (str, Path)) else list(head or [])
        shipped = [h for h in DEFAULT_HEADS.get(target, []) if Path(h).exists()]
        self._head_sources = [str(h) for h in given] or [str(h) for h in shipped]
        self._heads: list[DraftHead] | None = None  # loaded on first use, in the order given
        ec = self.engine_config
        self.dtype = (auto_dtype(target, ec.weights, self.device, self._draft_source) if ec.dtype == "auto"
                      else getattr(torch, ec.dtype))
        self.progress = progress
        self.target: LoadedModel = load(target, self.dtype, self.device, progress=progress, weights=weights)
        self.codec = Codec(self.target.tokenizer, self.target.config.vocab_size)
        self.logit_mask = padding_mask(self.target, self.device)  # [V] bool or None
        self.grammars = Grammars(self.target.tokenizer, self.target.config.vocab_size, self.eos_token_ids)
        self.draft: LoadedModel | None = None
        self.draft_calibrations: dict = {}  # the draft model's confidence -> acceptance, per sampling setting
        self.draft_prefixes = PrefixCache()  # the draft's KV cache from the last request (drafters/draft_model.py)
        self.auto_memory: dict = {}  # what method auto learned of acceptance, for the next request
        self.costs = Costs()  # what the engine measured (spec/costs.py): kept when the engine is rebuilt
        self._engine: Engine | None = None  # built on first use (_engine_for)
        if draft:
            self.draft_model()

    def draft_model(self) -> LoadedModel:
        """The draft model, loaded (and checked against the target's vocabulary) on first use."""
        if self.draft is None:
            if self._draft_source is None:
                raise VerispecError("this method needs a draft model: pass LLM(draft=...) or --draft")
            draft = load(self._draft_source, self.dtype, self.device, progress=self.progress,
                         weights=self.engine_config.draft_weights)
            check_same_vocabulary(self.target, draft)
            cfg = self.engine_config
            rows = cfg.draft_vocab
            if rows is None and draft.model.lm_head.native is not None:
                rows = 0  # a head kept in its GGUF blocks cannot be cut: the named draft's default does not apply
            ids = draft_vocab.head_ids_for(self._draft_source, draft.config.vocab_size, rows,
                                           cfg.draft_vocab_table, always=self.eos_token_ids)
            if ids is not None:
                draft.model.restrict_head(ids)
            if self.engine_config.draft_quant:  # CPU only; elsewhere the draft stays as loaded
                draft.model.quantize_weights(DRAFT_QUANT_BITS[self.engine_config.draft_quant])
            self.draft = draft
        return self.draft

    @property
    def has_head(self) -> bool:
        """Whether a draft head was given (then it must load: a bad one is an error, not skipped) or one ships for this
        target."""
        return bool(self._head_sources)

    def draft_heads(self) -> list[DraftHead]:
        """Every draft head (``head=``: one or a list, at most one a family; default: those that ship for the target,
        one a family; any family heads/io.py reads), loaded and checked against the target on first use: the target's
        parts it reads and, when the file has no LM head, the target's rows for its draft vocabulary; int8 on CPU."""
        if self._heads is None:
            heads = [load_head(h, self.target, self.device, self.dtype) for h in self._head_sources]
            families = [h.config.family for h in heads]
            twice = next((f for f in families if families.count(f) > 1), None)
            if twice:
                raise VerispecError(f"--head: two {twice} heads given; give at most one head of each family")
            self._heads = heads
        return self._heads

    def draft_head(self, method: str | None = None, family: str | None = None) -> DraftHead:
        """The head of ``family`` (None: the first given) for ``method``; a one-line error naming both when there is
        none."""
        if not self._head_sources:
            raise VerispecError(f"method {method or 'eagle'} needs a draft head for this target: pass "
                                "LLM(head=DIR) or --head (verispec train-head makes one)")
        heads = self.draft_heads()
        match = [h for h in heads if family is None or h.config.family == family]
        if not match:
            have = ", ".join(f"{src} is a {h.config.family} head" for src, h in zip(self._head_sources, heads))
            raise VerispecError(f"method {method} needs a {family} head, but {have}")
        return match[0]

    def with_draft_quant(self, draft_quant: str | None) -> LLM:
        """This LLM with its draft in another weight format (``draft_quant`` as in the constructor): target,
        tokenizer and logit mask shared; its own draft model (loaded on first use) and calibrations. For
        side-by-side comparisons (``verispec bench --draft-quant int8,int4``)."""
        other = copy.copy(self)
        other.engine_config = dataclasses.replace(self.engine_config, draft_quant=draft_quant)
        other.draft, other.draft_calibrations, other.draft_prefixes = None, {}, PrefixCache()
        other.auto_memory, other.costs, other._engine = {}, Costs(), None  # its draft's costs are its own
        return other

    @property
    def draft_vocab_rows(self) -> int | None:
        """Tokens the loaded draft may propose when its LM head is restricted (draft_vocab), else None."""
        ids = None if self.draft is None else getattr(self.draft.model, "head_ids", None)
        return None if ids is None else len(ids)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = list(self.target.config.eos_token_ids)
        tok = self.target.tokenizer
        if tok is not None and tok.eos_token_id is not None:
            ids.append(tok.eos_token_id)
        return tuple(dict.fromkeys(ids))

    def generate(self, prompt: str | list[int] | list[dict], params: SamplingParams | None = None, method: str = AR,
                 num_draft_tokens: int = 4, chat: bool = False, system: str | None = None, tools: Tools | None = None,
                 **spec_options) -> GenerationOutput:
        """Generate from ``prompt`` (text, token ids, or a conversation: [{"role": ..., "content": ...}, ...], put
        through the chat template) with ``method`` ("ar", "draft", "ngram", "auto").

        ``tools`` (a conversation's: tools.Tools) go into the chat template; a forced choice constrains the output
        to calls by its grammar (unless ``params`` has one), and the output's ``tool_calls`` and ``content`` are
        the text parsed. ``spec_options``: the other SpecConfig fields (adaptive, min_draft_tokens, ngram_min,
        ngram_max).
        """
        for _ in self._run(prompt, params, _spec(method, num_draft_tokens, spec_options), chat, system, tools):
            pass
        if tools is not None:
            self._last.content, self._last.tool_calls = tools.parse(self._last.text)
        return self._last

    def stream(self, prompt: str | list[int] | list[dict], params: SamplingParams | None = None, method: str = AR,
               num_draft_tokens: int = 4, chat: bool = False, system: str | None = None, tools: Tools | None = None,
               **spec_options) -> Iterator[str]:
        """Yield text pieces as tokens are committed (each accepted run at once, for speculative methods).

        The pieces concatenate to ``generate(...).text``; afterwards ``last_output`` holds the full output.
        """
        if not self.codec.has_tokenizer:
            raise VerispecError("streaming text needs a tokenizer; this model takes token ids only")
        for stopper in self._run(prompt, params, _spec(method, num_draft_tokens, spec_options), chat, system, tools):
            piece = stopper.stream_piece()
            if piece:
                yield piece

    @property
    def last_output(self) -> GenerationOutput | None:
        return getattr(self, "_last", None)

    def make_drafter(self, spec: SpecConfig):
        """A drafter for one request of ``spec.method`` (None for plain decoding)."""
        drafters.check_method(spec.method)
        drafter = drafters.METHODS[spec.method](self, spec) if spec.method != AR else None
        adaptive = drafter is not None and (drafter.adaptive_by_default if spec.adaptive is None else spec.adaptive)
        if adaptive and not drafter.adaptive:
            # adaptive K is auto's choice with one candidate (n-gram drafts: per match length)
            drafter = drafters.AutoDrafter({spec.method: drafter}, spec.min_draft_tokens, spec.num_draft_tokens,
                                           allow_no_spec=False)
        return drafter

    def _engine_for(self, tokens: int) -> Engine:
        """The one engine behind generate and stream: built on first use, rebuilt (with twice the KV slots) only when
        a request needs more than it holds. Its chunk holds the whole context, so a prompt is read in one forward,
        and it runs one request at a time: streams pulled in turn queue behind each other (each pull advances
        whichever runs), so no output depends on another. A request too big for it while others are in it gets an
        engine of its own."""
        blocks = -(-tokens // BLOCK_SIZE)
        if self._engine is not None and self._engine.blocks.num_blocks >= blocks:
            return self._engine
        old = 0 if self._engine is None else self._engine.blocks.num_blocks
        chunk = -(-self.target.config.max_position_embeddings // BLOCK_SIZE) * BLOCK_SIZE
        make = lambda n: Engine(self.target.model, n, BLOCK_SIZE, max_num_seqs=1,  # noqa: E731
                                max_num_batched_tokens=chunk, chunk_size=chunk, logit_mask=self.logit_mask,
                                eos_token_ids=self.eos_token_ids, prefix_reuse=False, costs=self.costs,
                                grammars=self.grammars)
        if self._engine is not None and self._engine.requests:
            return make(blocks)
        self._engine = None  # free the old cache first
        self._engine = make(max(blocks, 2 * old))
        return self._engine

    def _run(self, prompt, params: SamplingParams | None, spec: SpecConfig, chat: bool, system: str | None,
             tools: Tools | None = None):
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ConfigError("params must be a verispec.SamplingParams")
        if tools is not None and not isinstance(tools, Tools):
            raise ConfigError("tools must be a verispec.tools.Tools")
        drafters.check_method(spec.method)
        prompt_ids = self.codec.encode(prompt, chat=chat, system=system,
                                       tools=tools.template_tools() if tools is not None else None)
        if tools is not None and tools.forced and params.constraint is None:
            params = dataclasses.replace(params, grammar=tools.grammar(self.grammars.literal))
        fit_context(len(prompt_ids), params.max_new_tokens, self.target.config.max_position_embeddings)
        # One request in the engine that serves batches (engine/engine.py): the prompt read in one forward, K drafts
        # a step (the drafter may stop early), as in a batch; the drafter is made for the K the engine sets.
        K = spec.num_draft_tokens if spec.method != AR else 0
        engine = self._engine_for(len(prompt_ids) + params.max_new_tokens + K + 1)
        req = engine.add(prompt_ids, params, lambda k: self.make_drafter(spec.with_k(k)), K, fixed_k=True)
        stopper = StopChecker(params, self.eos_token_ids, self.codec)
        t0 = time.perf_counter()
        # Python's cycle collector would walk every live object (models, tokenizer) ~once per step here: off
        # while decoding (measured: docs/BENCHMARKS.md, "Draft step cost"); tensors are still freed by
        # reference counting.
        gc_was_on = gc.isenabled()
        gc.disable()
        try:
            consumed = 0
            while not stopper.finished:
                new = req.output_ids[consumed:]  # what the last steps committed for it (any stream's pull)
                if new:
                    consumed += len(new)
                    stopper.append(new)
                    req.stats.wall_s = time.perf_counter() - t0
                    yield stopper
                elif req.finished:
                    if req.error is not None:
                        raise req.error
                    break
                else:
                    engine.step()  # advances whichever request runs: this one, or a stream pulled before it
        finally:
            engine.abort(req.request_id)
            if gc_was_on:
                gc.enable()
        stats = req.stats
        stats.wall_s = time.perf_counter() - t0
        stats.new_tokens = len(stopper.token_ids)
        logprobs = req.logprobs[:len(stopper.token_ids)] if params.logprobs is not None else None
        self._last = GenerationOutput(stopper.finalize(), stopper.token_ids, stats.as_dict(),
                                      stopper.finish_reason, prompt_ids, logprobs)
        yield stopper


def _spec(method: str, num_draft_tokens: int, options: dict) -> SpecConfig:
    known = set(SpecConfig.__dataclass_fields__) - {"method", "num_draft_tokens"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ConfigError(f"unknown option {unknown[0]!r} (speculative options: {', '.join(sorted(known))})")
    return SpecConfig(method, num_draft_tokens, **options)


def padding_mask(loaded: LoadedModel, device) -> torch.Tensor | None:
    """[V] bool, True for embedding rows that are padding, not tokens (never sampled, never drafted)."""
    V = loaded.config.vocab_size
    ids = set(loaded.config.masked_token_ids)
    if loaded.tokenizer is not None and len(loaded.tokenizer) < V:
        ids.update(range(len(loaded.tokenizer), V))
    if not ids:
        return None
    mask = torch.zeros(V, dtype=torch.bool)
    mask[sorted(ids)] = True
    return mask.to(device)


def check_same_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    """Speculative decoding compares token ids: draft and target must share the tokenizer."""
    t, d = target.tokenizer, draft.tokenizer
    if t is not None and d is not None:
        if t.get_vocab() == d.get_vocab():
            return
        raise VerispecError(f"draft {draft.source} ({len(d)} tokens) and target {target.source} ({len(t)} tokens) "
                            f"have different vocabularies: speculative decoding needs the same tokenizer")
    if draft.config.vocab_size != target.config.vocab_size:
        raise VerispecError(f"draft {draft.source} ({draft.config.vocab_size} rows) and target {target.source} "
                            f"({target.config.vocab_size} rows) have different vocabularies")
