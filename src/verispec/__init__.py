"""verispec: lossless speculative decoding for LLMs, fast on the hardware you have."""

import os as _os

# Large tensors on 2 MiB transparent huge pages (PyTorch's CPU allocator honours this flag when it is
# set before its first large allocation): fewer TLB misses while streaming weights, a faster decode
# (measured: docs/BENCHMARKS.md, "bf16 (dequantized) target"). Set THP_MEM_ALLOC_ENABLE=0 to opt out.
_os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from .config import EngineConfig, SamplingParams  # noqa: E402
from .errors import ConfigError, VerispecError  # noqa: E402
from .llm import LLM, GenerationOutput  # noqa: E402

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "GenerationOutput", "EngineConfig", "VerispecError", "ConfigError"]
