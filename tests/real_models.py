"""Shared by the real-weight (slow) tests: the default models and the prompts they are checked on.

No skip when the weights are missing: CI installs the `[models]` extra, and a skipped real-model test
would hide a broken install step.
"""

TARGET = "qwen2.5-coder-1.5b-instruct"
DRAFT = "qwen2.5-coder-0.5b-instruct"
N_TOKENS = 32
K = 4  # draft tokens per round in the float32 speculative runs (slow/conftest.py)
PROMPTS = {
    "code": dict(text='def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n', chat=False),
    "prose": dict(text="The history of the printing press begins in", chat=False),
    "chat": dict(text="Write a Python one-liner that reverses a string.", chat=True),
}
# the float32 runs (~2 tokens/s for the target alone here): a raw prompt and a chat-templated one
FLOAT32_PROMPTS = {key: PROMPTS[key] for key in ("code", "chat")}


def pull(name: str):
    """The converted model directory (assembled and converted on first use)."""
    from verispec.models import registry

    return registry.pull(name, progress=False)
