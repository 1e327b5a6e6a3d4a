"""The draft's restricted LM head (FR-Spec, draft_vocab.py): the table file, the choice of rows, the model
surgery, the packaged table, and the errors a user can hit. Exactness with a restricted draft is tested
in tests/exactness (greedy identity, chi-square with a negative control)."""

from __future__ import annotations

import pytest
import torch

from verispec import LLM, kernels
from verispec.cli import main
from verispec.draft_vocab import DATA_DIR, MAGIC, expected_counts, head_ids, head_ids_for, load_table, save_table
from verispec.errors import VerispecError
from verispec.models import loader
from verispec.models.kv_cache import KVCache
from verispec.models.registry import DEFAULT_DRAFT, DEFAULT_TARGET, REGISTRY

QWEN_VOCAB = 151_936


def test_table_round_trip(tmp_path):
    ranking = torch.tensor([7, 3, 250, 0, 9])
    save_table(tmp_path / "t", ranking, 259)
    assert load_table(tmp_path / "t", 264).tolist() == ranking.tolist()


@pytest.mark.parametrize("case", ["missing", "bad magic", "truncated", "id too large", "repeated", "bigger vocab"])
def test_bad_tables_are_one_line_errors(tmp_path, case):
    path = tmp_path / "t"
    if case != "missing":
        save_table(path, torch.tensor([1, 2, 3]), 259)
        data = bytearray(path.read_bytes())
        if case == "bad magic":
            data[:8] = b"NOTAVOCB"
        elif case == "truncated":
            data = data[:-2]
        elif case == "id too large":
            data[-4:] = (259).to_bytes(4, "little")
        elif case == "repeated":
            data[-4:] = (1).to_bytes(4, "little")
        elif case == "bigger vocab":
            save_table(path, torch.tensor([1, 2, 3]), 300)
            data = bytearray(path.read_bytes())
        path.write_bytes(bytes(data))
    with pytest.raises(VerispecError) as e:
        load_table(path, 264)
    assert "\n" not in str(e.value) and str(path) in str(e.value)


def test_head_ids_top_rows_plus_always_sorted():
    table = torch.tensor([9, 4, 7, 1, 0])
    assert head_ids(table, 3).tolist() == [4, 7, 9]
    assert head_ids(table, 3, always=(0, 9)).tolist() == [0, 4, 7, 9]
    with pytest.raises(VerispecError, match="ranks only 5"):
        head_ids(table, 6)
    with pytest.raises(VerispecError, match=">= 1"):
        head_ids(table, 0)


def test_head_ids_for_defaults_and_errors(tmp_path):
    save_table(tmp_path / "t", torch.arange(100), 100)
    assert head_ids_for("some/dir", 264, None, None) is None  # not asked for: the full head
    assert head_ids_for("some/dir", 264, 0, str(tmp_path / "t")) is None  # 0: the full head, table or not
    assert head_ids_for("some/dir", 264, 100, str(tmp_path / "t")).tolist() == list(range(100))
    assert head_ids_for("some/dir", 264, 10, str(tmp_path / "t"), always=(256,)).tolist() == [*range(10), 256]
    with pytest.raises(VerispecError, match="python -m verispec.draft_vocab"):
        head_ids_for("some/dir", 264, 10, None)


def test_packaged_table_for_the_default_draft():
    """The default draft ships a ranking (package data) that the default rows fit in, and it is plausible:
    the commonest English and code pieces rank high."""
    draft = DEFAULT_DRAFT[DEFAULT_TARGET]
    path = DATA_DIR / REGISTRY[draft].draft_vocab_table
    table = load_table(path, QWEN_VOCAB)
    assert len(table) == 65536
    eos = (151645, 151643)
    ids = head_ids_for(draft, QWEN_VOCAB, 32768, None, always=eos)
    assert len(ids) == 32768 + sum(e not in table[:32768] for e in eos) and set(eos) <= set(ids.tolist())
    top = set(table[:2000].tolist())
    assert {13, 11, 279, 198} <= top  # ".", ",", " the", "\n" in Qwen2's vocabulary
    # by default (None) the default draft keeps its registry rows; 0 keeps all; a draft without a default keeps all
    default = head_ids_for(draft, QWEN_VOCAB, None, None, always=eos)
    assert len(default) == REGISTRY[draft].draft_vocab_rows == 49152 and set(eos) <= set(default.tolist())
    assert head_ids_for(draft, QWEN_VOCAB, 0, None) is None and head_ids_for("some/dir", QWEN_VOCAB, None, None) is None


