"""verispec: lossless speculative decoding for LLMs, fast on the hardware you have."""

from .config import EngineConfig, SamplingParams
from .errors import ConfigError, VerispecError
from .llm import LLM, GenerationOutput

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "GenerationOutput", "EngineConfig", "VerispecError", "ConfigError"]
