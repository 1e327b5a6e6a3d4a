"""Drafters: one small file each, all behind the protocol in base.py.

METHODS maps a method name to a factory ``(llm) -> Drafter``; adding a drafter is adding a file and
one entry here, never a branch in the decoding loop.
"""

from .base import Draft, Drafter, DraftRequest
from .draft_model import DraftModelDrafter

METHODS = {
    "draft": lambda llm: DraftModelDrafter(llm.draft_model().model),
}

__all__ = ["Draft", "Drafter", "DraftRequest", "DraftModelDrafter", "METHODS"]
