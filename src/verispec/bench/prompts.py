"""Built-in prompts for `verispec bench` (written for this project)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    text: str


DECODE_PROMPTS = (  # code and prose alternate, so --limit N keeps both kinds
    Prompt("code-lru", "coding", "Write a Python class LRUCache with get and put methods in O(1) time. "
           "Include type hints and a short docstring."),
    Prompt("prose-tides", "writing", "Explain to a curious ten-year-old why the sea has tides, in two short "
           "paragraphs."),
    Prompt("code-csv", "coding", "Write a Python function that reads a CSV file, groups rows by the 'region' "
           "column and returns the mean of the 'sales' column per region, without pandas."),
    Prompt("prose-email", "writing", "Write a polite email to a landlord asking for the heating to be repaired "
           "before the weekend."),
    Prompt("code-bsearch", "coding", "Implement binary search over a sorted list in Python, returning the index "
           "of the target or -1, and add three doctest examples."),
    Prompt("prose-story", "writing", "Write the opening paragraph of a short story about a lighthouse keeper who "
           "finds a message in a bottle."),
    Prompt("code-js-debounce", "coding", "Write a JavaScript debounce(fn, wait) function and show how to use it "
           "on a window resize handler."),
    Prompt("prose-review", "writing", "Write a short, balanced review of a neighbourhood cafe that has great "
           "coffee but slow service."),
)
