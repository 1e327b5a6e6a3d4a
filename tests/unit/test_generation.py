"""End-to-end generation on tiny random models, checked against transformers and independent
computations (the byte tokenizer's ids are the UTF-8 bytes, so expected prompts are written by hand).
"""

from __future__ import annotations

import pytest
import torch

from tiny import PAD_IDS, EOS_ID, make_hf_dir
from verispec import LLM, ConfigError, SamplingParams, VerispecError
from verispec.stopping import StopChecker

START_ID = 257
ARCHS = ["llama", "llama3", "qwen2", "qwen3", "mistral", "smollm2"]
PROMPTS = ["Hello, world", "def f(x):\n    return"]


@pytest.fixture(scope="module")
def llms(tiny_dirs):
    return {arch: LLM(target=str(tiny_dirs[arch]), dtype="float32") for arch in ARCHS}


@pytest.fixture(scope="module")
def hf_models(tiny_dirs):
    import transformers

    transformers.logging.set_verbosity_error()
    return {arch: transformers.AutoModelForCausalLM.from_pretrained(str(tiny_dirs[arch]), dtype=torch.float32).eval()
            for arch in ARCHS}


@pytest.fixture(scope="module")
def hf_tok(tiny_dirs):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(tiny_dirs["qwen2"]))


def hf_greedy(model, ids: list[int], n: int, stop_at_eos: bool) -> list[int]:
    x = torch.tensor([ids])
    kw = {} if stop_at_eos else {"eos_token_id": None}
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                             pad_token_id=0, suppress_tokens=PAD_IDS, **kw)
    return out[0, len(ids):].tolist()


def utf8(s: str) -> list[int]:
    return list(s.encode())


# ---------------------------------------------------------------------------------------------
# Greedy decoding equals transformers
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(llms, hf_models, arch):
    for prompt in PROMPTS:
        ids = utf8(prompt)
        want = hf_greedy(hf_models[arch], ids, 24, stop_at_eos=False)
        out = llms[arch].generate(ids, SamplingParams(max_new_tokens=24, ignore_eos=True))
        assert out.token_ids == want, f"{arch} {prompt!r}"
        assert out.finish_reason == "length"


def _find_greedy_eos(llm, hf_model, n=32):
    """A prompt whose greedy continuation (per transformers) emits EOS before n tokens."""
    for i in range(200):
        ids = utf8(f"Prompt number {i}: ")
        want = hf_greedy(hf_model, ids, n, stop_at_eos=True)
        if want and want[-1] == EOS_ID and len(want) >= 2:
            return ids, want
    pytest.fail("no prompt found whose greedy continuation ends in EOS")


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_greedy_eos_mid_generation_matches_transformers(llms, hf_models, hf_tok, arch):
    ids, want = _find_greedy_eos(llms[arch], hf_models[arch])
    out = llms[arch].generate(ids, SamplingParams(max_new_tokens=32))
    assert out.token_ids == want  # EOS included, nothing after it
    assert out.finish_reason == "eos"
    assert out.text == hf_tok.decode(want[:-1])
    assert "<|end|>" not in out.text
    assert out.stats["new_tokens"] == len(want) == out.stats["target_forwards"]
    # ignore_eos: EOS is an ordinary token, generation goes on exactly as transformers without EOS
    out2 = llms[arch].generate(ids, SamplingParams(max_new_tokens=32, ignore_eos=True))
    assert out2.token_ids == hf_greedy(hf_models[arch], ids, 32, stop_at_eos=False)
    assert out2.token_ids[:len(want)] == want and len(out2.token_ids) == 32
    assert out2.finish_reason == "length"


