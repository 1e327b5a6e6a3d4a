"""llama.cpp (through llama-cpp-python) on the same GGUF file, timed the same way as ours.

Two modes, each with llama-cpp-python's own defaults for its speculative knob (what a user gets):
``llamacpp`` (plain decoding) and ``llamacpp-lookup`` (its prompt-lookup draft,
``LlamaPromptLookupDecoding``: n-grams of up to 2 tokens, 10 drafted tokens). Its high-level API has no
separate draft model. Optional: ``pip install llama-cpp-python`` (it compiles llama.cpp, a few minutes).

On a CPU with AMX-INT8, llama.cpp repacks Q4_K / Q6_K weights for its AMX kernels (an "extra buffer type"),
and on a 2-core Xeon VM here its first matrix product then segfaulted, killing the whole bench
(ggml-org/llama.cpp#20824, open upstream). There the peer loads the file without extra buffer types (its
AVX512 kernels) and says so on stderr.

With a draft model (the lookup mode) llama-cpp-python keeps logits for every position it evaluates, but sizes that
buffer (``Llama.scores``) by ``logits_all`` alone, to ``n_batch`` (512) rows: a prompt past 512 tokens then failed in
``Llama.eval`` with "could not broadcast input array from shape (77791232,) into shape (0,)" (512 rows x Qwen's
151,936 logits into none). The lookup context is made with ``logits_all=True``, which sizes it to the context.
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path

from ..config import SamplingParams
from ..errors import VerispecError

CONTEXT = 4096  # tokens of KV cache by default (verispec bench sizes it with context_for)
LOOKUP_DRAFT_TOKENS = 10  # LlamaPromptLookupDecoding's default num_pred_tokens


def context_for(prompt_tokens: int, max_new_tokens: int) -> int:
    """A context that holds a prompt of ``prompt_tokens``, ``max_new_tokens`` and one round of lookup drafts past
    them, in whole 256-token pages (at least 512)."""
    need = prompt_tokens + max_new_tokens + LOOKUP_DRAFT_TOKENS + 1
    return max(512, -(-need // 256) * 256)


def gguf_file(source: str) -> Path:
    """The GGUF file behind ``source`` (a registry name or a .gguf path); llama.cpp reads nothing else."""
    from ..models import registry

    if source in registry.REGISTRY:
        return registry.gguf_path(source)
    path = Path(source)
    if path.suffix != ".gguf" or not path.is_file():
        raise VerispecError(f"--peers llamacpp needs a GGUF target (a .gguf file or a registry name), got {source}")
    return path


def amx_cpu() -> bool:
    """Whether this CPU has AMX-INT8 (Linux: the amx_int8 flag in /proc/cpuinfo)."""
    try:
        return " amx_int8" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


@contextlib.contextmanager
def without_extra_buffers():
    """Models made inside load without llama.cpp's extra buffer types (its weight repacking, AMX included):
    llama-cpp-python's Llama() takes its model parameters from llama_model_default_params(), which has no
    keyword of its own, so that function is swapped for the duration."""
    import llama_cpp.llama_cpp as lib

    default = lib.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    lib.llama_model_default_params = params
    try:
        yield
    finally:
        lib.llama_model_default_params = default


class LlamaCppPeer:
    modes = ["llamacpp", "llamacpp-lookup"]

    def __init__(self, source: str, threads: int, context: int = CONTEXT, timeout: float | None = None):
        try:
            import llama_cpp
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        except ImportError:
            raise VerispecError("--peers llamacpp needs llama-cpp-python: pip install llama-cpp-python") from None
        path = str(gguf_file(source))
        kw = dict(n_ctx=context, n_threads=threads, n_threads_batch=threads, verbose=False)
        plain = amx_cpu()
        if plain:
            print("llama.cpp peer: AMX CPU, its weight repacking off (it segfaults here: ggml-org/llama.cpp#20824)",
                  file=sys.stderr)
        try:  # two contexts on one mmapped file: the lookup draft is fixed when a context is made
            with without_extra_buffers() if plain else contextlib.nullcontext():
                self.models = {"llamacpp": llama_cpp.Llama(path, **kw),
                               "llamacpp-lookup": llama_cpp.Llama(path, draft_model=LlamaPromptLookupDecoding(),
                                                                  logits_all=True, **kw)}
        except Exception as e:  # llama-cpp-python raises ValueError / RuntimeError with its own wording
            raise VerispecError(f"llama.cpp cannot load {path}: {str(e).splitlines()[0][:200]}") from None
        self.context, self.timeout = context, timeout

    def generate(self, prompt_ids: list[int], max_new_tokens: int, mode: str = "llamacpp",
                 params: SamplingParams | None = None) -> tuple[list[int], float]:
        """Generate exactly max_new_tokens (EOS does not stop it); return (new token ids, wall seconds). A TimeoutError
        once a run has taken ``timeout`` seconds (checked between tokens)."""
        params = params or SamplingParams()
        if len(prompt_ids) + max_new_tokens > self.context:
            raise VerispecError(f"llama.cpp peer: {len(prompt_ids)} + {max_new_tokens} tokens exceed its "
                                f"{self.context}-token context")
        model = self.models[mode]
        model.reset()  # no prompt cache from an earlier run: every run pays its own prefill
        if not params.greedy and params.seed is not None:
            model.set_seed(params.seed)
        sampling = dict(temp=0.0, top_k=1) if params.greedy else dict(
            temp=params.temperature, top_k=params.top_k, top_p=params.top_p)
        out = []
        t0 = time.perf_counter()
        for token in model.generate(prompt_ids, min_p=0.0, typical_p=1.0, repeat_penalty=1.0, **sampling):
            out.append(int(token))
            if len(out) == max_new_tokens:
                break
            if self.timeout is not None and time.perf_counter() - t0 > self.timeout:
                raise TimeoutError(f"{mode}: {len(out)} of {max_new_tokens} tokens in {self.timeout:g} s")
        return out, time.perf_counter() - t0
