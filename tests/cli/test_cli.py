"""`verispec` command line: a working generate, and one clean error line (exit 2) for every bad input.

Most cases run in-process through ``verispec.cli.main`` (capsys); a few run the installed console
script in a subprocess to prove the end-to-end contract: exit status 2, one stderr line, no traceback.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tiny import PAD_IDS, make_hf_dir
from verispec import LLM, SamplingParams
from verispec.cli import main
from verispec.models.registry import REGISTRY

VERISPEC = Path(sys.executable).parent / "verispec"


@pytest.fixture(scope="module")
def tiny(tiny_dirs):
    return str(tiny_dirs["qwen2"])


@pytest.fixture(scope="module")
def bad_models(tiny_dirs, tmp_path_factory):
    """Broken model files, each derived from a working tiny directory."""
    root = tmp_path_factory.mktemp("bad")
    src = tiny_dirs["qwen2"]

    corrupt = root / "truncated_safetensors"
    shutil.copytree(src, corrupt)
    data = (corrupt / "model.safetensors").read_bytes()
    (corrupt / "model.safetensors").write_bytes(data[: len(data) // 2])

    garbage_st = root / "garbage_safetensors"
    shutil.copytree(src, garbage_st)
    (garbage_st / "model.safetensors").write_bytes(np.random.default_rng(0).bytes(4096))

    gpt2 = root / "gpt2_arch"
    shutil.copytree(src, gpt2)
    cfg = json.loads((gpt2 / "config.json").read_text())
    cfg["model_type"], cfg["architectures"] = "gpt2", ["GPT2LMHeadModel"]
    (gpt2 / "config.json").write_text(json.dumps(cfg))

    bad_json = root / "bad_config"
    shutil.copytree(src, bad_json)
    (bad_json / "config.json").write_text('{"model_type": "qwen2", ')

    no_weights = root / "no_weights"
    shutil.copytree(src, no_weights)
    (no_weights / "model.safetensors").unlink()

    empty_dir = root / "empty_dir"
    empty_dir.mkdir()

    # GGUF: a small valid file cut in half, one with only the magic, and random bytes
    import gguf

    full = root / "full.gguf"
    w = gguf.GGUFWriter(str(full), "qwen2")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_tensor("token_embd.weight", np.random.default_rng(1).random((16, 8), dtype=np.float32))
    w.add_tensor("output_norm.weight", np.ones(8, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    half = root / "half.gguf"
    half.write_bytes(full.read_bytes()[: full.stat().st_size // 2])
    magic_only = root / "magic_only.gguf"
    magic_only.write_bytes(b"GGUF\x03\x00")
    garbage_gguf = root / "garbage.gguf"
    garbage_gguf.write_bytes(np.random.default_rng(2).bytes(1000))
    empty_gguf = root / "empty.gguf"
    empty_gguf.write_bytes(b"")

    not_a_model = root / "weights.bin"
    not_a_model.write_bytes(b"\x00" * 16)

    tok_less = make_hf_dir(root / "ids_only", "qwen2", seed=0, tokenizer=False)
    return {k: str(v) for k, v in dict(
        corrupt=corrupt, garbage_st=garbage_st, gpt2=gpt2, bad_json=bad_json, no_weights=no_weights,
        empty_dir=empty_dir, half_gguf=half, magic_only=magic_only, garbage_gguf=garbage_gguf,
        empty_gguf=empty_gguf, not_a_model=not_a_model, tok_less=tok_less).items()}


def run_main(capsys, argv, stdin: str | None = None, monkeypatch=None):
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    rc = main(argv)
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def assert_one_error_line(rc, out, err):
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2, (rc, err)
    assert len(lines) == 1, err
    assert lines[0].startswith("verispec: error:"), err
    assert "Traceback" not in err and "Traceback" not in out
    assert len(lines[0]) > len("verispec: error: ") + 3  # says something


def gen(target, *extra, prompt="Hello"):
    return ["generate", prompt, "--target", target, "--dtype", "float32", *extra]


# ---------------------------------------------------------------------------------------------
# Working commands
# ---------------------------------------------------------------------------------------------


def hf_greedy(path, ids, n):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False, pad_token_id=0,
                             suppress_tokens=PAD_IDS)
    return out[0, len(ids):].tolist()


def test_generate_json(capsys, tiny):
    rc, out, err = run_main(capsys, gen(tiny, "--max-new-tokens", "12", "--json", prompt="Hello, CLI"))
    assert rc == 0, err
    assert "error" not in err
    obj = json.loads(out.strip().splitlines()[-1])
    assert set(obj) >= {"text", "token_ids", "stats"}
    want = hf_greedy(tiny, list(b"Hello, CLI"), 12)
    assert obj["token_ids"] == want
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(tiny)
    assert obj["text"] == tok.decode(want[:-1] if want[-1] == 256 else want)
    assert obj["stats"]["new_tokens"] == len(want)
    assert obj["stats"]["target_forwards"] == len(want)


def test_generate_logprobs(capsys, tiny):
    """--logprobs N: in --json one entry a token (its log-probability, its row's N likeliest), the same numbers as
    the Python API; without --json one line a token on stderr; out of range, one line and exit 2."""
    rc, out, err = run_main(capsys, gen(tiny, "--max-new-tokens", "8", "--json", "--logprobs", "3", "--method",
                                        "ngram", prompt="Hello, hello"))
    assert rc == 0, err
    obj = json.loads(out.strip().splitlines()[-1])
    want = LLM(target=tiny, dtype="float32").generate("Hello, hello", SamplingParams(max_new_tokens=8, logprobs=3))
    assert [e["token"] for e in obj["logprobs"]] == obj["token_ids"] == want.token_ids
    assert [e["logprob"] for e in obj["logprobs"]] == [lp.logprob for lp in want.logprobs]
    assert all(len(e["top_logprobs"]) == 3 and e["top_logprobs"][0]["token"] == e["token"] for e in obj["logprobs"])
    rc, out, err = run_main(capsys, gen(tiny, "--max-new-tokens", "4", "--logprobs", "0", prompt="Hello"))
    assert rc == 0 and len([line for line in err.splitlines() if "\t" in line]) == 4, err
    rc, out, err = run_main(capsys, gen(tiny, "--logprobs", "21", prompt="Hello"))
    assert rc == 2 and "logprobs must be an integer in 0..20" in err


def test_generate_with_logit_processors(capsys, tiny):
    """--logit-bias / penalties / --min-p reach the sampler as the Python API's; a bad pair is one line, exit 2."""
    rc, out, err = run_main(capsys, gen(tiny, "--max-new-tokens", "8", "--json", "--logit-bias", "104=-100",
                                        "--presence-penalty", "1.5", "--repetition-penalty", "1.2", prompt="Hello"))
    assert rc == 0, err
    want = LLM(target=tiny, dtype="float32").generate("Hello", SamplingParams(
        max_new_tokens=8, logit_bias={104: -100}, presence_penalty=1.5, repetition_penalty=1.2))
    assert json.loads(out.strip().splitlines()[-1])["token_ids"] == want.token_ids and 104 not in want.token_ids
    for bad, msg in (("--logit-bias=x=1", "ID=VALUE"), ("--logit-bias=1=500", "logit_bias"),
                     ("--min-p=2", "min_p"), ("--frequency-penalty=3", "frequency_penalty")):
        rc, out, err = run_main(capsys, gen(tiny, bad, prompt="Hello"))
        assert rc == 2 and msg in err and len(err.strip().splitlines()) == 1, err


def test_the_default_method_is_auto(capsys, tiny):
    """Users get auto unless they ask otherwise; greedy, that is the AR output token for token."""
    want = LLM(target=tiny, dtype="float32").generate("Hello, hello, hello", SamplingParams(max_new_tokens=24))
    rc, out, err = run_main(capsys, gen(tiny, "--max-new-tokens", "24", prompt="Hello, hello, hello"))
    assert rc == 0, err
    assert out == want.text + "\n"
    assert err.strip().splitlines()[-1].startswith(f"[auto: {len(want.token_ids)} tokens"), err


def test_generate_stream_and_no_stream(capsys, tiny):
    llm = LLM(target=tiny, dtype="float32")
    want = llm.generate("Stream", SamplingParams(max_new_tokens=10, temperature=0.9, seed=4, stop=["q"]))
    for extra in ([], ["--no-stream"]):
        rc, out, err = run_main(capsys, gen(tiny, "--max-new-tokens", "10", "--temperature", "0.9", "--seed", "4",
                                            "--stop", "q", "--method", "ar", *extra, prompt="Stream"))
        assert rc == 0, err
        assert out == want.text + "\n"
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"[ar: {len(want.token_ids)} tokens")
        assert f"stop: {want.finish_reason}" in lines[0]