@pytest.fixture(scope="module")
def tiny_model(tiny_dirs):
    return lambda dtype=torch.float32: loader.load(str(tiny_dirs["qwen2"]), dtype)


def _logits(model, tokens):
    cache = KVCache.for_model(model.config, 1, len(tokens), model.dtype)
    return model(torch.tensor([tokens]), torch.arange(len(tokens))[None], cache)[0]  # [1, T, V]


def test_restrict_head_keeps_those_logits_and_masks_the_rest(tiny_model):
    full, part = tiny_model().model, tiny_model().model
    ids = torch.tensor([200, 3, 17, 256, 40])
    part.restrict_head(ids)
    assert part.lm_head.out_features == 5 and part.head_ids.tolist() == [3, 17, 40, 200, 256]
    tokens = [72, 101, 108, 108, 111]
    want, got = _logits(full, tokens), _logits(part, tokens)
    assert got.shape == want.shape
    kept = torch.zeros(want.shape[-1], dtype=torch.bool)
    kept[ids] = True
    torch.testing.assert_close(got[..., kept], want[..., kept], rtol=1e-6, atol=1e-6)
    assert torch.isneginf(got[..., ~kept]).all()


@pytest.mark.skipif(not kernels.available(), reason="verispec's C++ kernels are not built")
@pytest.mark.parametrize("bits", [8, 4])
def test_restricted_quantized_head_rows_are_the_full_heads_rows(tiny_model, bits):
    """Quantization is per output row, so a restricted int8/4-bit head computes bitwise the rows the full
    quantized head would (draft steps and the fused C++ path included)."""
    full, part = tiny_model(torch.bfloat16).model, tiny_model(torch.bfloat16).model
    ids = torch.arange(0, 259, 3)
    part.restrict_head(ids)
    assert full.quantize_weights(bits) and part.quantize_weights(bits)
    for tokens in ([72], [72, 101, 108]):
        want, got = _logits(full, tokens), _logits(part, tokens)
        assert torch.equal(got[..., ids], want[..., ids])


def test_expected_counts_sum_to_positions(tiny_model):
    model = tiny_model().model
    counts = expected_counts(model, [[72, 101], [1, 2, 3]], new_tokens=5, seed=0, progress=False)
    assert counts.shape == (model.config.vocab_size,) and counts.dtype == torch.float64
    assert counts.sum().item() == pytest.approx(10.0)  # one distribution per generated position
    again = expected_counts(model, [[72, 101], [1, 2, 3]], new_tokens=5, seed=0, progress=False)
    assert torch.equal(counts, again)


def test_llm_restricts_the_draft_head_only_when_asked(tiny_dirs, tmp_path):
    d = str(tiny_dirs["qwen2"])
    llm = LLM(target=d, draft=d, dtype="float32", draft_quant="none")
    assert llm.draft_vocab_rows is None and llm.draft.model.head_ids is None
    save_table(tmp_path / "t", torch.arange(259), 259)
    llm = LLM(target=d, draft=d, dtype="float32", draft_quant="none", draft_vocab=50,
              draft_vocab_table=str(tmp_path / "t"))
    assert llm.draft_vocab_rows == 51  # 50 rows + EOS
    assert llm.target.model.head_ids is None  # the target keeps its full head


def _assert_one_line(rc, err):
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize("extra", [["--draft-vocab", "-1"], ["--draft-vocab", "many"],
                                   ["--draft-vocab", "10"],  # no table for a directory
                                   ["--draft-vocab", "300", "--draft-vocab-table", "TABLE"],  # more than it ranks
                                   ["--draft-vocab", "10", "--draft-vocab-table", "/no/such/table"]])
