"""The speculative API around the loop: stats, parameter and vocabulary errors, padding rows, the
draft model's own cache, and the command line. Exactness is always judged against the target's
autoregressive output (or, for the draft's cache, a fresh forward from scratch), never against the
speculative path itself.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from tiny import VOCAB, byte_tokenizer, make_hf_dir, make_hf_model
from verispec import LLM, ConfigError, SamplingParams, VerispecError
from verispec.cli import main
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.models.kv_cache import KVCache
from verispec.sampling import logits_to_probs, mask_logits

SPEC_KEYS = {"draft_s", "drafted_tokens", "accepted_tokens", "acceptance_rate", "per_position_acceptance",
             "per_position_reached"}


@pytest.fixture(scope="module")
def dirs(tiny_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("spec_api")
    near = make_hf_model("qwen2", 0)  # the weights of tiny_dirs["qwen2"] plus noise: partial acceptance
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in near.parameters():
            if p.dim() == 2:
                p.add_(0.03 * torch.randn(p.shape, generator=g))
    near.save_pretrained(str(root / "near"))
    byte_tokenizer().save_pretrained(str(root / "near"))
    return {"target": str(tiny_dirs["qwen2"]), "near": str(root / "near"),
            "other": str(make_hf_dir(root / "other", "llama", seed=5))}


@pytest.fixture(scope="module")
def llm(dirs):
    return LLM(target=dirs["target"], draft=dirs["near"], dtype="float32")


# ---------------------------------------------------------------------------------------------
# Stats
# ---------------------------------------------------------------------------------------------


def check_stats(s: dict, K: int) -> None:
    assert 0 <= s["accepted_tokens"] <= s["drafted_tokens"]
    assert s["acceptance_rate"] == pytest.approx(s["accepted_tokens"] / s["drafted_tokens"])
    assert s["mean_accepted_length"] * s["target_forwards"] == pytest.approx(s["new_tokens"])
    acc, reached = s["per_position_acceptance"], s["per_position_reached"]
    assert len(acc) == len(reached) == K
    assert all(r1 >= r2 for r1, r2 in zip(reached, reached[1:])), reached
    assert all((a is None) == (r == 0) for a, r in zip(acc, reached))
    assert all(a is None or 0 <= a <= 1 for a in acc)
    # position 0 is judged once per round; each round is one target forward after the prefill, plus at
    # most one plain target step at the very end (one token left)
    rounds = reached[0]
    assert s["target_forwards"] - 1 - rounds in (0, 1)
    # per-position acceptances add up to the accepted drafts; rounds draft at most K tokens each
    assert sum(round(a * r) for a, r in zip(acc, reached) if r) == s["accepted_tokens"]
    assert rounds <= s["drafted_tokens"] <= K * rounds
    # each forward commits one token besides the accepted drafts; a stop may cut the last chunk short
    assert s["accepted_tokens"] + s["target_forwards"] >= s["new_tokens"]
    assert s["draft_s"] > 0 and s["target_s"] > 0
    assert s["wall_s"] >= 0.99 * (s["draft_s"] + s["target_s"])
    assert s["tokens_per_s"] == pytest.approx(s["new_tokens"] / s["wall_s"], rel=1e-3)


@pytest.mark.parametrize("kw", [
    dict(max_new_tokens=40, ignore_eos=True),
    dict(max_new_tokens=40, temperature=1.0, seed=1, ignore_eos=True),
    dict(max_new_tokens=37, temperature=0.7, top_k=20, seed=2),
])
@pytest.mark.parametrize("K", [1, 4])
def test_stats_are_consistent(llm, K, kw):
    out = llm.generate("Stats: ", SamplingParams(**kw), method="draft", num_draft_tokens=K)
    s = out.stats
    assert s["new_tokens"] == len(out.token_ids)
    check_stats(s, K)
    if out.finish_reason == "length":
        assert s["accepted_tokens"] + s["target_forwards"] == s["new_tokens"]
    assert 0 < s["acceptance_rate"] < 1  # the near draft: both outcomes happen


def test_stats_same_and_unrelated_drafts(dirs):
    same = LLM(target=dirs["target"], draft=dirs["target"], dtype="float32", draft_quant="none")  # truly the same
    s = same.generate("Stats: ", SamplingParams(max_new_tokens=31, ignore_eos=True), method="draft",
                      num_draft_tokens=5, early_stop=False).stats
    check_stats(s, 5)
    assert s["acceptance_rate"] == 1.0 and s["per_position_acceptance"] == [1.0] * 5
    assert s["target_forwards"] == 1 + math.ceil(30 / 6)
    other = LLM(target=dirs["target"], draft=dirs["other"], dtype="float32")
    s = other.generate("Stats: ", SamplingParams(max_new_tokens=31, ignore_eos=True), method="draft",
                       num_draft_tokens=5, early_stop=False).stats
    check_stats(s, 5)
    assert s["acceptance_rate"] < 0.25
    ar = other.generate("Stats: ", SamplingParams(max_new_tokens=31, ignore_eos=True)).stats
    assert not SPEC_KEYS & set(ar)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_stats_of_a_run_too_short_to_draft_everything(llm, n):
    """max_new_tokens <= K + 1: few or no rounds, yet the same keys, K positions (None = never reached)."""
    K = 4
    out = llm.generate("Short: ", SamplingParams(max_new_tokens=n, ignore_eos=True), method="draft",
                       num_draft_tokens=K)
    assert out.token_ids == llm.generate("Short: ", SamplingParams(max_new_tokens=n, ignore_eos=True)).token_ids
    s = out.stats
    assert SPEC_KEYS <= set(s)
    assert len(s["per_position_acceptance"]) == len(s["per_position_reached"]) == K
    assert s["per_position_reached"][1:] == [0] * (K - 1)  # no round ever drafts more than n - 2 tokens
    assert s["drafted_tokens"] == max(n - 2, 0)
    # the prefill; then one plain step (n = 2), or one round of K = 1 plus a plain step if it was rejected
    assert s["target_forwards"] == (n if n < 3 else 2 + (s["accepted_tokens"] == 0))


# ---------------------------------------------------------------------------------------------
# The draft model drafts from exactly the committed context (its cache rolls back correctly)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw", [dict(), dict(temperature=1.0, seed=5), dict(temperature=0.8, top_p=0.9, seed=6)])
def test_draft_model_proposes_from_the_committed_context(dirs, monkeypatch, kw):
    """Each proposal must be what the draft model says, computed from scratch, for the committed context
    plus the tokens drafted so far this round. A stale draft cache would not break exactness (any q is
    fine) but would silently ruin the acceptance rate, so it is checked here directly."""
    # float draft: an int8 draft's short steps and a from-scratch multi-row forward differ by design
    llm = LLM(target=dirs["target"], draft=dirs["other"], dtype="float32", draft_quant="none")
    params = SamplingParams(max_new_tokens=40, ignore_eos=True, **kw)
    draft = llm.draft.model
    seen = []
    real_propose = DraftModelDrafter.propose

    def spy(self, request):
        d = real_propose(self, request)
        seen.append((list(request.context), d.tokens[0].tolist(), None if d.draft_probs is None else d.draft_probs[0]))
        return d

    monkeypatch.setattr(DraftModelDrafter, "propose", spy)
    out = llm.generate("Draft cache: ", params, method="draft", num_draft_tokens=4)
    assert len(seen) >= 8 and out.stats["accepted_tokens"] < out.stats["drafted_tokens"]
    for context, tokens, probs in seen:
        ids = torch.tensor([context + tokens[:-1]])
        cache = KVCache.for_model(draft.config, 1, ids.shape[1], torch.float32)
        logits, _ = draft(ids, torch.arange(ids.shape[1])[None], cache)
        logits = mask_logits(logits[0, len(context) - 1:], llm.logit_mask)  # [K, V]: predicts each draft token
        if probs is None:
            assert tokens == logits.argmax(-1).tolist()
        else:
            torch.testing.assert_close(probs, logits_to_probs(logits, params), rtol=1e-4, atol=1e-5)
            assert (probs[torch.arange(len(tokens)), tokens] > 0).all()


# ---------------------------------------------------------------------------------------------
# Parameters and methods
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [0, -1, 2.0, "3", None, True])
def test_bad_num_draft_tokens(llm, k):
    with pytest.raises(ConfigError, match="num_draft_tokens"):
        llm.generate("Hi", SamplingParams(max_new_tokens=4), method="draft", num_draft_tokens=k)


def test_draft_method_without_a_draft(dirs):
    llm = LLM(target=dirs["target"], dtype="float32")  # not the default target: no default draft
    assert llm.draft is None
    with pytest.raises(VerispecError, match="draft") as ei:
        llm.generate("Hi", SamplingParams(max_new_tokens=4), method="draft")
    assert "\n" not in str(ei.value)
    assert llm.generate("Hi", SamplingParams(max_new_tokens=4)).token_ids  # AR still works


def test_unknown_method_lists_methods(llm):
    with pytest.raises(ConfigError) as ei:
        llm.generate("Hi", SamplingParams(max_new_tokens=4), method="lookahead")
    msg = str(ei.value)
    assert "lookahead" in msg and all(m in msg for m in ("ar", "draft", "eagle", "peagle", "medusa", "mtp"))


# ---------------------------------------------------------------------------------------------
# Vocabularies
# ---------------------------------------------------------------------------------------------


def _draft_with_tokenizer(path, tok):
    make_hf_dir(path, "qwen2", seed=3, tokenizer=False)
    tok.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def bad_vocab_drafts(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_vocab")
    extra = byte_tokenizer()
    extra.add_tokens(["<|extra|>"])
    assert len(extra) == 260
    swapped = root / "swapped"
    _draft_with_tokenizer(swapped, byte_tokenizer())
    tj = json.loads((swapped / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    a, b = next(k for k, v in vocab.items() if v == ord("a")), next(k for k, v in vocab.items() if v == ord("b"))
    vocab[a], vocab[b] = vocab[b], vocab[a]  # same tokens, two byte ids exchanged
    (swapped / "tokenizer.json").write_text(json.dumps(tj))
    return {"extra_token": _draft_with_tokenizer(root / "extra", extra), "swapped_bytes": str(swapped),
            "ids_only_272": str(make_hf_dir(root / "ids272", "qwen2", seed=3, tokenizer=False, vocab_size=272)),
            "ids_only_264": str(make_hf_dir(root / "ids264", "qwen2", seed=3, tokenizer=False))}


@pytest.mark.parametrize("target,draft", [
    ("tok", "extra_token"),
    ("tok", "swapped_bytes"),
    ("tok", "ids_only_272"),
    ("ids_only_264", "ids_only_272"),
])
def test_different_vocabularies_are_refused(dirs, bad_vocab_drafts, target, draft):
    t = dirs["target"] if target == "tok" else bad_vocab_drafts[target]
    d = bad_vocab_drafts[draft]
    with pytest.raises(VerispecError) as ei:
        LLM(target=t, draft=d, dtype="float32")
    msg = str(ei.value)
    assert t in msg and d in msg and "vocabular" in msg and "\n" not in msg


def test_swapped_tokenizer_really_differs(bad_vocab_drafts):
    """The refusal above is justified: the swapped tokenizer encodes the same text differently."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(bad_vocab_drafts["swapped_bytes"])
    assert tok("ab").input_ids == [ord("b"), ord("a")]