def test_generate_sampling_flags_reach_the_sampler(capsys, tiny):
    llm = LLM(target=tiny, dtype="float32")
    params = SamplingParams(max_new_tokens=16, temperature=0.8, top_k=20, top_p=0.9, seed=11)
    want = llm.generate("Flags", params, chat=True, system="sys")
    rc, out, err = run_main(capsys, gen(tiny, "--max-new-tokens", "16", "--temperature", "0.8", "--top-k", "20",
                                        "--top-p", "0.9", "--seed", "11", "--chat", "--system", "sys", "--json",
                                        "--method", "ar", prompt="Flags"))
    assert rc == 0, err
    obj = json.loads(out.strip().splitlines()[-1])
    assert obj["token_ids"] == want.token_ids and obj["text"] == want.text


def test_generate_prompt_from_stdin(capsys, monkeypatch, tiny):
    rc, out, err = run_main(capsys, gen(tiny, "--max-new-tokens", "5", "--json", prompt="-"), stdin="Hello, CLI",
                            monkeypatch=monkeypatch)
    assert rc == 0, err
    assert json.loads(out.strip().splitlines()[-1])["token_ids"] == hf_greedy(tiny, list(b"Hello, CLI"), 5)


def test_generate_a_conversation(capsys, tiny, tmp_path, monkeypatch):
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "Again"}]
    path = tmp_path / "chat.json"
    path.write_text(json.dumps(chat))
    argv = ["generate", "--messages", str(path), "--target", tiny, "--dtype", "float32", "--max-new-tokens", "6", "--json"]
    rc, out, err = run_main(capsys, argv)
    assert rc == 0, err
    want = LLM(target=tiny, dtype="float32").generate(chat, SamplingParams(max_new_tokens=6)).token_ids
    assert json.loads(out.strip().splitlines()[-1])["token_ids"] == want
    argv[2] = "-"
    rc, out, err = run_main(capsys, argv, stdin=json.dumps(chat), monkeypatch=monkeypatch)
    assert rc == 0 and json.loads(out.strip().splitlines()[-1])["token_ids"] == want


