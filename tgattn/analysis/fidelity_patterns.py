"""The patterns of the sparsity-fidelity study (:mod:`tgattn.analysis.fidelity`), named as on its command line.

A pattern is written ``name:arg:arg`` (``window:32``, ``bigbird:16:2:16``, ``heads:0.9``); this
module parses it without importing torch (``python -m tgattn fidelity --help`` answers at once)
and builds the static ones with :mod:`tgattn.builders` over a batch's lengths.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Tuple

# name: (its arguments, what it keeps). Rows = queries i, columns = keys j; causal models keep j <= i.
SPECS = {
    "full": ((), "the model's own attention: the reference, every edge"),
    "window": (("w",), "keys |i - j| <= w"),
    "dilated": (("w", "r"), "w keys on each side, r apart (builders.dilated)"),
    "block": (("b",), "blocks of b tokens: i // b == j // b"),
    "bigbird": (("w", "g", "r"), "window w, the first g tokens global, r random keys per query (seed 0)"),
    "global": (("g", "w"), "the first g tokens attend to every token and every token to them, plus window w"),
    "sinks": (("s", "w"), "the first s tokens as keys of every query (attention sinks), plus window w"),
    "topk": (("k",), "each layer's k keys with the largest scores per query and head (transformers models)"),
    "heads": (("p",), "heads as graphs: each head's keys holding a share p of its weight in the full forward"),
    "indexer": ((), "the learned indexer's top-k keys (a GPT checkpoint trained with one)"),
}
DEFAULT_PATTERNS = ("window:32", "dilated:16:2", "block:64", "bigbird:16:2:16", "global:2:32", "sinks:4:32",
                    "topk:32", "heads:0.9")


class Pattern(NamedTuple):
    """A parsed pattern: ``label`` as written, ``name``, ``args`` (ints; ``heads``' share ``p`` a float)."""

    label: str
    name: str
    args: Tuple


def parse_pattern(text: str) -> Pattern:
    """``"bigbird:16:2:16"`` -> ``Pattern("bigbird:16:2:16", "bigbird", (16, 2, 16))``; a one-line error otherwise.

    Example:
        >>> parse_pattern("heads:0.9").args, parse_pattern("window:8").args
        ((0.9,), (8,))
        >>> parse_pattern("window")
        Traceback (most recent call last):
        ...
        ValueError: pattern 'window' takes 1 argument (w), as window:w
    """
    name, *parts = text.split(":")
    if name not in SPECS:
        raise ValueError(f"unknown pattern {name!r} in {text!r}; choose from {', '.join(SPECS)}")
    names = SPECS[name][0]
    if len(parts) != len(names):
        form = ":".join([name, *names])
        raise ValueError(f"pattern {name!r} takes {len(names)} argument{'s' * (len(names) != 1)} "
                         f"({', '.join(names) or 'none'}), as {form}")
    try:
        args = tuple(float(p) if name == "heads" else int(p) for p in parts)
    except ValueError:
        raise ValueError(f"pattern {text!r} has an argument that is not a number") from None
    if name == "heads" and not 0 < args[0] <= 1:
        raise ValueError(f"heads:p needs a share p in (0, 1] (got {text!r})")
    if name != "heads" and any(a < (0 if n == "w" else 1) for a, n in zip(args, names)):
        raise ValueError(f"pattern {text!r}: w must be >= 0 and the other arguments >= 1")
    return Pattern(text, name, args)


def builder_of(pattern: Pattern, causal: bool) -> Callable:
    """The builder ``lengths -> edge_index`` of a static pattern (window, dilated, block, bigbird, global, sinks)."""
    import torch

    from .. import builders

    name, args = pattern.name, pattern.args
    if name == "window":
        return lambda n: builders.window(n, args[0], causal=causal)
    if name == "dilated":
        return lambda n: builders.dilated(n, args[0], args[1], causal=causal)
    if name == "block":
        return lambda n: builders.block_local(n, args[0], causal=causal)
    if name == "bigbird":
        return lambda n: builders.bigbird(n, *args, generator=torch.Generator().manual_seed(0), causal=causal)
    if name == "global":
        return lambda n: builders.union(builders.global_tokens(n, list(range(args[0])), causal=causal),
                                        builders.window(n, args[1], causal=causal))
    if name == "sinks":
        return lambda n: builders.union(_sinks(n, args[0], causal), builders.window(n, args[1], causal=causal))
    raise ValueError(f"pattern {pattern.label!r} is not a static pattern")


def _sinks(lengths, s: int, causal: bool):
    """Every query's edges from the first ``s`` tokens of its sequence (Xiao et al., "Efficient Streaming
    Language Models with Attention Sinks", 2023): the key half of :func:`tgattn.builders.global_tokens`."""
    import torch

    from .. import builders

    lengths = [lengths] if isinstance(lengths, int) else list(lengths)
    edge_index = builders.global_tokens(lengths, list(range(min(s, max(lengths)))), causal=causal)
    start = torch.tensor([0, *lengths]).cumsum(0)
    key = edge_index[0]
    position = key - start[torch.bucketize(key, start[1:], right=True)]  # the key's place in its sequence
    return edge_index[:, position < s]