# ---------------------------------------------------------------------------------------------
# Padding rows of the vocabulary
# ---------------------------------------------------------------------------------------------

PAD_FAV = 260  # a padding row (>= len(tokenizer) = 259) that the models below prefer by far
EXTRA_FAV = 268  # a row only the 272-row draft has


def favour_rows(model, rows, dim=0, value=30.0):
    """Make the logits of ``rows`` dominate at every position: residual dimension ``dim`` is a constant
    (set in the embeddings, never written by a layer), and those lm_head rows read only that dimension."""
    with torch.no_grad():
        model.model.embed_tokens.weight[:, dim] = 2.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[dim] = 0.0
            layer.mlp.down_proj.weight[dim] = 0.0
        for r in rows:
            model.lm_head.weight[r] = 0.0
            model.lm_head.weight[r, dim] = value
    return model


@pytest.fixture(scope="module")
def padded(tmp_path_factory):
    """A target preferring padding row 260; drafts with the same weights and 264, 272 or 259 rows."""
    root = tmp_path_factory.mktemp("padded")
    out = {}
    for name, rows in [("target", VOCAB), ("draft272", 272), ("draft259", 259)]:
        m = favour_rows(make_hf_model("qwen2", 0), [PAD_FAV])
        if rows != VOCAB:
            m.resize_token_embeddings(rows, mean_resizing=False)
            if rows > EXTRA_FAV:
                favour_rows(m, [EXTRA_FAV], value=40.0)
        assert m.config.vocab_size == rows
        m.save_pretrained(str(root / name))
        byte_tokenizer().save_pretrained(str(root / name))
        out[name] = str(root / name)
    ids_only = root / "ids_only"  # no tokenizer: the padding row is declared in config.json instead
    favour_rows(make_hf_model("qwen2", 0), [PAD_FAV]).save_pretrained(str(ids_only))
    cfg = json.loads((ids_only / "config.json").read_text())
    cfg["verispec_masked_token_ids"] = [PAD_FAV]
    (ids_only / "config.json").write_text(json.dumps(cfg))
    out["ids_only"] = str(ids_only)
    return out