@pytest.mark.parametrize("name,content", [
    ("missing", None), ("not json", "{role: user"), ("not a list", '{"role": "user", "content": "Hi"}'),
    ("empty list", "[]"), ("token ids", "[1, 2]"), ("bad role", '[{"role": "bot", "content": "Hi"}]'),
    ("ends with the assistant", '[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]'),
    ("not utf-8", b"\xff\xfe[")])
def test_bad_messages(capsys, tiny, tmp_path, name, content):
    path = tmp_path / "chat.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    argv = ["generate", "--messages", str(path), "--target", tiny, "--dtype", "float32"]
    assert_one_error_line(*run_main(capsys, argv))


def test_prompt_and_messages_together_or_neither(capsys, tiny, tmp_path):
    path = tmp_path / "chat.json"
    path.write_text('[{"role": "user", "content": "Hi"}]')
    assert_one_error_line(*run_main(capsys, gen(tiny, "--messages", str(path))))
    assert_one_error_line(*run_main(capsys, ["generate", "--target", tiny, "--dtype", "float32"]))


def test_models_list(capsys):
    rc, out, err = run_main(capsys, ["models", "list"])
    assert rc == 0, err
    assert "qwen2.5-coder-1.5b-instruct" in out and "qwen2.5-coder-0.5b-instruct" in out
    assert set(REGISTRY) == {"qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"}
    assert err.strip() == ""


