"""Built-in prompts for the decode benchmark (written for this project)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    text: str


DECODE_PROMPTS = (
    Prompt("code-lru", "coding", "Write a Python class LRUCache with get and put methods in O(1) time. "
           "Include type hints and a short docstring."),
    Prompt("code-csv", "coding", "Write a Python function that reads a CSV file, groups rows by the 'region' "
           "column and returns the mean of the 'sales' column per region, without pandas."),
    Prompt("prose-tides", "writing", "Explain to a curious ten-year-old why the sea has tides, in two short "
           "paragraphs."),
    Prompt("prose-email", "writing", "Write a polite email to a landlord asking for the heating to be repaired "
           "before the weekend."),
)
