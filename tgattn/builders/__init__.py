"""Attention patterns as edge sets.

Every builder returns ``LongTensor[2, E]`` sorted by (target, source), without duplicates:
``edge_index[0]`` = key j, ``edge_index[1]`` = query i (rows = queries i, columns = keys j
in the dense twin ``to_mask``). Each accepts a length ``n`` or the lengths of a packed batch.

Layer "builders": above :mod:`tgattn.functional` (scored builders attend to choose), below the
layers (docs/conventions.md).
"""
from .bigbird import bigbird, random
from .combine import add_self_loops, difference, intersection, membership, union
from .cross import cross, cross_window
from .dense import causal, full
from .expander import expander, exphormer, virtual_nodes
from .graphs import from_networkx
from .informer import ProbSparsePattern, probsparse
from .learned import block_topk, indexer_topk
from .local import block_local, dilated
from .longformer import global_tokens
from .mask import draw, from_mask, to_mask
from .prefix import prefix_lm
from .scored import HeadPattern, head_masks, topk
from .sparse_transformer import fixed, strided
from .structure import Degrees, degree, density, receptive_field, receptive_field_growth
from .window import window

__all__ = [
    "Degrees",
    "HeadPattern",
    "ProbSparsePattern",
    "add_self_loops",
    "bigbird",
    "block_local",
    "block_topk",
    "causal",
    "cross",
    "cross_window",
    "degree",
    "density",
    "difference",
    "dilated",
    "draw",
    "expander",
    "exphormer",
    "fixed",
    "from_mask",
    "from_networkx",
    "full",
    "global_tokens",
    "head_masks",
    "indexer_topk",
    "intersection",
    "membership",
    "prefix_lm",
    "probsparse",
    "random",
    "receptive_field",
    "receptive_field_growth",
    "strided",
    "to_mask",
    "topk",
    "union",
    "virtual_nodes",
    "window",
]