def test_sampled_eos_ends_generation(llms, hf_tok):
    llm = llms["qwen2"]
    ids = utf8("Sample: ")
    for seed in range(100):
        out = llm.generate(ids, SamplingParams(max_new_tokens=48, temperature=1.0, seed=seed))
        if out.finish_reason == "eos":
            break
    else:
        pytest.fail("no seed sampled EOS")
    assert out.token_ids[-1] == EOS_ID and EOS_ID not in out.token_ids[:-1]
    assert out.text == hf_tok.decode(out.token_ids[:-1])
    # the same draws with ignore_eos: same prefix (EOS included), then more tokens
    cont = llm.generate(ids, SamplingParams(max_new_tokens=48, temperature=1.0, seed=seed, ignore_eos=True))
    assert cont.token_ids[:len(out.token_ids)] == out.token_ids
    assert len(cont.token_ids) == 48


# ---------------------------------------------------------------------------------------------
# Prompts
# ---------------------------------------------------------------------------------------------


def test_text_and_token_id_prompts_agree(llms):
    llm = llms["qwen3"]
    text = "Ünïcode & bytes: ok?"
    a = llm.generate(text, SamplingParams(max_new_tokens=16, ignore_eos=True))
    b = llm.generate(utf8(text), SamplingParams(max_new_tokens=16, ignore_eos=True))
    assert a.prompt_token_ids == utf8(text) == b.prompt_token_ids
    assert a.token_ids == b.token_ids and a.text == b.text
    # token ids may come as any sequence of ints
    c = llm.generate(tuple(torch.tensor(utf8(text)).tolist()), SamplingParams(max_new_tokens=16, ignore_eos=True))
    assert c.token_ids == a.token_ids