def test_cli_draft_vocab_errors(capsys, tiny_dirs, tmp_path, extra):
    d = str(tiny_dirs["qwen2"])
    save_table(tmp_path / "t", torch.arange(259), 259)
    extra = [str(tmp_path / "t") if a == "TABLE" else a for a in extra]
    rc = main(["generate", "Hi", "--target", d, "--draft", d, "--method", "draft", "--dtype", "float32", *extra])
    _assert_one_line(rc, capsys.readouterr().err)


def test_tool_writes_a_table(tiny_dirs, tmp_path, capsys):
    from verispec import draft_vocab

    out = tmp_path / "tiny.draft-vocab"
    assert draft_vocab.main(["--model", str(tiny_dirs["qwen2"]), "--out", str(out), "--new-tokens", "3",
                             "--keep", "100"]) == 0
    table = load_table(out, 264)
    assert len(table) == 100 and out.read_bytes()[:8] == MAGIC
    capsys.readouterr()


@pytest.mark.parametrize("argv", [["--model", "MISSING", "--out", "OUT"], ["--out", "OUT", "--keep", "0"],
                                  ["--out", "OUT", "--new-tokens", "many"], [],
                                  ["--model", "TINY", "--out", "/no/such/dir/t", "--new-tokens", "1"]])
def test_tool_bad_input_is_one_line(tiny_dirs, tmp_path, capsys, argv):
    from verispec import draft_vocab

    subst = {"MISSING": str(tmp_path / "missing"), "OUT": str(tmp_path / "t"), "TINY": str(tiny_dirs["qwen2"])}
    rc = draft_vocab.main([subst.get(a, a) for a in argv])
    _assert_one_line(rc, capsys.readouterr().err)


def test_corpus_counts_counts_tokens_within_the_budget(tiny_dirs, tmp_path):
    from transformers import AutoTokenizer

    from verispec import draft_vocab

    tok = AutoTokenizer.from_pretrained(str(tiny_dirs["qwen2"]))
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.py").write_text("aab")
    (tmp_path / "src" / "b.md").write_text("b")
    (tmp_path / "src" / "c.bin").write_bytes(b"zzzz")  # not a text suffix: not read
    (tmp_path / "src" / "d.txt").write_bytes(b"\xff\xfe")  # not UTF-8: skipped
    files = draft_vocab.corpus_files([str(tmp_path / "src")])
    assert [f.name for f in files] == ["a.py", "b.md", "d.txt"]
    counts = draft_vocab.corpus_counts(tok, files, 264, max_bytes=100, progress=False)
    a, b, z = (tok("a")["input_ids"][0], tok("b")["input_ids"][0], tok("z")["input_ids"][0])
    assert counts[a] == 2 and counts[b] == 2 and counts[z] == 0 and counts.sum() == 4
    assert draft_vocab.corpus_counts(tok, files, 264, max_bytes=2, progress=False).sum() == 2  # the budget


def test_tool_with_a_corpus_ranks_its_tokens_first(tiny_dirs, tmp_path, capsys):
    from transformers import AutoTokenizer

    from verispec import draft_vocab

    (tmp_path / "code.py").write_text("~" * 500)
    out = tmp_path / "t"
    assert draft_vocab.main(["--model", str(tiny_dirs["qwen2"]), "--out", str(out), "--new-tokens", "2",
                             "--keep", "50", "--corpus", str(tmp_path / "code.py")]) == 0
    tilde = AutoTokenizer.from_pretrained(str(tiny_dirs["qwen2"]))("~")["input_ids"][0]
    assert load_table(out, 264)[0] == tilde  # half of the combined mass
    capsys.readouterr()
    for corpus in (tmp_path / "missing", tmp_path / "empty"):  # no such path; a directory without text files
        (tmp_path / "empty").mkdir(exist_ok=True)
        rc = draft_vocab.main(["--model", str(tiny_dirs["qwen2"]), "--out", str(out), "--corpus", str(corpus)])
        _assert_one_line(rc, capsys.readouterr().err)
