"""`verispec train-head`: extract the target's features from a corpus, then train a draft head on them (``--arch``:
its family, one recipe each in training/recipes/; EAGLE-3 by default).

Both phases resume: extraction skips the sequences its shards hold, training (--resume) continues from the last
checkpoint bit for bit. ``torchrun --nproc-per-node N -m verispec.cli train-head ...`` splits both over N
processes (gloo on CPU, nccl on a GPU).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import fields, replace
from pathlib import Path

from ..errors import VerispecError
from .recipes import RECIPES
from .trainer import TrainConfig


def _layers(text: str) -> tuple[int, ...]:
    try:
        layers = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes comma-separated layer numbers, got {text!r}") from None
    if not layers:
        raise argparse.ArgumentTypeError("needs at least one layer")
    return layers


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes a positive integer, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"takes a positive integer, got {text!r}")
    return n


def add_train_parser(sub) -> None:
    from ..models.registry import DEFAULT_TARGET

    d = TrainConfig()
    p = sub.add_parser("train-head", help="train a draft head (EAGLE-3) on a target's hidden states",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", choices=sorted(RECIPES), default="eagle3", help="the head's family (default eagle3)")
    p.add_argument("--target", default=DEFAULT_TARGET, help=f"model name, HF directory or .gguf (default: {DEFAULT_TARGET})")
    p.add_argument("--data", nargs="+", default=[], metavar="FILE_OR_DIR",
                   help="training text: directories (every text file under them), text files, or JSONL with "
                        '"text", "messages" (a conversation) or "prompt" (the target answers it: self-distillation)')
    p.add_argument("--out", required=True, help="directory for the head (config.json + model.safetensors), "
                                                "checkpoint.pt and history.json")
    p.add_argument("--layers", type=_layers, default=None, metavar="I,J,K",
                   help="target residual streams the head reads (i = after layer i; default: 2, L/2, L-3; one layer "
                        "gives EAGLE-1)")
    p.add_argument("--head-layers", type=_positive, default=None, metavar="N",
                   help="the head's depth: decoder layers (eagle3, peagle), ResBlocks per head (medusa); an MTP module "
                        "is one layer (default 1)")
    p.add_argument("--mask-first-hidden", action="store_true",
                   help="--arch peagle: the mask rows also read the first draft's hidden state (not a learned constant "
                        "alone)")
    p.add_argument("--draft-vocab", type=_positive, default=d.draft_vocab, metavar="N",
                   help=f"tokens the head may propose: the N the target predicts most often in the data (default {d.draft_vocab})")
    p.add_argument("--steps", type=_positive, default=d.steps, help=f"optimizer steps (default {d.steps})")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--features", default=None, metavar="DIR",
                   help="feature shards (default: OUT/features); without --data, the shards there are trained on as "
                        "they are (captured by `verispec distill --features DIR`, or extracted by an earlier run)")
    p.add_argument("--extract-tokens", type=_positive, default=262144, help="training tokens to extract (default 262144)")
    p.add_argument("--heldout-tokens", type=_positive, default=8192, help="held-out tokens (default 8192)")
    p.add_argument("--seq-len", type=_positive, default=512, help="tokens per sequence (default 512)")
    p.add_argument("--topk", type=_positive, default=16, help="target log-probabilities kept per position (default 16)")
    p.add_argument("--self-distill-tokens", type=_positive, default=256,
                   help='tokens the target writes per "prompt" record (default 256)')
    p.add_argument("--ttt-steps", type=_positive, default=d.ttt_steps,
                   help=f"training-time test: steps the head is unrolled on its own outputs (default {d.ttt_steps})")
    p.add_argument("--lr", type=float, default=d.lr, help=f"peak AdamW learning rate (default {d.lr})")
    p.add_argument("--schedule", choices=["cosine", "constant"], default=d.schedule,
                   help="learning rate after the warm-up: cosine to 10%% of --lr (default) or constant")
    p.add_argument("--step-weight", type=float, default=d.step_weight, metavar="W",
                   help=f"the loss of unroll step j (Medusa: head j) weighted W ** j (default {d.step_weight})")
    p.add_argument("--loss-on", choices=["all", "answers"], default=d.loss_on,
                   help="rows the loss reads: all (default) or answers, those whose next token the target wrote in an "
                        "assistant turn, as a drafter meets them (held-out acceptance counts those rows either way)")
    p.add_argument("--suite-eval", type=int, default=0, metavar="N",
                   help="also score the head at each evaluation on the target's greedy answers to the bench suite's "
                        "first N prompts a category (teacher-forced acceptance on the answer rows; never trained on)")
    p.add_argument("--batch", type=_positive, default=d.batch, help="sequences per step and process (default 1)")
    p.add_argument("--init", default=d.init, metavar="target|random|HEAD_DIR",
                   help="the head's layer starts as the target's last layer (default), random, or as the head in "
                        "HEAD_DIR (continual training, e.g. of the shipped one: its family, layers and vocabulary "
                        "size; the draft tokens are chosen again from this data unless --keep-draft-vocab)")
    p.add_argument("--keep-draft-vocab", action="store_true",
                   help="with --init HEAD_DIR: keep its draft tokens (chosen from more data than this run's, say)")
    p.add_argument("--ckpt-every", type=_positive, default=d.ckpt_every, help="steps between checkpoints")
    p.add_argument("--eval-every", type=_positive, default=d.eval_every, help="steps between held-out evaluations")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's choice)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def run_train(args) -> int:
    import torch

    from ..heads.io import read_head
    from ..llm import LLM
    from ..models.hugepages import keep_freed_memory
    from ..models.loader import load
    from .extract import extract, read_settings, shards, suite_answers
    from .trainer import Trainer, draft_vocabulary, load_split

    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".writable"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise VerispecError(f"--out {out}: not writable ({e.strerror or e})") from None
    from .capture import captured

    features = Path(args.features) if args.features else out / "features"
    capture = captured(features)  # shards trained on as they are: captured by distill, or extracted before
    if capture is None and not args.data and shards(features, "train"):
        capture = read_settings(features)  # an earlier run's extraction, reused (None: shards without settings)
    if not args.data and capture is None:
        raise VerispecError("--data: training text needed (or --features DIR holding shards: captured by verispec "
                            "distill or extracted by an earlier train-head)")
    for path in args.data:
        if not Path(path).exists():
            raise VerispecError(f"--data {path}: no such file or directory")
    if not args.step_weight >= 0:
        raise VerispecError(f"--step-weight {args.step_weight}: a weight >= 0 (1 weighs every unroll step alike)")
    if args.suite_eval < 0:
        raise VerispecError(f"--suite-eval {args.suite_eval}: prompts a category, >= 0 (0: none)")
    ckpt = out / "checkpoint.pt"
    if args.resume and not ckpt.exists():
        raise VerispecError(f"--resume: no checkpoint at {ckpt}")
    if args.threads:
        torch.set_num_threads(args.threads)
    keep_freed_memory()  # a step re-makes its tensors: no unmapping and re-faulting them each step
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    progress = not args.no_progress

    # 1. features: the target as inference runs it (native GGUF weights on CPU)
    recipe = RECIPES[args.arch]
    llm = LLM(args.target, progress=progress and rank == 0)
    start = None  # continual training: the head to start from
    if args.mask_first_hidden and (args.arch != "peagle" or args.init not in ("target", "random")):
        raise VerispecError("--mask-first-hidden: only for a new --arch peagle head")
    if args.keep_draft_vocab and args.init in ("target", "random"):
        raise VerispecError("--keep-draft-vocab: only with --init HEAD_DIR (a head whose draft tokens to keep)")
    if args.init not in ("target", "random"):
        if not Path(args.init).is_dir():
            raise VerispecError(f"--init {args.init}: not 'target', 'random' or a head directory")
        start, start_has_lm_head = read_head(args.init, llm.target.config, str(llm.target.source))
        if start.config.family != recipe.head.Config.family and issubclass(recipe.head, type(start)):
            start = extend(start, recipe.head)  # P-EAGLE from an EAGLE-3 head: its weights, new parts at their start
        if start.config.family != recipe.head.Config.family:
            raise VerispecError(f"--init {args.init}: a {start.config.family} head, but --arch is {args.arch}")
        if args.layers is not None and tuple(args.layers) != tuple(start.config.layers):
            raise VerispecError(f"--layers {','.join(map(str, args.layers))}: the head in {args.init} reads layers "
                                f"{','.join(map(str, start.config.layers))}")
        if args.head_layers is not None and args.head_layers != start.config.num_layers:
            raise VerispecError(f"--head-layers {args.head_layers}: the head in {args.init} has "
                                f"{start.config.num_layers}")
        args.layers, args.draft_vocab = tuple(start.config.layers), start.config.draft_vocab_size
    pick, stored = None, 1  # which of the captured layers the head reads (all of them: None), of how many
    if capture is not None:  # trained on as they are, or on some of their layers
        kept = tuple(capture["layers"])
        if capture["hidden_size"] != llm.target.config.hidden_size:
            raise VerispecError(f"--features {features} was made from another target ({capture['target']})")
        wanted = args.layers or recipe.head.Config.default_layers(llm.target.config.num_layers)
        if args.layers is None and not set(wanted) <= set(kept):
            wanted = kept
        if not set(wanted) <= set(kept):
            raise VerispecError(f"--features {features} holds layers {','.join(map(str, kept))}, not "
                                f"{','.join(map(str, wanted))}")
        args.layers = tuple(wanted)
        pick, stored = None if args.layers == kept else tuple(kept.index(i) for i in args.layers), len(kept)
    layers = replace(recipe.head.Config.for_target(llm.target.config, args.layers, 1),  # checks layers and depth
                     num_layers=args.head_layers or 1).layers
    report = {} if capture is not None else extract(
        llm, args.data, features, layers, args.seq_len, args.extract_tokens, args.heldout_tokens, args.topk,
        args.seed, args.self_distill_tokens, rank, world, progress)
    for split, r in report.items():
        if r["sequences"] and rank == 0:
            print(f"extracted {r['sequences'] * args.seq_len} {split} tokens in {r['seconds']} s "
                  f"({r['tokens_per_s']} tokens/s)", file=sys.stderr)
    suite = suite_answers(llm, args.suite_eval, layers, args.topk) if args.suite_eval and rank == 0 else None
    eos = llm.eos_token_ids
    turns = assistant_turns(llm.codec.tok, eos)
    target_source = llm.target.source
    del llm
    if world > 1:
        torch.distributed.barrier()

    # 2. the head, on the target's dense weights (embedding, LM head rows, last layer for the initial values)
    target = load(args.target, torch.bfloat16, "cpu", progress=False, weights="dequantized")
    files = {split: shards(features, split) for split in ("train", "heldout")}
    if capture is not None and not files["heldout"] and len(files["train"]) > 1:  # a short capture: one record in
        files["heldout"] = [files["train"].pop()]  # HELDOUT_EVERY is held out, maybe none yet; so is its last shard
        if rank == 0:
            print(f"--features {features}: no held-out shards yet; holding out {files['heldout'][0].name}",
                  file=sys.stderr)
    train, heldout = (load_split(features, split, pick, stored, files[split], turns) for split in ("train", "heldout"))
    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in fields(TrainConfig) if hasattr(args, f.name)})
    if start is not None:  # its weights as they are
        head = start
        if not start_has_lm_head:  # its LM head is the target's rows for its draft vocabulary: the vocabulary is
            # chosen again from this data (the target's rows fit any choice; the old one may miss this data's tokens)
            if not args.keep_draft_vocab:
                head.d2t = draft_vocabulary(train["topk_ids"][..., 0], head.config.draft_vocab_size,
                                            head.config.vocab_size, eos)
            head.freeze_target_rows(target.model)
        head.lm_head.weight.requires_grad_(False)
    else:
        options = {"first_hidden": True} if args.mask_first_hidden else {}
        head = recipe.build(target.config, layers, cfg.draft_vocab, args.head_layers or 1, **options)
        head.d2t = draft_vocabulary(train["topk_ids"][..., 0], head.config.draft_vocab_size, head.config.vocab_size,
                                    eos)
        recipe.init(head, target.model, cfg.init, cfg.seed)
    hc = head.config
    head.attach_target(target.model)
    trainer = Trainer(head, cfg, train, heldout, out, rank, world,
                      log=lambda line: print(line, file=sys.stderr), started=start is not None, suite=suite)
    if args.resume:
        trainer.load(ckpt)
    if rank == 0:
        answers = f" ({int(train['answer'].sum())} the target wrote)" if "answer" in train else ""
        print(f"training a head on {train['tokens'].numel()} tokens{answers} from {target_source}: draft vocabulary "
              f"{hc.draft_vocab_size}, layers {','.join(map(str, layers))}, steps {trainer.step}..{cfg.steps}, loss "
              f"on {cfg.loss_on}", file=sys.stderr)
    final = trainer.run(progress)
    if rank == 0:
        print(f"head written to {out} (held-out tau {final.get('heldout_tau')})", file=sys.stderr)
    if world > 1:  # every rank done (rank 0 has written the head) before gloo's threads are torn down: a rank that
        torch.distributed.barrier()  # left early aborted now and then ("terminate called without an active exception")
        torch.distributed.destroy_process_group()
    return 0


def assistant_turns(tok, ends: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(the ids that open an assistant turn, the ids that end one) from the chat template: what its generation
    prompt adds to a conversation; None without a chat template."""
    if not getattr(tok, "chat_template", None):
        return None
    turn = [{"role": "user", "content": "x"}]
    ids = [tok.apply_chat_template(turn, tokenize=True, add_generation_prompt=g) for g in (False, True)]
    before, after = (list(i["input_ids"] if hasattr(i, "keys") else i) for i in ids)
    if after[:len(before)] != before or len(after) == len(before):
        return None
    return tuple(after[len(before):]), tuple(ends)


def extend(head, cls):
    """A head of family ``cls``, a subclass of ``head``'s (P-EAGLE of EAGLE-3), with ``head``'s weights and draft
    vocabulary; the parts only ``cls`` has keep their initial values (P-EAGLE's mask inputs: zero)."""
    from dataclasses import asdict

    out = cls(cls.Config(**asdict(head.config)))
    missing, unexpected = out.load_state_dict(head.state_dict(), strict=False)
    assert not unexpected, unexpected
    out.d2t = head.d2t
    return out
