"""StopChecker's incremental detokenisation: the same tokens consumed, finish reasons, stream pieces and final text
as decoding the whole output on every call (checked against that, on random outputs of three kinds of tokenizer),
for O(new tokens) decoding per step."""

from __future__ import annotations

import random

import pytest

from tiny import byte_tokenizer
from verispec import SamplingParams
from verispec.stopping import StopChecker
from verispec.tokenizer import Codec

EOS = 0


class Bytes:
    """Token t is byte t (t > 0): characters split across tokens, bytes that are not UTF-8."""

    has_tokenizer = True

    def __init__(self):
        self.decoded = 0  # tokens passed to decode, all calls

    def decode(self, ids):
        self.decoded += len(ids)
        return bytes(ids).decode("utf-8", errors="replace")


class Pieces(Bytes):
    """SentencePiece-like: token t is "▁" + a word or a word; the text's one leading space is dropped."""

    WORDS = ["a", "b", "ab", "END", "\n", "x" * 12, "é", "E", "N", "D"]

    def decode(self, ids):
        self.decoded += len(ids)
        text = "".join(("▁" if t % 2 else "") + self.WORDS[(t // 2) % len(self.WORDS)] for t in ids)
        return text.replace("▁", " ").removeprefix(" ")


def reference(params: SamplingParams, codec, chunks: list[list[int]]):
    """What the checker must give: the whole output decoded again on every call."""
    ids, finish, consumed, streamed, pieces = [], None, [], "", []

    def text():
        t = codec.decode(ids)
        hits = [i for i in (t.find(s) for s in params.stop) if i >= 0]
        return t[:min(hits)] if hits else t, bool(hits)

    for chunk in chunks:
        if finish:
            break
        n = 0
        for tok in chunk:
            n += 1
            if tok == EOS and not params.ignore_eos:
                finish = "eos"
                break
            ids.append(tok)
            if text()[1]:
                finish = "stop"
                break
            if n + sum(consumed) >= params.max_new_tokens:
                finish = "length"
                break
        consumed.append(n)
        t = text()[0]
        if not finish:
            t = t.rstrip("\ufffd")
            held = max((k for s in params.stop for k in range(1, len(s)) if t.endswith(s[:k])), default=0)
            t = t[:len(t) - held]
        if len(t) > len(streamed) and t.startswith(streamed):
            pieces.append(t[len(streamed):])
            streamed = t
    return consumed, finish, pieces, text()[0]


def run(params: SamplingParams, codec, chunks: list[list[int]]):
    sc = StopChecker(params, (EOS,), codec)
    consumed, pieces = [], []
    for chunk in chunks:
        if sc.finished:
            break
        consumed.append(sc.append(chunk))
        if piece := sc.stream_piece():
            pieces.append(piece)
    return consumed, sc.finish_reason, pieces, sc.finalize()


def random_case(rng: random.Random, kind: str):
    if kind == "pieces":
        vocab = range(1, 40)
    else:  # mostly ASCII, some bytes of 2-, 3- and 4-byte characters, some stray continuation bytes
        vocab = [*range(97, 101), 32, 10, *"é€😀".encode(), 0x80, 0xBF, 0xE4]
    tokens = [rng.choice(vocab) for _ in range(rng.randint(1, 120))]
    if rng.random() < 0.2:
        tokens.insert(rng.randrange(len(tokens)), EOS)
    codec = Pieces() if kind == "pieces" else Bytes() if kind == "bytes" else Codec(byte_tokenizer(), 264)
    text = codec.decode([t for t in tokens if t != EOS])
    stop = []
    for _ in range(rng.randint(0, 3)):  # stop strings taken from the text (they hit) or not
        i = rng.randrange(len(text) + 1)
        s = text[i:i + rng.randint(1, 6)] if rng.random() < 0.7 else rng.choice(["zz", "\n\n", "END", "é€"])
        if s:
            stop.append(s)
    params = SamplingParams(max_new_tokens=rng.randint(1, 130), stop=stop, ignore_eos=rng.random() < 0.1)
    chunks, i = [], 0
    while i < len(tokens):  # one token a step, or a speculative step's several
        n = rng.choice([1, 1, 2, 3, 5, 9])
        chunks.append(tokens[i:i + n])
        i += n
    return params, codec, chunks


@pytest.mark.parametrize("kind", ["bytes", "pieces", "hf"])
def test_same_as_decoding_everything_every_call(kind):
    rng = random.Random(kind)
    for case in range(300 if kind != "hf" else 60):
        params, codec, chunks = random_case(rng, kind)
        assert run(params, codec, chunks) == reference(params, codec, chunks), (case, params, chunks)


@pytest.mark.parametrize("stop", [["never"], []])
def test_a_long_output_decodes_each_token_a_bounded_number_of_times(stop):
    """2,000 tokens, one a step, a stream piece after each: decoding everything every call would pass ~2M token
    ids to the tokenizer; incremental decoding passes a few per token."""
    codec = Bytes()
    rng = random.Random(0)
    tokens = [rng.choice([*range(97, 123), 32, *"é€".encode()]) for _ in range(2000)]
    sc = StopChecker(SamplingParams(max_new_tokens=5000, stop=stop), (EOS,), codec)
    text = ""
    for tok in tokens:
        sc.append([tok])
        text += sc.stream_piece()
    assert sc.finalize() == bytes(tokens).decode("utf-8", errors="replace").rstrip("\ufffd")
    assert text == sc.finalize().rstrip("\ufffd")
    assert codec.decoded < 10 * len(tokens), codec.decoded


def test_a_run_of_bytes_that_are_not_utf8_keeps_the_window_short():
    codec = Bytes()
    sc = StopChecker(SamplingParams(max_new_tokens=5000, stop=["zz"]), (EOS,), codec)
    tokens = [0xE4, 0xBD] * 1000  # each pair an unfinished character: the text always ends in U+FFFD
    for tok in tokens:
        sc.append([tok])
        sc.stream_piece()
    assert sc.finalize() == bytes(tokens).decode("utf-8", errors="replace")
    assert codec.decoded < 200 * len(tokens), codec.decoded  # bounded per token (~2M per token pair otherwise)
