"""Attention patterns as edge sets.

Every builder returns ``LongTensor[2, E]`` sorted by (target, source), without duplicates:
``edge_index[0]`` = key j, ``edge_index[1]`` = query i (rows = queries i, columns = keys j
in the dense twin ``to_mask``). Each accepts a length ``n`` or the lengths of a packed batch.
"""
from .dense import causal, full
from .mask import draw, from_mask, to_mask
from .window import window

__all__ = ["causal", "draw", "from_mask", "full", "to_mask", "window"]
