"""Hugging Face transformers on the same checkpoint and dtype, timed the same way as ours."""

from __future__ import annotations

import copy
import time
from pathlib import Path

import torch

from ..errors import VerispecError


class HFPeer:
    name = "hf"

    def __init__(self, source: str, dtype: torch.dtype, device: str, suppress: list[int] | None = None):
        import transformers

        from ..models import registry

        transformers.logging.set_verbosity_error()
        path = registry.pull(source) if source in registry.REGISTRY else Path(source)
        kw = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
        root = path.parent if kw else path
        try:
            self.model = transformers.AutoModelForCausalLM.from_pretrained(str(root), dtype=dtype, **kw).to(device)
        except Exception as e:
            raise VerispecError(f"transformers cannot load {source}: {str(e).splitlines()[0][:200]}") from None
        self.model.eval()
        self.device = device
        # No EOS: generate exactly max_new_tokens without masking any logit (min_new_tokens would).
        self.gen_config = copy.deepcopy(self.model.generation_config)
        self.gen_config.eos_token_id = []  # None falls back to the model config's EOS
        self.gen_config.pad_token_id = 0
        self.gen_config.do_sample = False
        if suppress:  # the padding rows verispec never samples
            self.gen_config.suppress_tokens = list(suppress)

    @torch.inference_mode()
    def greedy(self, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], float]:
        """Greedy-generate exactly max_new_tokens; return (new token ids, wall seconds)."""
        ids = torch.tensor([prompt_ids], device=self.device)
        t0 = time.perf_counter()
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=self.gen_config,
                                  max_new_tokens=max_new_tokens)
        if ids.is_cuda:
            torch.cuda.synchronize()
        return out[0, len(prompt_ids):].tolist(), time.perf_counter() - t0