def test_padding_row_dominates_unmasked(padded):
    """Precondition: without masking, greedy decoding would emit the padding row every time."""
    import transformers

    for name in ("target", "draft272"):
        hf = transformers.AutoModelForCausalLM.from_pretrained(padded[name], dtype=torch.float32).eval()
        with torch.no_grad():
            top = hf(torch.tensor([list(b"Padding rows: never")])).logits[0].argmax(-1)
        assert (top == (PAD_FAV if name == "target" else EXTRA_FAV)).all(), name


@pytest.mark.parametrize("draft", ["target", "draft272", "draft259"])
def test_padding_rows_never_emitted_and_draft_padding_is_harmless(padded, draft):
    # int8 draft (the default before int4): greedy, its argmax agrees with the target's on every token here
    llm = LLM(target=padded["target"], draft=padded[draft], dtype="float32", draft_quant="int8")
    prompt = "Padding rows: "
    greedy = SamplingParams(max_new_tokens=30, ignore_eos=True)
    want = llm.generate(prompt, greedy).token_ids
    assert PAD_FAV not in want and max(want) < 259
    for K in (1, 4):
        out = llm.generate(prompt, greedy, method="draft", num_draft_tokens=K)
        assert out.token_ids == want
        # the draft's real rows line up with the target's and its padding rows are never proposed
        assert out.stats["acceptance_rate"] == 1.0, draft
    # sampling: with the draft's matrices as loaded, q == p up to float32 rounding on every real row, so
    # (almost) every draft is accepted; the int8 draft's q is off by its quantization error (a rejection
    # every few dozen tokens, at points that depend on the timing-driven early stops), so it only has to
    # keep the padding rows out
    exact = LLM(target=padded["target"], draft=padded[draft], dtype="float32", draft_quant="none")
    for seed in range(4):
        sampled = SamplingParams(max_new_tokens=30, temperature=1.0, seed=seed, ignore_eos=True)
        assert max(llm.generate(prompt, sampled).token_ids) < 259
        assert max(llm.generate(prompt, sampled, method="draft", num_draft_tokens=3).token_ids) < 259
        out = exact.generate(prompt, sampled, method="draft", num_draft_tokens=3)
        assert max(out.token_ids) < 259
        assert out.stats["acceptance_rate"] > 0.99