# ---------------------------------------------------------------------------------------------
# Bad input: exit 2, one line "verispec: error: ...", no traceback
# ---------------------------------------------------------------------------------------------

BAD_FLAGS = {
    "temperature -1": ["--temperature", "-1"],
    "temperature nan": ["--temperature", "nan"],
    "temperature non-numeric": ["--temperature", "hot"],
    "top_p 0": ["--top-p", "0"],
    "top_p 1.5": ["--top-p", "1.5"],
    "top_p non-numeric": ["--top-p", "x"],
    "top_k -1": ["--top-k", "-1"],
    "top_k float": ["--top-k", "2.5"],
    "max-new-tokens 0": ["--max-new-tokens", "0"],
    "max-new-tokens -3": ["--max-new-tokens", "-3"],
    "max-new-tokens non-numeric": ["--max-new-tokens", "many"],
    "seed non-numeric": ["--seed", "abc"],
    "empty stop string": ["--stop", ""],
    "unknown method": ["--method", "bogus"],
    "unknown weights": ["--weights", "bogus"],
    "dtype float64": ["--dtype", "float64"],
    "device tpu": ["--device", "tpu"],
    "threads 0": ["--threads", "0"],
    "unknown flag": ["--frobnicate"],
    "missing flag value": ["--temperature"],
}


@pytest.mark.parametrize("name", list(BAD_FLAGS))
def test_bad_flags(capsys, tiny, name):
    assert_one_error_line(*run_main(capsys, gen(tiny, *BAD_FLAGS[name])))


@pytest.mark.parametrize("name,prompt", [("empty", ""), ("blank", "  \n\t "), ("too long", "x" * 300)])
def test_bad_prompts(capsys, tiny, name, prompt):
    rc, out, err = run_main(capsys, gen(tiny, "--max-new-tokens", "4", prompt=prompt))
    assert_one_error_line(rc, out, err)
    if name == "too long":
        assert "context" in err


def test_prompt_plus_new_tokens_over_context(capsys, tiny):
    rc, out, err = run_main(capsys, gen(tiny, "--max-new-tokens", "200", prompt="y" * 100))
    assert_one_error_line(rc, out, err)
    assert "context" in err


def test_empty_stdin_prompt(capsys, monkeypatch, tiny):
    assert_one_error_line(*run_main(capsys, gen(tiny, prompt="-"), stdin="", monkeypatch=monkeypatch))


@pytest.mark.parametrize("kind", [
    "unknown name", "missing dir", "missing gguf", "corrupt", "garbage_st", "gpt2", "bad_json", "no_weights",
    "empty_dir", "half_gguf", "magic_only", "garbage_gguf", "empty_gguf", "not_a_model",
])
def test_bad_models(capsys, bad_models, tmp_path, kind):
    target = {
        "unknown name": "no-such-model-7b",
        "missing dir": str(tmp_path / "does" / "not" / "exist"),
        "missing gguf": str(tmp_path / "missing.gguf"),
    }.get(kind) or bad_models[kind]
    rc, out, err = run_main(capsys, gen(target))
    assert_one_error_line(rc, out, err)
    if kind == "gpt2":
        assert "unsupported architecture" in err and "gpt2" in err
    if kind in ("corrupt", "garbage_st"):
        assert "safetensors" in err
    if kind in ("half_gguf", "magic_only", "garbage_gguf", "empty_gguf"):
        assert "GGUF" in err or "gguf" in err
    if kind == "unknown name":
        assert "no-such-model-7b" in err


