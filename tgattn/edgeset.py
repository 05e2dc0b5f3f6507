"""Plan once, run many: an edge set validated and analysed once, then shared by every call on it.

``tgattn.prepare(edge_index, num_queries, num_keys)`` returns an immutable :class:`EdgeSet`: the
edges checked once, their sort order, row pointer, duplicates and structure kind found once, and
what is derived from them later (transposed lists, tiles, the conv's split of rows, a self-looped
set) made on first use and kept in it (:meth:`EdgeSet.derived`). Every function and layer that takes
an ``edge_index`` takes an :class:`EdgeSet` as well (:func:`tgattn.functional.graph_attention`,
:class:`~tgattn.GraphAttention`, :class:`~tgattn.GraphAttentionConv`, :class:`~tgattn.GPSConv`,
:class:`~tgattn.ExphormerConv`, the HF backend, :mod:`tgattn.distributed`), and a call on it neither
checks nor looks up its edges again. A plain ``edge_index`` still works: it is prepared on the fly,
through one small cache per tensor whose every hit is checked against the tensor's contents.

PyG's ``EdgeIndex`` converts with its sizes; edges already sorted by (query, key), as the builders
emit them, are not sorted again.

Layer "functional" (docs/conventions.md): the engine holds the analysis
(:mod:`tgattn.engine.edgeset`); this is its public face, re-exported at the package top.

Example:
    >>> import torch, tgattn
    >>> from tgattn import builders
    >>> es = tgattn.prepare(builders.window(6, 1), 6, 6)
    >>> es
    EdgeSet(num_queries=6, num_keys=6, num_edges=16, kind='general')
    >>> q = k = v = torch.randn(6, 2, 4)
    >>> out = tgattn.functional.graph_attention(q, k, v, es)  # no check, no lookup: the set is prepared
    >>> torch.equal(out, tgattn.functional.graph_attention(q, k, v, builders.window(6, 1)))
    True
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

from torch import Tensor
from torch_geometric import EdgeIndex

from .engine.edgeset import EdgeSet, all_pairs_per_graph, edge_set_of, self_looped
from .engine.edgeset import prepare as _prepare
from .engine.validate import check_edge_index

__all__ = ["EdgeSet", "all_pairs_per_graph", "as_edge_set", "checked_edges", "edge_tensor", "num_edges", "prepare", "self_looped"]

Edges = Union[Tensor, EdgeSet]

__all__ += ["prepare_band"]


def prepare(edge_index: Tensor, num_queries: Optional[int] = None, num_keys: Optional[int] = None) -> EdgeSet:
    """Validate and analyse ``edge_index`` once: an :class:`EdgeSet` to pass wherever it would go.

    Args:
        edge_index: ``LongTensor[2, E]`` (row 0 = key/source j, row 1 = query/target i, any order),
            or PyG's ``EdgeIndex`` (its ``sparse_size`` gives the counts left out).
        num_queries: query (target) nodes; may be left out for an ``EdgeIndex`` of known size.
        num_keys: key (source) nodes; likewise.

    Raises:
        TypeError, ValueError: naming the bad argument (shape, dtype, a node id out of range, a
            count missing or disagreeing with the ``EdgeIndex``'s).

    Example:
        >>> import torch
        >>> from torch_geometric import EdgeIndex
        >>> ei = EdgeIndex(torch.tensor([[0, 1, 1], [0, 0, 1]]), sparse_size=(2, 2), sort_order="col")
        >>> es = prepare(ei)  # the sizes from the EdgeIndex; sorted already: no permutation
        >>> es.num_queries, es.num_keys, es.structure.perm is None
        (2, 2, True)
    """
    if isinstance(edge_index, EdgeIndex):
        sizes = {"num_queries": (num_queries, edge_index.num_cols), "num_keys": (num_keys, edge_index.num_rows)}
        for name, (given, known) in sizes.items():
            if given is not None and known is not None and given != known:
                raise ValueError(f"{name}={given} disagrees with the EdgeIndex's sparse size ({known})")
        num_queries, num_keys = (given if given is not None else known for given, known in sizes.values())
        edge_index = edge_index.as_tensor()
    for name, count in (("num_queries", num_queries), ("num_keys", num_keys)):
        if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count < 2**63:
            raise ValueError(f"{name} must be a node count, an int in [0, 2**63) (got {count!r})")  # node ids are int64
    return _prepare(edge_index, num_queries, num_keys)


def prepare_band(num_queries: int, num_keys: Optional[int] = None, *, lo: Optional[int] = None,
                 hi: Optional[int] = None, lengths: Optional[Sequence[int]] = None, device=None) -> EdgeSet:
    """The prepared set of query ``i`` attending to keys ``i + lo .. i + hi`` (``None``: no bound),
    clipped to the keys, or to ``i``'s document when ``lengths`` packs documents (rows = queries i,
    columns = keys j), made without an edge list: what :func:`prepare` makes of the builders' edges
    (``builders.full``, ``causal``, ``window``, ``block_local``; ``hi=0`` is causal, ``lo=-w, hi=w``
    a window of radius w), in O(n) memory where the list holds E edges (causal at 65,536 tokens:
    2.1 billion, 34 GB). The ``tc`` backend plans its tiles from the rows' ranges and SDPA runs the
    full / causal kinds; only the gather kernels make the sorted edges (on first use, kept).

    Raises:
        ValueError: a bad count, or ``lengths`` that do not sum to the tokens.

    Example:
        >>> import torch
        >>> from tgattn import builders
        >>> es = prepare_band(8, hi=0, lengths=[3, 5])  # packed causal documents
        >>> es.kind, torch.equal(es.edge_index, builders.causal([3, 5]))
        ('packed_causal', True)
        >>> prepare_band(6, lo=-2, hi=2).num_edges == builders.window(6, 2).shape[1]
        True
    """
    from .engine.bands import Band
    from .engine.edgeset import prepare_band as _prepare_band

    lengths = None if lengths is None else tuple(int(n) for n in lengths)
    return _prepare_band(Band(lo, hi, lengths), num_queries, num_queries if num_keys is None else num_keys, device)


def as_edge_set(edges: Edges, num_queries: int, num_keys: int) -> EdgeSet:
    """``edges`` as an :class:`EdgeSet`: a prepared one as it is (its node counts checked), a tensor
    prepared on the fly (once per tensor: later calls find it in the cache, checked by contents).

    Example:
        >>> import torch
        >>> as_edge_set(torch.tensor([[0, 1], [1, 0]]), 2, 2).num_edges
        2
    """
    return edge_set_of(edges, num_queries, num_keys)


def num_edges(edges: Edges) -> int:
    """E of an ``edge_index [2, E]`` or an :class:`EdgeSet`, without a pass over the edges."""
    return edges.num_edges if isinstance(edges, EdgeSet) else edges.shape[1]


def edge_tensor(edges: Edges) -> Tensor:
    """The ``[2, E]`` tensor of ``edges``, in the order they were given."""
    return edges.edge_index if isinstance(edges, EdgeSet) else edges


def checked_edges(edges: Edges, num_queries: int, num_keys: int) -> Tensor:
    """The ``LongTensor[2, E]`` of ``edges`` for these node counts: a prepared set's (its counts
    checked, its edges not again), a tensor validated (:func:`tgattn.functional.check_edge_index`).

    Example:
        >>> import torch
        >>> checked_edges(torch.tensor([[0, 1], [1, 0]]), 2, 2).tolist()
        [[0, 1], [1, 0]]
    """
    if isinstance(edges, EdgeSet):
        return edges.check_sizes(num_queries, num_keys).edge_index
    return check_edge_index(edges, num_keys, num_queries)
