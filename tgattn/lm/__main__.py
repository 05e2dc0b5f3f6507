"""``python -m tgattn.lm train|sample|eval|bench-decode|bench-train|bench-memory``."""
from __future__ import annotations

import argparse
import csv
import json
import sys
from dataclasses import asdict, fields
from pathlib import Path

import torch

from ..models import PATTERNS, GPTConfig, generate
from . import bench
from .data import CharTokenizer, load_corpus, split
from .checkpoint import load_checkpoint, model_from_checkpoint
from .train import TrainConfig, evaluate, train


def _add_fields(parser: argparse.ArgumentParser, cls, skip=()) -> None:
    for f in fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            parser.add_argument(flag, type=lambda s: s.lower() in ("1", "true", "yes"), default=f.default)
        else:
            kind = {"int": int, "float": float, "str": str}[f.type if isinstance(f.type, str) else f.type.__name__]
            parser.add_argument(flag, type=kind, default=f.default, help=f"(default: {f.default})")


def _pick(args, cls, **extra):
    return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}, **extra)


def _corpus(args):
    text = load_corpus(args.data)
    tok = CharTokenizer.from_text(text)
    train_ids, val_ids = split(tok.encode(text))
    return tok, train_ids, val_ids


def cmd_train(args) -> int:
    tok, train_ids, val_ids = _corpus(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    model_config = _pick(args, GPTConfig, vocab_size=len(tok))
    cfg = _pick(args, TrainConfig)
    ckpt = Path(args.out) / "ckpt.pt"
    history = train(
        model_config, cfg, train_ids, val_ids, tok.vocab, checkpoint=ckpt, resume=args.resume, progress=not args.no_progress
    )
    steps, evals = history["steps"], history["evals"]
    times = sorted(s["seconds"] for s in steps)
    summary = {
        "attention": history["model"].config.attention,
        "pattern": history["model"].config.pattern,
        "window": history["model"].config.window,
        "params": history["model"].num_params(),
        "iters": cfg.max_iters,
        "final_val": evals[-1]["val"] if evals else None,
        "final_train": evals[-1]["train"] if evals else None,
        "mean_s_per_iter": sum(times) / len(times) if times else None,
        "median_s_per_iter": times[len(times) // 2] if times else None,
        "threads": torch.get_num_threads(),
    }
    if args.log:
        log = Path(args.log)
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log.with_suffix(".steps.csv"), "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=["iter", "loss", "lr", "seconds"])
            w.writeheader()
            w.writerows(steps)
        with open(log.with_suffix(".evals.csv"), "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=["iter", "train", "val"])
            w.writeheader()
            w.writerows(evals)
        log.with_suffix(".json").write_text(json.dumps({**summary, "config": asdict(history["model"].config), "train": asdict(cfg)}, indent=1))
    print(json.dumps(summary))
    return 0


def cmd_eval(args) -> int:
    state = load_checkpoint(args.checkpoint)
    model = model_from_checkpoint(state)
    text = load_corpus(args.data)
    tok = CharTokenizer(state["vocab"])
    train_ids, val_ids = split(tok.encode(text))
    kw = dict(batch_size=args.batch_size, iters=args.eval_iters, seed=args.seed)
    out = {"iter": state["iter"], "train": evaluate(model, train_ids, **kw), "val": evaluate(model, val_ids, **kw)}
    print(json.dumps(out))
    return 0


def cmd_sample(args) -> int:
    state = load_checkpoint(args.checkpoint)
    model = model_from_checkpoint(state)
    tok = CharTokenizer(state["vocab"])
    prompt = tok.encode(args.prompt).unsqueeze(0)
    g = torch.Generator().manual_seed(args.seed)
    out = generate(
        model, prompt, args.num_tokens, temperature=args.temperature, top_k=args.top_k, generator=g, use_cache=not args.no_cache
    )
    print(tok.decode(out[0]))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tgattn.lm", description="Character GPT on Tiny Shakespeare.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train (or --resume) a GPT; checkpoint in OUT/ckpt.pt")
    p.add_argument("--data", default=None, help="data folder (default: $TGATTN_DATA)")
    p.add_argument("--out", default="out-lm", help="checkpoint folder (default: out-lm)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/ckpt.pt")
    p.add_argument("--log", default=None, help="write LOG.steps.csv, LOG.evals.csv and LOG.json")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    _add_fields(p, GPTConfig, skip=("vocab_size",))
    _add_fields(p, TrainConfig)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("eval", help="train and validation loss of a checkpoint")
    p.add_argument("--checkpoint", default="out-lm/ckpt.pt")
    p.add_argument("--data", default=None, help="data folder (default: $TGATTN_DATA)")
    p.add_argument("--batch-size", type=int, default=12)
    p.add_argument("--eval-iters", type=int, default=200)
    p.add_argument("--seed", type=int, default=1338, help="seed of the evaluation batches (training uses seed + 1)")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("sample", help="generate text from a checkpoint")
    p.add_argument("--checkpoint", default="out-lm/ckpt.pt")
    p.add_argument("--prompt", default="\n")
    p.add_argument("--num-tokens", type=int, default=500)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--no-cache", action="store_true", help="recompute the whole context every step")
    p.set_defaults(func=cmd_sample)

    bench.add_parsers(sub)
    args = parser.parse_args(argv)
    if getattr(args, "pattern", "causal") not in PATTERNS:
        parser.error(f"--pattern must be one of {PATTERNS} (got {args.pattern!r})")
    try:
        return args.func(args)
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
