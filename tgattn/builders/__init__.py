"""Attention patterns as edge sets.

Every builder returns ``LongTensor[2, E]`` sorted by (target, source), without duplicates:
``edge_index[0]`` = key j, ``edge_index[1]`` = query i (rows = queries i, columns = keys j
in the dense twin ``to_mask``). Each accepts a length ``n`` or the lengths of a packed batch.
"""
from .bigbird import bigbird, random
from .combine import add_self_loops, difference, intersection, union
from .dense import causal, full
from .longformer import global_tokens
from .mask import draw, from_mask, to_mask
from .window import window

__all__ = [
    "add_self_loops",
    "bigbird",
    "causal",
    "difference",
    "draw",
    "from_mask",
    "full",
    "global_tokens",
    "intersection",
    "random",
    "to_mask",
    "union",
    "window",
]
