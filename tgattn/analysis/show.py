"""``python -m tgattn show``: draw who influences whom in a text.

Without ``--checkpoint`` the attention comes from seeded random projections (a stack of
:class:`tgattn.GraphAttention` layers over word embeddings); with one, from a trained tiny
GPT (:mod:`tgattn.models`): characters are its tokens and the model's own edge sets are used.
With ``--hf`` it comes from a transformers model (:mod:`tgattn.hf`): a local model folder
with its tokenizer (a decoder, or an encoder such as BERT: attention both ways, its ``[CLS]``
and ``[SEP]`` tokens drawn as tokens), ``all-MiniLM-L6-v2`` for the real model of the
``tgattn[models]`` extra, or ``random`` for a tiny seeded Llama over the words of ``--text``. ``--text-file PATH`` reads the text from a file.
With ``--html PAGE`` it writes an interactive page (:mod:`tgattn.analysis.page`) instead of
the picture: hover a token to see what it attends to and what influences it. ``--json FILE``
writes what the page shows as data (:mod:`tgattn.analysis.export`), and ``--from FILE`` makes
the page from such a file, on another machine.

Arguments are parsed and checked before torch is imported (``python -m tgattn.analysis.show
--help`` answers at once); the work imports it.
"""
from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, List, Tuple

from .._cli import missing_plot_extra, non_negative_int, positive_float, positive_int, run, seed_int
from .budget import DIM, MAX_BYTES, THRESHOLD, TOP_K, estimate_bytes, estimate_memory
from .labels import TITLE_CHARS, fit

if TYPE_CHECKING:
    from .weights import Layer

PATTERNS = ("full", "causal", "window", "causal_window")
MAX_MEMORY_GB = 8  # the default memory budget of the page data from random layers
HUB_ID = re.compile(r"[\w-][\w.-]*(/[\w-][\w.-]*)?")  # 'name' or 'owner/name': a model in the Hugging Face cache


def pattern_edges(pattern: str, n: int, *, window: int = 2):
    """The edge set named by ``--pattern`` for ``n`` tokens."""
    from .. import builders

    if pattern == "full":
        return builders.full(n)
    if pattern == "causal":
        return builders.causal(n)
    if pattern == "window":
        return builders.window(n, window)
    if pattern == "causal_window":
        return builders.window(n, window, causal=True)
    raise ValueError(f"pattern must be one of {PATTERNS} (got {pattern!r})")


def checkpoint_attention(path: str, text: str) -> Tuple[List[str], List["Layer"]]:
    """Characters of ``text`` and the attention of the tiny GPT saved at ``path``.

    The checkpoint is a ``torch.save`` dict with ``"model"`` (state dict), ``"config"``
    (the fields of :class:`tgattn.models.GPTConfig`) and ``"vocab"`` (its characters in id
    order), read and verified by :func:`tgattn.lm.load_checkpoint`;
    ``GPT.forward(idx, return_attention=True)`` returns a tuple whose last item is the
    attention, a list over layers of ``(edge_index, alpha [E, H])``.
    """
    import torch

    from ..lm.checkpoint import load_checkpoint, model_from_checkpoint

    checkpoint = load_checkpoint(path)
    vocab = checkpoint["vocab"]
    unknown = sorted(set(text) - set(vocab))
    if unknown:
        raise ValueError(f"characters {unknown} of --text are not in the checkpoint's vocabulary")
    model = model_from_checkpoint(checkpoint, path)  # its config checked against the weights
    idx = torch.tensor([[vocab.index(c) for c in text]], dtype=torch.long)  # [1, T]
    with torch.no_grad():
        attention = model(idx, return_attention=True)[-1]
    return list(text), [(ei, alpha) for ei, alpha in attention]


