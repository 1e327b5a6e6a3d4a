"""The ``verispec`` field of streamed chunks: each chunk's text split by origin (accepted drafts or the target's own
token), pieces that make the whole text, never past a stop string, and running counts that end at the usage."""

from __future__ import annotations

from conftest import MODEL
from verispec import SamplingParams
from verispec.frontend import Piece, feed as detokenize
from verispec.stopping import StopChecker

ASK = dict(model=MODEL, prompt="abc abc abc abc abc abc", max_tokens=48, temperature=0)


def origins(chunks) -> list[dict]:
    return [c.model_extra["verispec"] for c in chunks if c.choices]


def test_pieces_split_each_chunk_and_make_the_whole_text(client, fixed_k):
    out = client.completions.create(**ASK)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **ASK))
    split = origins(chunks)
    for chunk, origin in zip([c for c in chunks if c.choices], split):
        assert "".join(p["text"] for p in origin["pieces"]) == chunk.choices[0].text
        assert all(p["text"] for p in origin["pieces"])
    pieces = [p for origin in split for p in origin["pieces"]]
    assert "".join(p["text"] for p in pieces) == out.choices[0].text
    stats = out.model_extra["metrics"]["speculative_decoding"]
    assert stats["num_accepted_tokens"] > 0  # fixed K on a repetitive prompt: the n-gram drafts get accepted
    assert {p["draft"] for p in pieces} == {True, False}
    last = split[-1]
    assert (last["completion_tokens"], last["num_draft_tokens"], last["num_accepted_tokens"]) == (
        chunks[-1].usage.completion_tokens, stats["num_draft_tokens"], stats["num_accepted_tokens"])
    counts = [o["completion_tokens"] for o in split]
    assert counts == sorted(counts) and counts[0] >= 1


def test_pieces_stop_at_a_stop_string(client, fixed_k):
    whole = client.completions.create(**ASK).choices[0].text
    stop = next(ch for ch in whole[5:] if ch.isascii() and ch.isprintable())
    chunks = list(client.completions.create(stop=stop, stream=True, **ASK))
    assert "".join(p["text"] for o in origins(chunks) for p in o["pieces"]) == whole[:whole.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"


class Bytes:
    """A byte-level codec: token t is byte t."""

    has_tokenizer = True

    @staticmethod
    def decode(ids):
        return bytes(ids).decode("utf-8", errors="replace")


def stopper(max_new_tokens=100, stop=None) -> StopChecker:
    return StopChecker(SamplingParams(max_new_tokens=max_new_tokens, stop=stop), (0,), Bytes())


def test_detokenize_splits_drafts_from_the_target_token():
    s = stopper()
    assert detokenize(s, list(b"abc"), 2) == (Piece("ab", True), Piece("c", False))
    assert detokenize(s, list(b"d"), 0) == (Piece("d", False),)
    # a character split across the drafts and the target's token goes out with the token that completes it
    assert detokenize(s, list("é".encode()), 1) == (Piece("é", False),)


def test_detokenize_feeds_nothing_past_the_end():
    s = stopper(stop=["c"])
    assert detokenize(s, list(b"abcd"), 3) == (Piece("ab", True),)
    assert s.finish_reason == "stop" and s.token_ids == list(b"abc")
    s = stopper(max_new_tokens=2)
    assert detokenize(s, list(b"abc"), 2) == (Piece("ab", True),) and s.token_ids == list(b"ab")
    s = stopper()
    assert detokenize(s, [ord("a"), 0, ord("b")], 2) == (Piece("a", True),) and s.finish_reason == "eos"
