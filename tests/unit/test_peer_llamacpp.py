"""The llama.cpp peer of `verispec bench` against a fake llama_cpp module (CI does not compile llama.cpp):
what it asks llama.cpp for, that every run pays its own prefill, its errors, and its rows in the report."""

import sys
import types

import pytest

from verispec.bench import peer_llamacpp
from verispec.bench.report import summarize
from verispec.config import SamplingParams
from verispec.errors import VerispecError


class FakeLlama:
    """llama-cpp-python's Llama as far as the peer uses it, with its context and logits buffer: with a draft model it
    keeps every position's logits in ``scores``, sized n_ctx rows with logits_all=True and n_batch (512) without."""

    made = []

    def __init__(self, path, draft_model=None, n_ctx=512, logits_all=False, **kw):
        self.path, self.draft_model, self.kw = path, draft_model, {"n_ctx": n_ctx, "logits_all": logits_all, **kw}
        self.params = sys.modules["llama_cpp.llama_cpp"].llama_model_default_params()  # as Llama() takes them
        self.calls, self.resets, self.seed, self.n_tokens = [], 0, None, 0
        self.n_ctx, self.score_rows = n_ctx, n_ctx if logits_all else min(512, n_ctx)
        FakeLlama.made.append(self)

    def reset(self):
        self.resets += 1
        self.n_tokens = 0

    def set_seed(self, seed):
        self.seed = seed

    def eval(self, n: int):
        if self.n_tokens + n > self.n_ctx:
            raise RuntimeError("llama_decode returned 1")  # no KV slot left
        if self.draft_model is not None and self.n_tokens + n > self.score_rows:  # Llama.eval saving logits
            raise ValueError(f"could not broadcast input array from shape ({n * 151936},) into shape (0,)")
        self.n_tokens += n

    def generate(self, tokens, **kw):
        assert self.n_tokens == 0, "a prompt cache from an earlier run would skip the prefill"
        self.calls.append((list(tokens), kw))
        self.eval(len(tokens))
        i = 0
        while True:  # never stops by itself, like llama-cpp-python's generate
            yield 100 + i
            i += 1
            self.eval(1)


class FakeLookup:
    pass


@pytest.fixture
def fake_llama_cpp(monkeypatch):
    FakeLlama.made = []
    mod = types.ModuleType("llama_cpp")
    mod.Llama = FakeLlama
    spec = types.ModuleType("llama_cpp.llama_speculative")
    spec.LlamaPromptLookupDecoding = FakeLookup
    lib = types.ModuleType("llama_cpp.llama_cpp")
    lib.llama_model_default_params = lambda: types.SimpleNamespace(use_extra_bufts=True)
    mod.llama_cpp = lib
    monkeypatch.setitem(sys.modules, "llama_cpp", mod)
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_cpp", lib)
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_speculative", spec)
    return mod


@pytest.fixture
def gguf(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF")
    return str(path)


def test_generates_exactly_n_tokens_with_a_fresh_prefill_each_run(fake_llama_cpp, gguf):
    peer = peer_llamacpp.LlamaCppPeer(gguf, threads=2)
    plain, lookup = (m for m in FakeLlama.made)
    assert plain.draft_model is None and isinstance(lookup.draft_model, FakeLookup)
    assert plain.kw["n_threads"] == 2 and plain.kw["n_threads_batch"] == 2 and plain.path == gguf
    for mode, model in (("llamacpp", plain), ("llamacpp-lookup", lookup)):
        for _ in range(2):  # the same prompt twice: both runs start from an empty cache
            tokens, wall = peer.generate([1, 2, 3], 5, mode)
            assert tokens == [100, 101, 102, 103, 104] and wall >= 0
        assert model.resets == 2 and len(model.calls) == 2
    ids, kw = plain.calls[0]
    assert ids == [1, 2, 3]
    # greedy, and none of llama.cpp's default samplers (min_p 0.05, top_k 40, temp 0.8) in the way
    assert kw["temp"] == 0.0 and kw["min_p"] == 0.0 and kw["repeat_penalty"] == 1.0 and kw["typical_p"] == 1.0


def test_a_long_prompt_fits_the_context_bench_opens(fake_llama_cpp, gguf):
    """Spec-Bench's long summarization prompts: past 512 tokens the lookup mode failed with "could not broadcast ...
    into shape (0,)" (its logits kept in a 512-row buffer); the context holds the prompt and every new token."""
    prompt, n = [1] * 3000, 128
    peer = peer_llamacpp.LlamaCppPeer(gguf, threads=1, context=peer_llamacpp.context_for(len(prompt), n))
    assert peer.context >= len(prompt) + n + peer_llamacpp.LOOKUP_DRAFT_TOKENS
    for mode in peer.modes:
        tokens, _ = peer.generate(prompt, n, mode)
        assert len(tokens) == n
    assert FakeLlama.made[1].kw["logits_all"] is True
    assert peer_llamacpp.context_for(10, 64) == 512


def test_a_run_past_its_timeout_is_a_timeout_error(fake_llama_cpp, gguf):
    peer = peer_llamacpp.LlamaCppPeer(gguf, threads=1, timeout=1e-9)
    with pytest.raises(TimeoutError, match=r"llamacpp-lookup: 1 of 5 tokens in 1e-09 s"):
        peer.generate([1, 2], 5, "llamacpp-lookup")


@pytest.mark.parametrize("amx", [False, True])
def test_amx_cpus_load_without_llama_cpps_weight_repacking(fake_llama_cpp, gguf, monkeypatch, capsys, amx):
    """Its AMX repacking segfaults on some AMX CPUs (ggml-org/llama.cpp#20824): off there, on elsewhere."""
    monkeypatch.setattr(peer_llamacpp, "amx_cpu", lambda: amx)
    peer_llamacpp.LlamaCppPeer(gguf, threads=1)
    assert [m.params.use_extra_bufts for m in FakeLlama.made] == [not amx, not amx]
    assert ("ggml-org/llama.cpp#20824" in capsys.readouterr().err) == amx
    assert sys.modules["llama_cpp.llama_cpp"].llama_model_default_params().use_extra_bufts  # put back


def test_sampling_parameters_and_seed_reach_llama_cpp(fake_llama_cpp, gguf):
    peer = peer_llamacpp.LlamaCppPeer(gguf, threads=1)
    peer.generate([1], 2, "llamacpp", SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=5))
    plain = FakeLlama.made[0]
    _, kw = plain.calls[0]
    assert (kw["temp"], kw["top_k"], kw["top_p"], kw["min_p"]) == (0.7, 20, 0.9, 0.0)
    assert plain.seed == 5