def threshold(text: str) -> float:
    """``--threshold``: a weight in [0, 1)."""
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1) (got {text!r})")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``python -m tgattn show``."""
    text = parser.add_mutually_exclusive_group()
    text.add_argument("--text", default="The sky is blue", help="the text (words; characters with --checkpoint)")
    text.add_argument("--text-file", metavar="PATH", help="read the text from this file (UTF-8) instead of --text")
    parser.add_argument("--pattern", default="causal", choices=PATTERNS, help="edge set (default: causal)")
    parser.add_argument("--window", type=non_negative_int, default=2, help="radius w of the window patterns (default: 2)")
    parser.add_argument("--layers", type=positive_int, default=2, help="random layers (default: 2)")
    parser.add_argument("--heads", type=positive_int, default=2, help=f"heads per random layer, dividing {DIM} (default: 2)")
    parser.add_argument("--seed", type=seed_int, default=0, help="seed of the random projections (default: 0)")
    parser.add_argument("--query", type=int, default=-1, help="token whose influencers are ranked (default: last)")
    parser.add_argument("--top-k", type=positive_int, default=5, help="influencers to show (default: 5)")
    parser.add_argument("--checkpoint", help="tiny GPT checkpoint (tgattn.models); --pattern is then the model's own")
    parser.add_argument("--hf", metavar="PATH", help="a transformers model folder with its tokenizer (an encoder such as "
                                                     "BERT, or a decoder), 'all-MiniLM-L6-v2' (the model of tgattn[models]), "
                                                     "or 'random' (needs tgattn[hf])")
    parser.add_argument("--out", default="attn.png", help="picture to write (default: attn.png)")
    parser.add_argument("--html", metavar="PAGE", help="write an interactive HTML page to PAGE instead of the picture "
                                                       "(one file, opens offline; no matplotlib needed)")
    parser.add_argument("--json", metavar="FILE", help="write what the page shows (kept edges, rollout, flow) to FILE "
                                                       "as JSON, instead of the picture")
    parser.add_argument("--from", dest="source", metavar="FILE", help="make the --html page from a file that --json "
                                                                      "wrote, instead of computing attention")
    parser.add_argument("--keep", type=positive_int, default=TOP_K,
                        help=f"page / --json: keys kept per token, layer and head (default: {TOP_K})")
    parser.add_argument("--threshold", type=threshold, default=THRESHOLD,
                        help=f"page / --json: weights below are pruned (default: {THRESHOLD})")
    parser.add_argument("--max-page-mb", type=positive_float, default=MAX_BYTES / 1e6,
                        help=f"refuse to write a page larger than this (default: {MAX_BYTES / 1e6:.0f})")
    parser.add_argument("--max-memory-gb", type=positive_float, default=MAX_MEMORY_GB,
                        help="page / --json from random layers: refuse when the estimated peak memory is larger "
                             f"(default: {MAX_MEMORY_GB})")


def read_text_file(path: str) -> str:
    """``--text-file``: the file's text, whole (a character model's newlines included)."""
    if not Path(path).is_file():
        raise ValueError(f"--text-file: no file at {path}")
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"--text-file: {path} is not UTF-8 text ({err.reason} at byte {err.start})") from None


def check(args: argparse.Namespace) -> List[str]:
    """The settings checked before any work (no torch): the tokens of ``--text`` (``[]`` for ``--hf``).

    ``--text-file`` is read here, into ``args.text``.

    Raises:
        ValueError: for options that do not fit together, or a page over its budget.
    """
    for target, option in ((args.html, "--html"), (args.json, "--json"),
                           (None if args.html or args.json else args.out, "--out")):
        if target is not None and not Path(target).parent.is_dir():
            raise ValueError(f"{option}: the folder {str(Path(target).parent)!r} does not exist")
    if args.source is not None:
        if not args.html:
            raise ValueError("--from makes a page: give --html PAGE (the file holds the page's pruned data, "
                             "not the full attention a picture needs)")
        if not Path(args.source).is_file():
            raise ValueError(f"--from: no file at {args.source}")
        return []
    if not (args.html or args.json) and missing_plot_extra():
        raise ValueError(missing_plot_extra())
    if args.text_file is not None:
        args.text = read_text_file(args.text_file)
    if args.hf:
        if importlib.util.find_spec("transformers") is None:
            raise ValueError('--hf runs a transformers model, and transformers is not installed: pip install "tgattn[hf]"')
        if args.hf != "random" and not Path(args.hf).is_dir() and not HUB_ID.fullmatch(args.hf):
            raise ValueError(f"no model folder at {args.hf}")
        return []
    tokens = list(args.text) if args.checkpoint else args.text.split()
    if not tokens:
        raise ValueError("--text is empty")
    if not -len(tokens) <= args.query < len(tokens):
        raise ValueError(f"--query must be a token index in [0, {len(tokens)}) (got {args.query})")
    if not args.checkpoint and DIM % args.heads:
        raise ValueError(f"--heads must divide the random layers' width {DIM} (got {args.heads})")
    if args.html and not args.checkpoint:
        size = estimate_bytes(len(tokens), args.layers, args.heads, args.keep)
        if size > args.max_page_mb * 1e6:
            raise ValueError(f"the page would take about {size / 1e6:.0f} MB ({len(tokens)} tokens, {args.layers} layers x "
                             f"{args.heads} heads, --keep {args.keep}), more than --max-page-mb {args.max_page_mb:g}: "
                             "keep fewer keys per token or raise the budget")
    if (args.html or args.json) and not args.checkpoint:
        memory = estimate_memory(len(tokens), args.layers, args.heads, args.keep, args.pattern, args.window)
        if memory > args.max_memory_gb * 1e9:
            raise ValueError(f"the page data would take about {memory / 1e9:.1f} GB of memory at its peak ({len(tokens)} "
                             f"tokens, {args.pattern} pattern, {args.layers} layers: the rollout's band), more than "
                             f"--max-memory-gb {args.max_memory_gb:g}: use fewer tokens or a window pattern, or raise it")
    return tokens