def test_config_masked_rows_never_emitted(padded):
    llm = LLM(target=padded["ids_only"], draft=padded["ids_only"], dtype="float32")
    assert llm.codec.tok is None and llm.target.config.masked_token_ids == (PAD_FAV,)
    ids = list(b"Padding rows: ")
    want = llm.generate(ids, SamplingParams(max_new_tokens=24, ignore_eos=True)).token_ids
    assert PAD_FAV not in want
    out = llm.generate(ids, SamplingParams(max_new_tokens=24, ignore_eos=True), method="draft", num_draft_tokens=3)
    assert out.token_ids == want and out.stats["acceptance_rate"] == 1.0
    for seed in range(3):
        out = llm.generate(ids, SamplingParams(max_new_tokens=24, temperature=1.0, seed=seed, ignore_eos=True),
                           method="draft", num_draft_tokens=3)
        assert PAD_FAV not in out.token_ids


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def run_main(capsys, argv):
    rc = main(argv)
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def assert_one_error_line(rc, out, err, *words):
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2, (rc, err)
    assert len(lines) == 1 and lines[0].startswith("verispec: error:"), err
    assert "Traceback" not in err + out
    for w in words:
        assert w in lines[0], (w, lines[0])


def test_cli_generate_draft_json(capsys, dirs, llm):
    argv = ["generate", "Hello, CLI", "--target", dirs["target"], "--draft", dirs["near"], "--dtype", "float32",
            "--method", "draft", "--num-draft-tokens", "3", "--max-new-tokens", "20", "--json"]
    rc, out, err = run_main(capsys, argv)
    assert rc == 0, err
    obj = json.loads(out.strip().splitlines()[-1])
    want = llm.generate("Hello, CLI", SamplingParams(max_new_tokens=20))
    assert obj["token_ids"] == want.token_ids and obj["text"] == want.text
    s = obj["stats"]
    assert 0 <= s["acceptance_rate"] <= 1 and len(s["per_position_acceptance"]) == 3
    assert s["new_tokens"] == len(want.token_ids)


