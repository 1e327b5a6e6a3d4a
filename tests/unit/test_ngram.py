"""The n-gram index: matches, longest-match preference, most recent occurrence, incremental updates."""

import random

import pytest
import torch

from verispec import SamplingParams
from verispec.drafters import DraftRequest, NgramDrafter, NgramIndex


def index(tokens, n_min=1, n_max=3):
    ix = NgramIndex(n_min, n_max)
    ix.extend(tokens)
    return ix


def test_continuation_of_the_match():
    assert index([1, 2, 3, 4, 9, 2, 3]).lookup(5) == ([4, 9, 2, 3], 2)  # "2 3" seen before: what followed it
    assert index([1, 2, 3, 4, 9, 2, 3]).lookup(2) == ([4, 9], 2)  # at most K tokens


def test_longest_match_is_preferred():
    # suffix "7 8": the 1-gram "8" last occurred at position 5 (-> 1), the 2-gram "7 8" at position 1 (-> 5)
    toks = [7, 8, 5, 6, 0, 8, 1, 7, 8]
    assert index(toks).lookup(1) == ([5], 2)
    assert index(toks, n_max=1).lookup(1) == ([1], 1)


def test_most_recent_occurrence_wins():
    assert index([5, 1, 5, 2, 5]).lookup(1) == ([2], 1)


def test_no_match_and_no_self_match():
    assert index([1, 2, 3]).lookup(4) == ([], 0)
    assert index([4]).lookup(4) == ([], 0)  # the suffix itself is not an earlier occurrence
    assert index([1, 2, 3, 1, 2], n_min=3).lookup(4) == ([], 0)  # only a 2-gram matches; 3 required


def test_repetition_overlapping_the_suffix():
    assert index([9, 9, 9, 9], n_max=2).lookup(3) == ([9], 2)  # "9 9" last seen at 1-2, followed by one 9


def test_incremental_equals_from_scratch():
    rng = random.Random(0)
    toks = [rng.randrange(6) for _ in range(300)]
    inc = NgramIndex(1, 4)
    for end in range(0, 301, 7):
        inc.extend(toks[:end])
        ref = index(toks[:end], 1, 4)
        assert inc.tables == ref.tables and inc.lookup(5) == ref.lookup(5), end


def test_a_different_text_rebuilds():
    ix = index([1, 2, 3, 1])
    ix.extend([5, 6, 5])
    assert ix.lookup(3) == ([6, 5], 1) and (2, 3) not in ix.tables[2]


def test_bad_bounds():
    for lo, hi in ((0, 2), (3, 2)):
        with pytest.raises(ValueError):
            NgramIndex(lo, hi)


def _request(context, K, mask=None):
    return DraftRequest(context, K, SamplingParams(), None, 100, 10, mask)


def test_drafter_is_deterministic_and_skips_masked_rows():
    d = NgramDrafter(1, 3)
    draft = d.propose(_request([1, 2, 3, 4, 1, 2], 3))
    assert draft.tokens.tolist() == [[3, 4, 1]] and draft.draft_probs is None and draft.tokens.dtype == torch.long
    mask = torch.zeros(10, dtype=torch.bool)
    mask[4] = True  # a padding row is never proposed: the draft stops before it
    assert d.propose(_request([1, 2, 3, 4, 1, 2], 3, mask)).tokens.tolist() == [[3]]
    assert d.propose(_request([1, 2, 3], 3)).tokens.shape == (1, 0)  # nothing matches: an empty draft