def main(args: argparse.Namespace) -> int:
    """Run ``show`` with parsed arguments: write the picture (or page, or data), print the top influencers.

    Raises:
        ValueError: for options that do not fit together, before any work.
    """
    tokens = check(args)
    if args.source is not None:
        return _page_from_file(args)
    if args.hf:
        from ..hf.analysis import cli_attention

        tokens, attention, source = cli_attention(args)
    elif args.checkpoint:
        tokens, attention = checkpoint_attention(args.checkpoint, args.text)
        tokens = [t.replace(" ", "\u2423") for t in tokens]  # a character model's spaces, drawn visibly
        heads = attention[0][1].shape[1] if attention[0][1].dim() == 2 else 1
        # the file's name, not its folder (often a temporary one)
        source = f"tiny GPT {Path(args.checkpoint).name}, {len(attention)} layers x {heads} heads"
    else:
        attention = None  # made below: streamed for a page, whole for the picture
        source = f"{args.pattern} pattern, {args.layers} random layers x {args.heads} heads, seed {args.seed}"
    query = args.query % len(tokens)
    title = f"{fit(args.text, max(TITLE_CHARS - len(source) - 20, 16))!r} ({len(tokens)} tokens): {source}"
    if args.html or args.json:
        from .export import influence_data, save_influence
        from .page import page_from_data

        keep = dict(query=query, title=title, top_k=args.keep, threshold=args.threshold, progress=True)
        data = influence_data(tokens, attention, **keep) if attention is not None else _streamed_data(tokens, args, keep)
        if args.json:
            save_influence(data, args.json)
            print(f"wrote {args.json} (python -m tgattn show --from {args.json} --html PAGE makes its page)")
        if args.html:
            Path(args.html).write_text(page_from_data(data, max_bytes=int(args.max_page_mb * 1e6)), encoding="utf-8")
            print(f"wrote {args.html} (open it in a browser)")
        return 0
    from .figure import rank, show_figure

    if attention is None:
        from .random_layers import random_attention

        attention = random_attention(tokens, pattern_edges(args.pattern, len(tokens), window=args.window),
                                     layers=args.layers, heads=args.heads, seed=args.seed)
    ranked = rank(attention, query, args.top_k, len(tokens))
    fig = show_figure(tokens, attention, ranked, query=query, title=title)
    fig.savefig(args.out, dpi=110)
    for method, (index, score) in ranked.items():
        pairs = ", ".join(f"{tokens[j]!r} {s:.3f}" for j, s in zip(index.tolist(), score.tolist()))
        print(f"{method} into {tokens[query]!r}: {pairs}")
    print(f"wrote {args.out}")
    return 0


def _streamed_data(tokens: List[str], args: argparse.Namespace, keep: dict) -> dict:
    """The page data of the random layers, made block by block (memory follows what is kept)."""
    from .budget import key_ranges
    from .random_layers import random_attention_blocks
    from .streamed import streamed_influence_data

    blocks = random_attention_blocks(tokens, args.pattern, window=args.window, layers=args.layers, heads=args.heads,
                                     seed=args.seed)
    return streamed_influence_data(tokens, blocks, heads=[args.heads] * args.layers,
                                   key_ranges=key_ranges(args.pattern, len(tokens), args.window), **keep)


def _page_from_file(args: argparse.Namespace) -> int:
    from .export import load_influence
    from .page import page_from_data

    data = load_influence(args.source, max_bytes=int(args.max_page_mb * 1e6))  # every field checked
    Path(args.html).write_text(page_from_data(data, max_bytes=int(args.max_page_mb * 1e6)), encoding="utf-8")
    print(f"wrote {args.html} from {args.source} (open it in a browser)")
    return 0


def cli(argv=None) -> int:
    """``python -m tgattn.analysis.show [options]``: the same as ``python -m tgattn show``."""
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="python -m tgattn.analysis.show", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser, main, parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(cli())