def test_token_ids_only_model_rejects_text(capsys, bad_models):
    rc, out, err = run_main(capsys, gen(bad_models["tok_less"]))
    assert_one_error_line(rc, out, err)
    assert "token ids" in err


def test_chat_without_template(capsys, bad_models, tmp_path):
    path = tmp_path / "no_template"
    shutil.copytree(bad_models["tok_less"], path)
    from tiny import byte_tokenizer

    tok = byte_tokenizer()
    tok.chat_template = None
    tok.save_pretrained(str(path))
    (path / "chat_template.jinja").unlink(missing_ok=True)
    rc, out, err = run_main(capsys, gen(str(path), "--chat", "--max-new-tokens", "2"))
    assert_one_error_line(rc, out, err)
    assert "chat template" in err
    messages = tmp_path / "chat.json"
    messages.write_text(json.dumps([{"role": "user", "content": "hi"}]))
    rc, out, err = run_main(capsys, ["generate", "--messages", str(messages), "--target", str(path), "--dtype", "float32", "--max-new-tokens", "2"])
    assert_one_error_line(rc, out, err)
    assert "no chat template" in err and "--chat:" not in err  # a conversation, not --chat, needed it


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_requested_without_gpu(capsys, tiny):
    assert_one_error_line(*run_main(capsys, gen(tiny, "--device", "cuda")))


@pytest.mark.parametrize("argv", [
    ["frobnicate"],
    ["generate"],
    ["models", "pull", "no-such-model"],
    ["models", "frobnicate"],
])
def test_bad_commands(capsys, argv):
    assert_one_error_line(*run_main(capsys, argv))


# ---------------------------------------------------------------------------------------------
# The installed console script, end to end
# ---------------------------------------------------------------------------------------------


def run_script(*args, stdin=""):
    env = {k: v for k, v in os.environ.items() if k != "VERISPEC_DEBUG"}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return subprocess.run([str(VERISPEC), *args], input=stdin, capture_output=True, text=True, timeout=120,
                          env=env)


def test_script_generate_json(tiny):
    p = run_script(*gen(tiny, "--max-new-tokens", "8", "--json", "--threads", "1", prompt="Hello, CLI"))
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr
    obj = json.loads(p.stdout.strip().splitlines()[-1])
    assert obj["token_ids"] == hf_greedy(tiny, list(b"Hello, CLI"), 8)


@pytest.mark.parametrize("case", ["corrupt safetensors", "non-numeric temperature"])
def test_script_bad_input(bad_models, tiny, case):
    argv = {"corrupt safetensors": gen(bad_models["corrupt"], "--threads", "1"),
            "non-numeric temperature": gen(tiny, "--temperature", "warm")}[case]
    p = run_script(*argv)
    assert_one_error_line(p.returncode, p.stdout, p.stderr)


def test_stop_flag_understands_escapes(capsys, tiny, monkeypatch):
    """`--stop "\\n"` typed in a shell arrives as backslash-n; the CLI passes a newline."""
    from verispec.cli import unescape

    assert unescape(r"a\nb\tc\\n\q") == "a\nb\tc\\n\\q"
    seen = []
    real = LLM.generate

    def spy(self, prompt, params=None, **kw):
        seen.append(params.stop)
        return real(self, prompt, params, **kw)

    monkeypatch.setattr(LLM, "generate", spy)
    rc, _, _ = run_main(capsys, gen(tiny, "--json", "--stop", r"\n", "--stop", "end"))
    assert rc == 0 and seen == [("\n", "end")]
