"""Hugging Face transformers on the same checkpoints and dtype, timed the same way as ours.

Three ways to call ``generate()``, each with transformers' own defaults for its speculative knobs (what a
user gets): plain; ``assistant_model=`` with our draft model (20 assistant tokens, confidence-based early
stop); ``prompt_lookup_num_tokens=`` (n-gram lookup in the prompt).
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

import torch

from ..config import SamplingParams
from ..errors import VerispecError

PROMPT_LOOKUP_TOKENS = 10  # transformers' documentation example


def _load_hf(source: str, dtype: torch.dtype, device: str):
    import transformers

    from ..models import registry

    path = registry.pull(source) if source in registry.REGISTRY else Path(source)
    kw = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    root = path.parent if kw else path
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(root), dtype=dtype, **kw).to(device)
    except Exception as e:
        raise VerispecError(f"transformers cannot load {source}: {str(e).splitlines()[0][:200]}") from None
    return model.eval()


class HFPeer:
    """transformers ``generate()``: modes "hf" (plain), "hf-assistant" (needs ``draft``), "hf-lookup"."""

    def __init__(self, source: str, dtype: torch.dtype, device: str, suppress: list[int] | None = None,
                 draft: str | None = None, timeout: float | None = None):
        import transformers

        transformers.logging.set_verbosity_error()
        self.model = _load_hf(source, dtype, device)
        self.assistant = _load_hf(draft, dtype, device) if draft else None
        self.device, self.timeout = device, timeout
        # No EOS: generate exactly max_new_tokens without masking any logit (min_new_tokens would).
        self.gen_config = copy.deepcopy(self.model.generation_config)
        self.gen_config.eos_token_id = []  # None falls back to the model config's EOS
        self.gen_config.pad_token_id = 0
        self.gen_config.do_sample = False
        for key in ("top_k", "top_p", "temperature", "repetition_penalty"):  # no checkpoint sampling defaults
            setattr(self.gen_config, key, None)
        if suppress:  # the padding rows verispec never samples
            self.gen_config.suppress_tokens = list(suppress)

    @property
    def modes(self) -> list[str]:
        return ["hf"] + (["hf-assistant"] if self.assistant is not None else []) + ["hf-lookup"]

    def _config(self, params: SamplingParams):
        cfg = copy.deepcopy(self.gen_config)
        if not params.greedy:
            cfg.do_sample, cfg.temperature = True, params.temperature
            cfg.top_k = params.top_k or None
            cfg.top_p = params.top_p if params.top_p < 1.0 else None
        return cfg

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_new_tokens: int, mode: str = "hf",
                 params: SamplingParams | None = None) -> tuple[list[int], float]:
        """Generate exactly max_new_tokens; return (new token ids, wall seconds). A TimeoutError once a run has taken
        ``timeout`` seconds (generate's ``max_time``, checked between tokens)."""
        params = params or SamplingParams()
        kw = {"hf": {}, "hf-assistant": {"assistant_model": self.assistant},
              "hf-lookup": {"prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS}}[mode]
        if not params.greedy and params.seed is not None:
            torch.manual_seed(params.seed)
        ids = torch.tensor([prompt_ids], device=self.device)
        t0 = time.perf_counter()
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=self._config(params),
                                  max_new_tokens=max_new_tokens, max_time=self.timeout, **kw)
        if ids.is_cuda:
            torch.cuda.synchronize()
        tokens = out[0, len(prompt_ids):].tolist()
        if len(tokens) < max_new_tokens:  # no EOS: only max_time stops it early
            raise TimeoutError(f"{mode}: {len(tokens)} of {max_new_tokens} tokens"
                               + (f" in {self.timeout:g} s" if self.timeout is not None else ""))
        return tokens, time.perf_counter() - t0