def test_errors(fake_llama_cpp, gguf, tmp_path, monkeypatch):
    with pytest.raises(VerispecError, match="needs a GGUF target"):
        peer_llamacpp.LlamaCppPeer(str(tmp_path), threads=1)  # an HF directory
    with pytest.raises(VerispecError, match="needs a GGUF target"):
        peer_llamacpp.LlamaCppPeer(str(tmp_path / "missing.gguf"), threads=1)
    peer = peer_llamacpp.LlamaCppPeer(gguf, threads=1, context=8)
    with pytest.raises(VerispecError, match="exceed its 8-token context"):
        peer.generate([1] * 6, 3)

    def broken(*a, **kw):
        raise ValueError("Failed to load model from file: model.gguf\nmore")
    monkeypatch.setattr(fake_llama_cpp, "Llama", broken)
    with pytest.raises(VerispecError, match="llama.cpp cannot load .*Failed to load model from file"):
        peer_llamacpp.LlamaCppPeer(gguf, threads=1)
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # not installed
    with pytest.raises(VerispecError, match="pip install llama-cpp-python"):
        peer_llamacpp.LlamaCppPeer(gguf, threads=1)


def run(label, method, pid, tps, cat="coding"):
    return {"label": label, "method": method, "category": cat, "prompt_id": pid, "tokens_per_s": tps,
            "wall_s": 64 / tps, "new_tokens": 64, "decode_ms_per_token": 1e3 / tps, "mean_accepted_length": 1.0,
            "prefill_s": 0.0, "prompt_tokens": 20,
            "acceptance_rate": None, "per_position_acceptance": [1.0], "per_position_reached": [10], "speedup": None,
            "identical_to_ar": True, "drafted_tokens": 10, "accepted_tokens": 10, "draft_s": 0.0}


def test_report_rows_against_the_peers_own_plain_run():
    runs, peer_runs = [], []
    for pid in ("a", "b"):
        runs += [run("ar", "ar", pid, 40.0), {**run("draft:K=3", "draft", pid, 60.0), "speedup": 1.5},
                 {**run("ngram:K=4", "ngram", pid, 44.0), "speedup": 1.1}]
        peer_runs += [{"peer": "llamacpp", "category": "coding", "prompt_id": pid, "wall_s": 2.0, "tokens_per_s": 32.0,
                       "new_tokens": 64, "identical_to_ar": False},
                      {"peer": "llamacpp-lookup", "category": "coding", "prompt_id": pid, "wall_s": 4.0,
                       "tokens_per_s": 16.0, "new_tokens": 64, "identical_to_ar": True}]
    _, peers = summarize(runs, peer_runs, 10**9, [50.0], {1: 10.0, 2: 11.0}, greedy=True)
    plain, lookup = peers["llamacpp"], peers["llamacpp-lookup"]
    assert plain["speedup"] == 1.0 and lookup["speedup"] == 0.5  # against llama.cpp's own plain run
    assert plain["counterpart"] == "ar" and plain["ours_vs_theirs"] == 40.0 / 32.0
    assert lookup["counterpart"] == "ngram:K=4" and lookup["ours_vs_theirs"] == 44.0 / 16.0
    assert plain["best"] == "draft:K=3" and plain["best_vs_theirs"] == 60.0 / 32.0
    assert plain["identical_to_ar"] == 0 and lookup["identical_to_ar"] == 2
    assert plain["by_category"]["coding"]["best_vs_theirs"] == 60.0 / 32.0
