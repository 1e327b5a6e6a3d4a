"""The training levers train-head exposes beside K and the data: the learning-rate schedule after warm-up, the
weight of each unroll step's loss (EAGLE-3: 0.8 ** j) and the rows the loss reads (--loss-on: all, or the answers the
target wrote, which held-out acceptance counts either way)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from verispec.training.recipes.eagle3 import chain_loss
from verispec.training.trainer import TrainConfig, Trainer, answer_rows


def lr_at(**cfg) -> list[float]:
    c = TrainConfig(**cfg)
    return [Trainer.lr_at(type("T", (), {"cfg": c})(), s) for s in range(c.steps)]


def test_cosine_falls_to_a_tenth_and_constant_stays():
    cos, const = lr_at(steps=100, lr=1.0, warmup=10), lr_at(steps=100, lr=1.0, warmup=10, schedule="constant")
    assert cos[:10] == const[:10] == [(s + 1) / 10 for s in range(10)]  # the same warm-up
    assert cos[10] == pytest.approx(1.0) and cos[-1] == pytest.approx(0.1, abs=1e-3)
    assert all(a >= b for a, b in zip(cos[10:], cos[11:]))
    assert const[10:] == [1.0] * 90


def test_step_weight_scales_each_unroll_steps_loss():
    """weight 0 keeps step 0's loss alone, weight 1 sums the steps, 0.5 halves each later step."""
    g = torch.Generator().manual_seed(0)
    B, T, V, steps = 1, 6, 5, 3
    logits = [torch.randn(B, T, V, generator=g) for _ in range(steps)]
    p = torch.softmax(torch.randn(B, T, V, generator=g), -1)
    batch = {"tokens": torch.zeros(B, T), "features": torch.zeros(B, T, 2), "topk_ids": None, "topk_logp": None}
    labels = lambda ids, logp: (p, p.argmax(-1))  # noqa: E731
    per_step = [-(p[:, j + 1:] * F.log_softmax(logits[j][:, :T - j - 1], -1)).sum(-1).mean() for j in range(steps)]
    for w in (0.0, 0.5, 1.0):
        loss, _, _ = chain_loss(lambda f, t, n: logits, batch, labels, steps, w)
        assert loss == pytest.approx(float(sum(w ** j * per_step[j] for j in range(steps))), rel=1e-6), w


def test_answer_rows_mark_what_the_target_wrote_across_sequence_cuts():
    """Rows whose next token lies in an assistant turn (its content and the token that ends it), found in the
    stream the split's sequences were cut from, so a turn that spans a cut is marked on both sides."""
    from tiny import byte_tokenizer

    from verispec.training.cli import assistant_turns

    tok = byte_tokenizer()
    opening, ends = assistant_turns(tok, (tok.eos_token_id,))
    assert tok.decode(list(opening)) == "<|start|>assistant\n"
    chat = [{"role": "user", "content": "say hi"}, {"role": "assistant", "content": "hi there"},
            {"role": "user", "content": "again"}, {"role": "assistant", "content": "hello"}]
    ids = tok.apply_chat_template(chat, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    stream = ids + list(tok("plain text after").input_ids)
    T = 8
    stream = stream[:len(stream) // T * T]
    rows = answer_rows(torch.tensor(stream).view(-1, T), opening, ends)
    written = [tok.decode(stream[t + 1]) for t, a in enumerate(rows.flatten().tolist()) if a]
    assert "".join(written) == "hi there<|end|>hello<|end|>", written
    # a split with no assistant turn (plain text): every row
    plain = torch.tensor(list(tok("just text, no turns at all").input_ids)[:24]).view(3, 8)
    assert answer_rows(plain, opening, ends).all()


def test_loss_on_answers_reads_only_those_rows_and_acceptance_counts_them():
    """answers_only: the loss ignores what the head predicts at other rows (with the loss on all rows it does not);
    acceptance counts marked rows either way, and a chain stops where they end."""
    g = torch.Generator().manual_seed(1)
    B, T, V, steps = 1, 8, 5, 2
    logits = [torch.randn(B, T, V, generator=g) for _ in range(steps)]
    p = torch.softmax(torch.randn(B, T, V, generator=g), -1)
    answer = torch.tensor([[False, False, False, True, True, True, False, False]])
    batch = {"tokens": torch.zeros(B, T), "features": torch.zeros(B, T, 2), "topk_ids": None, "topk_logp": None,
             "answer": answer}
    labels = lambda ids, logp: (p, p.argmax(-1))  # noqa: E731
    # logits that differ only at rows whose label (row r + j + 1) is not an answer row
    other = [lg.clone() for lg in logits]
    for j in range(steps):
        for r in range(T - j - 1):
            if not answer[0, r + j + 1]:
                other[j][0, r] += 3.0 * torch.randn(V, generator=g)
    a, _, _ = chain_loss(lambda f, t, n: logits, batch, labels, steps, 0.8, answers_only=True)
    b, _, _ = chain_loss(lambda f, t, n: other, batch, labels, steps, 0.8, answers_only=True)
    assert a == pytest.approx(float(b), rel=1e-6)
    c, _, _ = chain_loss(lambda f, t, n: logits, batch, labels, steps, 0.8)
    d, _, _ = chain_loss(lambda f, t, n: other, batch, labels, steps, 0.8)
    assert abs(float(c) - float(d)) > 1e-3
    # a head that always agrees with the target: reached = hits = marked rows at step 0 (rows 2..4) and step 1 (2..3)
    agree = [F.one_hot(p.argmax(-1)[:, j + 1:], V).float() * 10 for j in range(steps)]
    agree = [torch.cat([x, torch.zeros(B, j + 1, V)], 1) for j, x in enumerate(agree)]
    _, hits, reached = chain_loss(lambda f, t, n: agree, batch, labels, steps, 0.8)
    assert reached == [3, 2] and hits == [3, 2], (hits, reached)
    del batch["answer"]
    _, hits, reached = chain_loss(lambda f, t, n: agree, batch, labels, steps, 0.8)
    assert reached == [7, 6] and hits == [7, 6]
