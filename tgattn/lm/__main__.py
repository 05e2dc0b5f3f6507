"""``python -m tgattn.lm train|sample|eval|bench-decode|bench-train|bench-memory``.

The parser needs no torch (the settings are plain dataclasses): ``--help`` and bad
arguments answer at once; each command imports what it runs.
"""
from __future__ import annotations

import argparse
import csv
import json
import re
import sys
from dataclasses import asdict, fields, replace
from pathlib import Path

from .._cli import boolean, non_negative_int, positive_float, positive_int, positive_ints, run, seed_int
from ..models.config import ATTENTIONS, PATTERNS, SELECTIONS, GPTConfig
from .config import TrainConfig

CHOICES = {"attention": ATTENTIONS, "pattern": PATTERNS}
THREADS = dict(type=non_negative_int, default=0, help="torch threads (default: torch's choice)")


class _Given(argparse.Action):
    """Stores a flag's value and adds its name to ``namespace.given``: the flags typed, not defaulted."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.given = getattr(namespace, "given", frozenset()) | {self.dest}  # a new set: the default is shared


def _add_fields(parser: argparse.ArgumentParser, cls, skip=()) -> None:
    """One flag per field of the dataclass ``cls``; its values are checked when ``cls`` is built."""
    parser.set_defaults(given=frozenset())
    for f in fields(cls):
        if f.name in skip:
            continue
        kind = {"int": int, "float": float, "str": str, "bool": boolean}[f.type if isinstance(f.type, str) else f.type.__name__]
        parser.add_argument("--" + f.name.replace("_", "-"), type=kind, default=f.default, choices=CHOICES.get(f.name),
                            action=_Given, help=f"(default: {f.default})")


def _flag(name: str, value) -> str:
    """``n_embd, 16`` -> ``--n-embd 16``."""
    return f"--{name.replace('_', '-')} {str(value).lower() if isinstance(value, bool) else value}"


def _as_flags(message: str) -> str:
    """A settings error in the words of the command line: ``n_embd`` -> ``--n-embd`` (a quoted value stays: ``'window'``)."""
    names = sorted({f.name for cls in (GPTConfig, TrainConfig) for f in fields(cls)}, key=len, reverse=True)
    return re.sub(r"(?<!')\b(" + "|".join(names) + r")\b(?!')", lambda m: "--" + m.group(1).replace("_", "-"), message)


def _pick(args, cls):
    return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})


def _corpus(args):
    from .data import CharTokenizer, load_corpus, split

    text = load_corpus(args.data)
    tok = CharTokenizer.from_text(text)
    train_ids, val_ids = split(tok.encode(text))
    return tok, train_ids, val_ids


def _check_resume(args, ckpt: Path) -> bool:
    """Whether ``--resume`` has steps to take; an error when the checkpoint contradicts the command line.

    Refused: model flags typed on the command line that differ from the checkpoint's model
    (flags left out take the checkpoint's values) and a checkpoint already past
    ``--max-iters`` (resuming never takes a run back, nor relabels its checkpoint).
    """
    from .checkpoint import checkpoint_config, load_checkpoint
    from .training import resume_point

    state = load_checkpoint(ckpt)
    config = checkpoint_config(state, ckpt)
    clash = [f.name for f in fields(GPTConfig) if f.name in args.given and getattr(args, f.name) != getattr(config, f.name)]
    if clash:
        raise ValueError(
            f"checkpoint {ckpt} holds a model with {', '.join(_flag(n, getattr(config, n)) for n in clash)}; "
            f"--resume cannot change it to {', '.join(_flag(n, getattr(args, n)) for n in clash)} "
            "(leave those flags out to resume it, or train a new model into another --out)"
        )
    it, target = resume_point(state, ckpt), args.train_config.max_iters
    if it > target:
        raise ValueError(
            f"checkpoint {ckpt} is already at iteration {it}, past --max-iters {target}: resuming cannot take it back "
            f"(pass --max-iters {it} or more to continue it, or train a new model into another --out)"
        )
    if it == target:
        print(f"checkpoint {ckpt} is already at iteration {it} (--max-iters {target}): nothing to do", file=sys.stderr)
    return it < target


def cmd_train(args) -> int:
    import torch

    from .training import train

    ckpt = Path(args.out) / "ckpt.pt"
    if args.resume and not _check_resume(args, ckpt):
        return 0
    tok, train_ids, val_ids = _corpus(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    model_config = replace(args.model_config, vocab_size=len(tok))
    cfg = args.train_config
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
        "checkpoint": str(ckpt),
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
    print(f"checkpoint: {ckpt} (iteration {cfg.max_iters})", file=sys.stderr)
    print(json.dumps(summary))
    return 0


def cmd_eval(args) -> int:
    from .checkpoint import load_checkpoint, model_from_checkpoint
    from .data import CharTokenizer, load_corpus, split
    from .training import evaluate

    state = load_checkpoint(args.checkpoint)
    model = model_from_checkpoint(state, args.checkpoint)
    text = load_corpus(args.data)
    tok = CharTokenizer(state["vocab"])
    train_ids, val_ids = split(tok.encode(text))
    kw = dict(batch_size=args.batch_size, iters=args.eval_iters, seed=args.seed)
    out = {"iter": state.get("iter"), **{split: evaluate(model, ids, **kw, progress=f"{split} loss")
                                         for split, ids in (("train", train_ids), ("val", val_ids))}}
    print(json.dumps(out))
    return 0


def cmd_sample(args) -> int:
    import torch

    from ..models import generate
    from .checkpoint import load_checkpoint, model_from_checkpoint
    from .data import CharTokenizer

    state = load_checkpoint(args.checkpoint)
    model = model_from_checkpoint(state, args.checkpoint)
    unknown = sorted(set(args.prompt) - set(state["vocab"]))
    if unknown:
        raise ValueError(f"--prompt holds characters that {args.checkpoint} has no token for: {''.join(unknown)!r}")
    tok = CharTokenizer(state["vocab"])
    prompt = tok.encode(args.prompt).unsqueeze(0)
    g = torch.Generator().manual_seed(args.seed)
    out = generate(
        model, prompt, args.num_tokens, temperature=args.temperature, top_k=args.top_k, generator=g, use_cache=not args.no_cache
    )
    print(tok.decode(out[0]))
    return 0


def _bench(name: str):
    def command(args) -> int:
        from . import bench

        return getattr(bench, name)(args)

    return command


def _add_bench_parsers(sub) -> None:
    p = sub.add_parser("bench-decode", allow_abbrev=False, help="incremental decoding vs full recomputation (window pattern)")
    p.add_argument("--threads", **THREADS)
    p.add_argument("--lengths", type=positive_ints, default=[256, 1024, 4096], help="context lengths (default: 256,1024,4096)")
    p.add_argument("--window", type=non_negative_int, default=32, help="window radius w (default: 32)")
    p.add_argument("--tokens", type=positive_int, default=16, help="timed tokens per length (default: 16)")
    p.set_defaults(func=_bench("bench_decode"))

    p = sub.add_parser("bench-train", allow_abbrev=False, help="time per training step: graph GPT vs dense twin, interleaved")
    p.add_argument("--threads", **THREADS)
    p.add_argument("--models", nargs="+", default=["graph", "dense"], choices=("graph", "dense", "window") + SELECTIONS,
                   help="what to time: graph / dense (the pattern's graph GPT, its dense twin), window (the graph "
                        "GPT on --window), indexer_topk, block_topk (default: graph dense)")
    p.add_argument("--pattern", default="causal", choices=PATTERNS)
    p.add_argument("--window", type=non_negative_int, default=32)
    p.add_argument("--k-top", type=positive_int, default=64, help="keys per query of indexer_topk and block_topk (k_top // block blocks) (default: 64)")
    p.add_argument("--block", type=positive_int, default=16, help="block_topk: keys per block (default: 16)")
    p.add_argument("--block-size", type=positive_int, default=64)
    p.add_argument("--batch-size", type=positive_int, default=12)
    p.add_argument("--steps", type=positive_int, default=60, help="timed steps per model (default: 60)")
    p.add_argument("--warmup", type=non_negative_int, default=5, help="untimed steps first (default: 5)")
    p.set_defaults(func=_bench("bench_train"))

    p = sub.add_parser("bench-memory", allow_abbrev=False, help="training memory; longest window context in dense memory")
    p.add_argument("--threads", **THREADS)
    p.add_argument("--batch-size", type=positive_int, default=16)
    p.add_argument("--dense-block", type=positive_int, default=64, help="the dense model's context (default: 64)")
    p.add_argument("--window", type=non_negative_int, default=32)
    p.add_argument("--lengths", type=positive_ints, default=[64, 96, 128, 256, 512, 1024])
    p.add_argument("--tokens", type=non_negative_int, default=0, help="keep batch * context at this many tokens (default: off)")
    p.add_argument("--with-dense", action="store_true", help="also measure the dense model at each length")
    p.set_defaults(func=_bench("bench_memory"))


def _add_memory_probe(sub) -> None:
    """The internal command that measures one configuration of bench-memory in a fresh process."""
    p = sub.add_parser("memory-probe", allow_abbrev=False)
    p.add_argument("--threads", **THREADS)
    p.add_argument("--attention", default="graph", choices=("graph", "dense"))  # a fixed pattern's memory
    p.add_argument("--pattern", default="causal", choices=PATTERNS)
    p.add_argument("--window", type=non_negative_int, default=32)
    p.add_argument("--block-size", type=positive_int, default=64)
    p.add_argument("--batch-size", type=positive_int, default=16)
    p.set_defaults(func=_bench("memory_probe"))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="python -m tgattn.lm", description="Character GPT on Tiny Shakespeare.")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", allow_abbrev=False, help="train (or --resume) a GPT; checkpoint in OUT/ckpt.pt")
    train.add_argument("--data", default=None, help="data folder (default: $TGATTN_DATA)")
    train.add_argument("--out", default="out-lm", help="checkpoint folder (default: out-lm)")
    train.add_argument("--resume", action="store_true", help="continue from OUT/ckpt.pt")
    train.add_argument("--log", default=None, help="write LOG.steps.csv, LOG.evals.csv and LOG.json")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.add_argument("--threads", **THREADS)
    _add_fields(train, GPTConfig, skip=("vocab_size",))
    _add_fields(train, TrainConfig)
    train.set_defaults(func=cmd_train)

    p = sub.add_parser("eval", allow_abbrev=False, help="train and validation loss of a checkpoint")
    p.add_argument("--checkpoint", default="out-lm/ckpt.pt")
    p.add_argument("--data", default=None, help="data folder (default: $TGATTN_DATA)")
    p.add_argument("--batch-size", type=positive_int, default=12)
    p.add_argument("--eval-iters", type=positive_int, default=200)
    p.add_argument("--seed", type=seed_int, default=1338, help="seed of the evaluation batches (training uses seed + 1)")
    p.set_defaults(func=cmd_eval)

    sample = sub.add_parser("sample", allow_abbrev=False, help="generate text from a checkpoint")
    sample.add_argument("--checkpoint", default="out-lm/ckpt.pt")
    sample.add_argument("--prompt", default="\n", help="text to continue (characters of the model's vocabulary)")
    sample.add_argument("--num-tokens", type=non_negative_int, default=500)
    sample.add_argument("--temperature", type=positive_float, default=0.8)
    sample.add_argument("--top-k", type=positive_int, default=None)
    sample.add_argument("--seed", type=seed_int, default=1337)
    sample.add_argument("--no-cache", action="store_true", help="recompute the whole context every step")
    sample.set_defaults(func=cmd_sample)

    _add_bench_parsers(sub)
    if argv[:1] == ["memory-probe"]:  # registered only when asked for: no help or error lists it
        _add_memory_probe(sub)
    args = parser.parse_args(argv)
    if args.command == "train":
        try:  # the settings, checked before the corpus is read
            args.model_config, args.train_config = _pick(args, GPTConfig), _pick(args, TrainConfig)
        except ValueError as err:
            train.error(_as_flags(str(err)))
    if args.command == "sample" and not args.prompt:
        sample.error("--prompt must hold at least one character")
    return run(sub.choices[args.command], args.func, args)


if __name__ == "__main__":
    sys.exit(main())