def test_cli_generate_draft_streams(capsys, dirs, llm):
    argv = ["generate", "Hello, CLI", "--target", dirs["target"], "--draft", dirs["target"], "--dtype", "float32",
            "--method", "draft", "--max-new-tokens", "20"]
    rc, out, err = run_main(capsys, argv)
    assert rc == 0, err
    assert out == llm.generate("Hello, CLI", SamplingParams(max_new_tokens=20)).text + "\n"
    assert "tok/s" in err


def test_cli_bad_num_draft_tokens(capsys, dirs):
    argv = ["generate", "Hi", "--target", dirs["target"], "--draft", dirs["near"], "--dtype", "float32",
            "--method", "draft", "--num-draft-tokens", "0"]
    assert_one_error_line(*run_main(capsys, argv), "num_draft_tokens")


def test_cli_draft_method_without_draft(capsys, dirs):
    argv = ["generate", "Hi", "--target", dirs["target"], "--dtype", "float32", "--method", "draft"]
    assert_one_error_line(*run_main(capsys, argv), "draft")


def test_cli_mismatched_vocabulary(capsys, dirs, bad_vocab_drafts):
    argv = ["generate", "Hi", "--target", dirs["target"], "--draft", bad_vocab_drafts["extra_token"],
            "--dtype", "float32", "--method", "draft"]
    assert_one_error_line(*run_main(capsys, argv), "vocabular")


def test_cli_unknown_method(capsys, dirs):
    argv = ["generate", "Hi", "--target", dirs["target"], "--dtype", "float32", "--method", "lookahead"]
    assert_one_error_line(*run_main(capsys, argv), "lookahead", "draft")



def test_bad_draft_quant(dirs, capsys):
    with pytest.raises(ConfigError, match="draft_quant"):
        LLM(target=dirs["target"], draft=dirs["near"], dtype="float32", draft_quant="int3")
    rc = main(["generate", "Hi", "--target", dirs["target"], "--draft", dirs["near"], "--method", "draft",
               "--draft-quant", "int3"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("verispec: error:"), err


def test_with_draft_quant_shares_the_target_and_loads_its_own_draft(dirs):
    llm = LLM(target=dirs["target"], draft=dirs["near"], dtype="float32", draft_quant="none")
    other = llm.with_draft_quant("int4")
    assert other.target is llm.target and other.codec is llm.codec
    assert other.draft_calibrations is not llm.draft_calibrations and other.draft_prefixes is not llm.draft_prefixes
    proj = other.draft_model().model.layers[0].mlp.down_proj
    assert other.draft is not llm.draft and getattr(proj, "qop", None) is not None  # its own, in 4 bits
    assert getattr(llm.draft.model.layers[0].mlp.down_proj, "qop", None) is None  # the original's stays float
    with pytest.raises(ConfigError, match="draft_quant"):
        llm.with_draft_quant("int3")