def test_chat_template(llms):
    llm = llms["qwen2"]
    out = llm.generate("Hi there", SamplingParams(max_new_tokens=8, ignore_eos=True), chat=True)
    want = [START_ID] + utf8("user\nHi there") + [EOS_ID] + utf8("\n") + [START_ID] + utf8("assistant\n")
    assert out.prompt_token_ids == want
    assert out.prompt_token_ids[0] == START_ID
    plain = llm.generate(want, SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert plain.token_ids == out.token_ids
    sys_out = llm.generate("Hi there", SamplingParams(max_new_tokens=4), chat=True, system="Be brief.")
    assert sys_out.prompt_token_ids == [START_ID] + utf8("system\nBe brief.") + [EOS_ID] + utf8("\n") + want
    with pytest.raises(VerispecError):
        llm.generate(utf8("Hi"), SamplingParams(max_new_tokens=4), chat=True)


def test_conversation(llms):
    llm = llms["qwen2"]
    turn = [START_ID] + utf8("user\nHi there") + [EOS_ID] + utf8("\n")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
                {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Again"}]
    out = llm.generate(messages, SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert out.prompt_token_ids == ([START_ID] + utf8("system\nBe brief.") + [EOS_ID] + utf8("\n") + turn +
                                    [START_ID] + utf8("assistant\nHello") + [EOS_ID] + utf8("\n") +
                                    [START_ID] + utf8("user\nAgain") + [EOS_ID] + utf8("\n") +
                                    [START_ID] + utf8("assistant\n"))
    one = llm.generate([{"role": "user", "content": "Hi there"}], SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert one.prompt_token_ids == llm.generate("Hi there", SamplingParams(max_new_tokens=4), chat=True).prompt_token_ids
    assert "".join(llm.stream(messages, SamplingParams(max_new_tokens=4, ignore_eos=True))) == out.text


@pytest.mark.parametrize("messages", [
    [{"role": "user"}], [{"role": "bot", "content": "Hi"}], [{"role": "user", "content": 3}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
    [{"role": "user", "content": "  "}], [{"role": "user", "content": "Hi"}, 5],
    [{"role": "user", "content": "Hi", "name": "x"}]])
def test_bad_conversations(llms, messages):
    with pytest.raises(VerispecError) as ei:
        llms["qwen2"].generate(messages, SamplingParams(max_new_tokens=4))
    assert "\n" not in str(ei.value)
    with pytest.raises(VerispecError, match="first message"):
        llms["qwen2"].generate([{"role": "user", "content": "Hi"}], SamplingParams(max_new_tokens=4), system="x")


@pytest.mark.parametrize("prompt", ["", "   \n\t", [], [1, 2, 264], [-1], [1, "x"], ["a"]])
def test_bad_prompts(llms, prompt):
    with pytest.raises(VerispecError) as ei:
        llms["qwen2"].generate(prompt, SamplingParams(max_new_tokens=4))
    assert "\n" not in str(ei.value)


def test_bad_method_and_params(llms):
    llm = llms["qwen2"]
    with pytest.raises(ConfigError, match="method"):
        llm.generate("Hi", SamplingParams(max_new_tokens=4), method="nope")
    with pytest.raises(ConfigError):
        llm.generate("Hi", {"max_new_tokens": 4})


def test_context_limit(llms):
    llm = llms["llama"]  # max_position_embeddings = 256
    ids = utf8("x" * 250)
    out = llm.generate(ids, SamplingParams(max_new_tokens=6, ignore_eos=True))  # exactly fills the context
    assert len(out.token_ids) == 6
    with pytest.raises(VerispecError, match="context"):
        llm.generate(ids, SamplingParams(max_new_tokens=7))
    with pytest.raises(VerispecError, match="context"):
        llm.generate("y" * 300, SamplingParams(max_new_tokens=1))


# ---------------------------------------------------------------------------------------------
# Seeds, lengths, stats
# ---------------------------------------------------------------------------------------------


def test_seed_reproducibility(llms):
    llm = llms["mistral"]
    p = lambda seed: SamplingParams(max_new_tokens=20, temperature=1.0, seed=seed, ignore_eos=True)  # noqa: E731
    a = llm.generate("Once upon", p(7)).token_ids
    torch.manual_seed(12345)  # the global RNG must not matter
    llm.generate("Something else", p(3))
    b = llm.generate("Once upon", p(7)).token_ids
    assert a == b
    outs = [tuple(llm.generate("Once upon", p(s)).token_ids) for s in range(6)]
    assert len(set(outs)) == 6
    # greedy ignores the seed
    g = [llm.generate("Once upon", SamplingParams(max_new_tokens=12, seed=s, ignore_eos=True)).token_ids
         for s in (None, 1, 2)]
    assert g[0] == g[1] == g[2]


@pytest.mark.parametrize("n", [1, 2, 7, 33])
def test_max_new_tokens_and_stats(llms, n):
    llm = llms["smollm2"]
    out = llm.generate("Count: ", SamplingParams(max_new_tokens=n, temperature=0.8, seed=1, ignore_eos=True))
    assert len(out.token_ids) == n
    assert out.finish_reason == "length"
    s = out.stats
    assert s["new_tokens"] == len(out.token_ids)
    assert s["target_forwards"] == s["new_tokens"]  # AR: one forward per token, the prefill's included
    assert s["prompt_tokens"] == len(utf8("Count: "))
    assert s["wall_s"] > 0 and s["tokens_per_s"] > 0
    assert s["tokens_per_s"] == pytest.approx(s["new_tokens"] / s["wall_s"], rel=1e-3)
    assert 0 <= s["prefill_s"] <= s["wall_s"]


# ---------------------------------------------------------------------------------------------
# Stop strings and streaming
# ---------------------------------------------------------------------------------------------


def _reference_run(llm, prompt, n=48):
    out = llm.generate(prompt, SamplingParams(max_new_tokens=n, ignore_eos=True))
    ids = out.token_ids
    end = ids.index(EOS_ID) if EOS_ID in ids else len(ids)
    return ids[:end]


def _expected_stop(tok, ids, stops):
    """Independent: the first n with a stop string in decode(ids[:n]); the text cut before the earliest one."""
    for n in range(1, len(ids) + 1):
        text = tok.decode(ids[:n])
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return ids[:n], text[:min(hits)]
    return None


def _ascii_pair(ids, start=3):
    for j in range(start, len(ids) - 1):
        if all(32 <= t < 127 for t in ids[j:j + 2]):
            return bytes(ids[j:j + 2]).decode()
    return None


@pytest.mark.parametrize("arch", ["qwen2", "llama3", "smollm2"])
def test_stop_strings(llms, hf_tok, arch):
    llm = llms[arch]
    found = 0
    for prompt in ["The answer is", "def main():", "Once upon a time", "1, 2, 3,", "<html>"]:
        ids = _reference_run(llm, prompt)
        s = _ascii_pair(ids)
        if s is None:
            continue
        found += 1
        exp_ids, exp_text = _expected_stop(hf_tok, ids, [s])
        out = llm.generate(prompt, SamplingParams(max_new_tokens=48, stop=[s]))
        assert out.finish_reason == "stop"
        assert out.token_ids == exp_ids  # ends at the token that completed the stop string
        assert out.text == exp_text and s not in out.text
        assert out.stats["new_tokens"] == len(exp_ids)
        # several stop strings: the earliest occurrence wins, whatever the order given
        single = ids[2:3]
        stops = [s, bytes(single).decode("utf-8", "replace")] if single[0] < 128 else [s]
        exp_ids2, exp_text2 = _expected_stop(hf_tok, ids, stops)
        out2 = llm.generate(prompt, SamplingParams(max_new_tokens=48, stop=stops[::-1]))
        assert (out2.token_ids, out2.text) == (exp_ids2, exp_text2)
        # streaming: pieces concatenate to the same text
        pieces = list(llm.stream(prompt, SamplingParams(max_new_tokens=48, stop=[s])))
        assert "".join(pieces) == out.text
        assert llm.last_output.token_ids == out.token_ids
    assert found >= 2


def test_stop_string_never_completed(llms):
    llm = llms["qwen2"]
    ids = _reference_run(llm, "abc")
    first = bytes(ids[:1]).decode("utf-8", "replace")
    stop = first + "\x00\x01\x02"  # its first character shows up, the rest never does
    params = SamplingParams(max_new_tokens=len(ids), stop=[stop, "abc"])  # "abc" only in the prompt
    out = llm.generate("abc", params)
    assert out.token_ids == ids and out.finish_reason == "length"  # stops at max_new_tokens, before any EOS
    pieces = list(llm.stream("abc", params))
    assert "".join(pieces) == out.text


@pytest.mark.parametrize("arch,kw", [
    ("qwen2", dict(max_new_tokens=40, ignore_eos=True)),
    ("qwen2", dict(max_new_tokens=40)),
    ("llama", dict(max_new_tokens=40, temperature=1.0, seed=3)),
    ("qwen3", dict(max_new_tokens=40, temperature=1.0, seed=5, ignore_eos=True)),
    ("mistral", dict(max_new_tokens=1)),
])
def test_stream_concatenates_to_generate(llms, arch, kw):
    llm = llms[arch]
    params = SamplingParams(**kw)
    for prompt in ["Stream me: ", "héllo wörld "]:
        out = llm.generate(prompt, params)
        pieces = list(llm.stream(prompt, params))
        assert all(isinstance(p, str) and p for p in pieces)
        assert "".join(pieces) == out.text
        assert llm.last_output.token_ids == out.token_ids
        assert llm.last_output.finish_reason == out.finish_reason


def test_stream_with_eos_and_stop(llms, hf_models):
    llm = llms["qwen2"]
    ids, want = _find_greedy_eos(llm, hf_models["qwen2"])
    text = llm.generate(ids, SamplingParams(max_new_tokens=32)).text
    pieces = list(llm.stream(ids, SamplingParams(max_new_tokens=32, stop=["\x00never"])))
    assert "".join(pieces) == text
    assert llm.last_output.finish_reason == "eos" and llm.last_output.token_ids == want


# ---------------------------------------------------------------------------------------------
# Token-ids-only models
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ids_only(tmp_path_factory):
    path = make_hf_dir(tmp_path_factory.mktemp("ids_only") / "m", "qwen2", seed=0, tokenizer=False)
    return path, LLM(target=str(path), dtype="float32")


def test_token_ids_only_model(ids_only, hf_models):
    path, llm = ids_only
    assert not llm.codec.has_tokenizer
    ids = utf8("Hello, world")
    out = llm.generate(ids, SamplingParams(max_new_tokens=16, ignore_eos=True))
    assert out.token_ids == hf_greedy(hf_models["qwen2"], ids, 16, stop_at_eos=False)  # same seed, same weights
    assert out.text == ""
    with pytest.raises(VerispecError, match="token ids"):
        llm.generate("Hello", SamplingParams(max_new_tokens=4))
    with pytest.raises(VerispecError, match="tokenizer"):
        llm.generate(ids, SamplingParams(max_new_tokens=4, stop=["x"]))
    with pytest.raises(VerispecError):
        list(llm.stream(ids, SamplingParams(max_new_tokens=4)))
    with pytest.raises(VerispecError):
        llm.generate(ids, SamplingParams(max_new_tokens=4), chat=True)


# ---------------------------------------------------------------------------------------------
# StopChecker with multi-character tokens (real tokenizers have tokens of 16+ characters)
# ---------------------------------------------------------------------------------------------


class _FakeCodec:
    """Token i decodes to VOCAB[i]; a stand-in for a BPE tokenizer with long tokens."""

    has_tokenizer = True
    VOCAB = ["a", "b", " " * 20 + "END", "END" + " " * 20, "x" * 30, "E", "N", "D", "<eos>", "\n" * 12 + "@@"]

    def decode(self, ids):
        return "".join(self.VOCAB[i] for i in ids)


@pytest.mark.parametrize("tokens,stop,n,text", [
    ([0, 1, 2, 0], "END", 3, "ab" + " " * 20),  # stop string at the end of a long token
    ([0, 3, 0], "END", 2, "a"),  # stop string at the start of a long token
    ([4, 3, 1], "END", 2, "x" * 30),  # ... after another long token
    ([0, 9, 1], "\n\n", 2, "a"),  # a short stop string at the start of a long token
    ([0, 5, 6, 7, 1], "END", 4, "a"),  # spanning three tokens
    ([1, 4, 4, 3], "xxx", 2, "b"),
])
def test_stop_checker_long_tokens(tokens, stop, n, text):
    sc = StopChecker(SamplingParams(max_new_tokens=50, stop=[stop]), (8,), _FakeCodec())
    consumed = 0
    for t in tokens:
        consumed += sc.append([t])
        if sc.finished:
            break
    assert sc.finish_reason == "stop"
    assert sc.token_ids == tokens[:n] and consumed == n
    assert sc.finalize() == text


def test_stop_checker_consumes_chunks_like_single_tokens():
    chunk = [0, 5, 6, 7, 1, 1]
    sc = StopChecker(SamplingParams(max_new_tokens=50, stop=["END"]), (8,), _FakeCodec())
    assert sc.append(chunk) == 4  # a speculative step stops exactly where AR would have
    assert sc.token_ids == chunk[:4] and sc.finish_reason == "stop"
    sc = StopChecker(SamplingParams(max_new_tokens=3), (8,), _FakeCodec())
    assert sc.append([0, 1, 0, 1]) == 3 and sc.finish_reason == "length"
    sc = StopChecker(SamplingParams(max_new_tokens=9), (8,), _FakeCodec())
    assert sc.append([0, 8, 1]) == 2 and sc.finish_reason == "eos" and sc.finalize() == "a"
    sc = StopChecker(SamplingParams(max_new_tokens=9, ignore_eos=True), (8,), _FakeCodec())
    assert sc.append([0, 8, 1]) == 3 and sc.finish_reason is None
