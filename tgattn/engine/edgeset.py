"""A prepared edge set: validated once, analysed once, then handed to every call that attends along it.

:func:`prepare` validates an ``edge_index`` and analyses it (:func:`~tgattn.engine.analysis.analyse`:
sort order, row pointer, duplicates, structure kind) and returns an immutable :class:`EdgeSet`; the
engine runs on it without checking or looking anything up again. What is derived from it later
(transposed lists, tiles, the conv's split of rows, a self-looped set, the tile plan of the
tensor-core engine) is made on first use and kept in it (:meth:`EdgeSet.derived`).

A plain ``edge_index`` tensor is prepared on the fly by :func:`edge_set_of`, through the one cache
of the engine (:data:`~tgattn.engine.analysis.CACHE`: small, bounded, thread-safe, every hit
checked against the tensor's contents, or its version counter on a GPU): a convenience for
callers that do not prepare, never the place where correctness is decided.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Callable, Hashable, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from . import native
from .analysis import CACHE, Structure, analyse, counting_sort, device_stamp, on_host
from .device_analysis import analyse_on_device
from .validate import check_edge_index, check_ranges
from .bands import Band, BandStructure, band_structure


class EdgeSet:
    """An analysed edge set (:func:`prepare`): immutable, accepted wherever ``edge_index`` is.

    It holds no reference to the tensor it was prepared from (a later in-place write there does not
    reach it): :func:`prepare` keeps a copy of the edges in the given order (:attr:`edge_index`, what a
    compiled graph takes: made before, so that tracing reads it without a lock), and a set the cache
    prepares for a plain tensor rebuilds them from its sorted form when asked. Tensors it hands out
    must not be written to; :attr:`edge_index` sees a write and hands out the prepared edges again.

    Example:
        >>> from tgattn import builders
        >>> es = prepare(builders.causal(4), 4, 4)
        >>> es
        EdgeSet(num_queries=4, num_keys=4, num_edges=10, kind='causal')
        >>> es.num_edges = 3
        Traceback (most recent call last):
        ...
        AttributeError: EdgeSet is immutable (cannot set 'num_edges')
    """

    __slots__ = ("_structure",)

    def __init__(self, structure: Structure):
        object.__setattr__(self, "_structure", structure)

    def __setattr__(self, name, value):
        raise AttributeError(f"EdgeSet is immutable (cannot set {name!r})")

    def __delattr__(self, name):
        raise AttributeError(f"EdgeSet is immutable (cannot delete {name!r})")

    def __reduce__(self):  # pickled (DataLoader workers, torch.save) as what it is prepared from
        s = self._structure
        if isinstance(s, BandStructure):  # its band, not edges it may never have made
            return prepare_band, (s.band, s.n_q, s.n_k)
        return prepare, (self.edge_index, self.num_queries, self.num_keys)

    @property
    def structure(self) -> Structure:
        """The engine's analysis (sorted edges ``src`` / ``dst``, ``perm``, ``rowptr``, ``kind`` ...)."""
        return self._structure

    @property
    def num_queries(self) -> int:
        return self._structure.n_q

    @property
    def num_keys(self) -> int:
        return self._structure.n_k

    @property
    def num_edges(self) -> int:
        return self._structure.num_edges

    @property
    def kind(self) -> str:
        """``"full"``, ``"causal"``, ``"packed_full"``, ``"packed_causal"`` or ``"general"``."""
        return self._structure.kind

    @property
    def duplicates(self) -> bool:
        return self._structure.duplicates

    @property
    def device(self) -> torch.device:
        return self._structure.rowptr.device  # (a set known by its shape makes its src on first read)

    @property
    def edge_index(self) -> Tensor:
        """``LongTensor[2, E]`` in the order the edges were given (made once, on first use).

        The set's own tensor, handed out without a copy (a copy per access cost a pass over the
        edges on every call of a layer). Written in place, it no longer belongs to the set: its
        version counter shows the write, and the next access warns and hands out the edges as
        prepared, made again from the analysis, so the set never disagrees with itself. (A write
        that bypasses the version counter, through ``.numpy()`` or ``.data``, goes unseen.)

        Example:
            >>> ei = torch.tensor([[1, 0, 2], [2, 2, 0]])
            >>> es = prepare(ei, 3, 3)
            >>> torch.equal(es.edge_index, ei)
            True
            >>> es.edge_index[0, 0] = 7  # not the set's edges any more
            >>> with warnings.catch_warnings(record=True) as seen:
            ...     warnings.simplefilter("always")
            ...     es.edge_index.tolist()
            [[1, 0, 2], [2, 2, 0]]
            >>> str(seen[0].message)
            "an EdgeSet's edge_index was written to in place: the set keeps the edges it was prepared with (prepare the new edges to attend along them)"
        """
        edges, version = self.derived("edge_index", lambda: _stamped(self._given_order()))
        if torch.compiler.is_compiling() or edges._version == version:  # a compiled graph cannot branch on it
            return edges
        with self._structure.lock:
            edges, version = self._structure.extras["edge_index"]
            if edges._version != version:
                warnings.warn("an EdgeSet's edge_index was written to in place: the set keeps the edges it was "
                              "prepared with (prepare the new edges to attend along them)", stacklevel=2)
                edges, version = _stamped(self._given_order())
                self._structure.extras["edge_index"] = (edges, version)
        return edges

    def _given_order(self) -> Tensor:
        s = self._structure
        edges = torch.stack([s.src.long(), s.dst.long()])  # [2, E] sorted
        return edges if s.perm is None else torch.empty_like(edges).index_copy_(1, s.perm, edges)

    def derived(self, key: Hashable, make: Callable[[], object]):
        """``make()``, made once per edge set and ``key``, then kept: the place for data derived from
        the edges alone (a transposed list, a tile plan per dtype and block size, the conv's split of
        rows). Thread-safe: concurrent first calls make it once. ``key`` must name everything the
        value depends on besides the edges (a dtype, block sizes); the device is the set's own.

        Example:
            >>> es = prepare(torch.tensor([[0, 1], [1, 0]]), 2, 2)
            >>> degrees = es.derived("in_degree", lambda: torch.bincount(es.structure.dst, minlength=2))
            >>> degrees.tolist(), es.derived("in_degree", lambda: None) is degrees
            ([1, 1], True)
        """
        return self._structure.memo(key, make)

    def tile_plan(self, dtype: torch.dtype = torch.bfloat16, head_dim: int = 64, *, group: int = 1):
        """The tensor-core tile plan (:class:`~tgattn.engine.triton.tile_plan.TilePlan`) that
        ``backend="tc"`` runs for inputs of ``dtype`` and ``head_dim`` with ``group`` query heads a
        key/value head: made once per set and shape, kept in the set (:meth:`derived`), and the very
        object the backend uses, so a prepared set is planned once however many calls run on it.

        Example:
            >>> n = 256  # a window of radius 16: its tiles are dense enough for tensor cores
            >>> rows = torch.arange(n).repeat_interleave(33); cols = rows + torch.arange(-16, 17).repeat(n)
            >>> keep = (cols >= 0) & (cols < n)
            >>> es = prepare(torch.stack([cols[keep], rows[keep]]), n, n)
            >>> plan = es.tile_plan(torch.bfloat16, 64)
            >>> (plan.block_m, plan.block_n), plan.tc_share, es.tile_plan(torch.bfloat16, 64) is plan
            ((64, 64), 1.0, True)

        There is none for the calls ``tc`` runs wholly on its gather kernels: float32 and float64
        inputs (``tl.dot`` in IEEE precision is no tensor-core work) and a ``group`` that is not a
        power of two. Those, and arguments of other types, raise ``ValueError`` naming the value:

            >>> es.tile_plan(torch.float64)
            Traceback (most recent call last):
            ...
            ValueError: dtype torch.float64 has no tile plan: backend='tc' runs float32 and float64 inputs wholly on its gather kernels (tiles: torch.float16, torch.bfloat16)
        """
        from .triton.tc import plan_for_inputs
        from .triton.tile_plan import TILE_DTYPES

        tiles = ", ".join(map(str, TILE_DTYPES))
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"dtype must be {' or '.join(map(str, TILE_DTYPES))}, the tiles' dtypes (got {dtype!r})")
        if dtype not in TILE_DTYPES:
            raise ValueError(f"dtype {dtype} has no tile plan: backend='tc' runs float32 and float64 inputs wholly on "
                             f"its gather kernels (tiles: {tiles})")
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or not 1 <= head_dim <= 128:
            raise ValueError(f"head_dim must be an integer from 1 to 128 (got {head_dim!r})")
        if isinstance(group, bool) or not isinstance(group, int) or group < 1 or group & (group - 1):
            raise ValueError(f"group must be a power of two >= 1, the query heads a key head serves (got {group!r}): "
                             "backend='tc' runs other groups wholly on its gather kernels")
        return plan_for_inputs(self._structure, dtype, head_dim, group)[0]

    def to(self, device: Union[str, torch.device]) -> "EdgeSet":
        """This edge set on ``device``: ``self`` where it is already, else its analysis moved (made once
        per device and kept, :meth:`derived`), so that a set prepared on the CPU (in a data loader's
        worker) serves the GPU without being analysed again.

        Example:
            >>> es = prepare(torch.tensor([[0, 1], [1, 0]]), 2, 2)
            >>> es.to("cpu") is es, es.to("meta").device.type, es.to("meta") is es.to("meta")
            (True, 'meta', True)
        """
        device = torch.device(device)
        if device == self.device:
            return self
        return self.derived(("device", device), lambda: EdgeSet(_moved(self._structure, device)))

    def check_sizes(self, num_queries: int, num_keys: int, device: Optional[torch.device] = None) -> "EdgeSet":
        """``self``, after checking that it was prepared for these node counts (and, given one, that it
        lies on ``device``): no pass over the edges.

        Raises:
            ValueError: naming both counts, or both devices.
        """
        s = self._structure
        if (s.n_q, s.n_k) != (num_queries, num_keys):
            raise ValueError(f"the edge set was prepared for {s.n_q} query and {s.n_k} key nodes, "
                             f"but the call has {num_queries} queries and {num_keys} keys")
        if device is not None and device != self.device:
            raise ValueError(f"the edge set is on {self.device}, the queries on {device} (edge_set.to(device) moves it)")
        return self

    def __repr__(self) -> str:
        return (f"EdgeSet(num_queries={self.num_queries}, num_keys={self.num_keys}, num_edges={self.num_edges}, "
                f"kind={self.kind!r})")


def _stamped(edges: Tensor) -> Tuple[Tensor, int]:
    """``edges`` with its version counter now: what :attr:`EdgeSet.edge_index` keeps, to see a write."""
    return edges, edges._version


def _moved(s: Structure, device: torch.device) -> Structure:
    """``s`` with its tensors on ``device``; what is derived is made again there, on first use (a set
    known by its shape is made there from its band, its edges still not made)."""
    if isinstance(s, BandStructure):
        return band_structure(s.band, s.n_q, s.n_k, device)
    tensors = {name: None if getattr(s, name) is None else getattr(s, name).to(device)
               for name in ("perm", "src", "dst", "rowptr")}
    return dataclasses.replace(s, **tensors, extras={})


def analysed(edge_index: Tensor, num_queries: int, num_keys: int) -> Structure:
    """The :class:`~tgattn.engine.analysis.Structure` of a never-seen ``edge_index``, validated: the one
    place edges are checked. The extension's counting sort checks every node id in its first pass, so
    the ranges are checked by a pass of their own only where it does not run; on a device (CUDA) the
    analysis checks them too, and reads back once (:func:`~tgattn.engine.device_analysis.analyse_on_device`).

    Raises:
        TypeError, ValueError: naming the bad type, shape, dtype or node id.
    """
    checked = check_edge_index(edge_index, num_keys, num_queries, ranges=False)
    if not on_host(checked):  # a GPU: the ids checked within the analysis's one read back
        with torch.no_grad():
            return analyse_on_device(checked, num_queries, num_keys)
    by_extension = counting_sort(checked, num_queries, num_keys)
    if not by_extension:
        check_ranges(checked, num_keys, num_queries)
    try:
        with torch.no_grad():
            return analyse(checked, num_queries, num_keys)
    except RuntimeError:
        if by_extension:
            check_ranges(checked, num_keys, num_queries)  # raises, naming the node
        raise


def prepare(edge_index: Tensor, num_queries: int, num_keys: int) -> EdgeSet:
    """Validate and analyse ``edge_index`` (``[2, E]``, row 0 = key j, row 1 = query i) once.

    The caller keeps the :class:`EdgeSet`, which keeps a copy of the edges (the caller may reuse its
    tensor). Edges already sorted by (query, key) are not sorted again (``structure.perm`` is None).
    The copy is what a compiled graph hands the custom op (:mod:`tgattn.engine.custom_op`, which takes
    tensors): the engine's cache knows it with this analysis, as long as the set lives, so that a
    compiled step over a new prepared set analyses it once, not twice.

    Example:
        >>> es = prepare(torch.tensor([[0, 0, 1], [0, 1, 1]]), 2, 2)
        >>> es.kind, structure_of(es.edge_index, 2, 2) is es.structure
        ('causal', True)
    """
    made = EdgeSet(analysed(edge_index, num_queries, num_keys))  # (validated: a tensor [2, E] of integers)
    copy = edge_index.detach().to(torch.long, copy=True)
    made.derived("edge_index", lambda: _stamped(copy))
    CACHE.put(copy, num_queries, num_keys, made.structure)
    return made


def prepare_band(band: Band, num_queries: int, num_keys: int, device=None) -> EdgeSet:
    """The :class:`EdgeSet` of the edges :class:`~tgattn.engine.bands.Band` states (full, causal, a
    window, packed documents), prepared without an edge list: its analysis from the band in O(n)
    (:func:`~tgattn.engine.bands.band_structure`), its tile plan from the rows' key ranges, its sorted
    edges and :attr:`~EdgeSet.edge_index` made only if a call reads them (the ``tc`` backend's
    tiles, SDPA on a full / causal set and the analysis never do).

    Example:
        >>> from tgattn.engine.bands import Band
        >>> es = prepare_band(Band(lo=-1, hi=1), 5, 5)  # a window of radius 1
        >>> es, es.edge_index[:, :4].tolist()
        (EdgeSet(num_queries=5, num_keys=5, num_edges=13, kind='general'), [[0, 1, 0, 1], [0, 0, 1, 1]])
    """
    return EdgeSet(band_structure(band, num_queries, num_keys, device))


def structure_of(edge_index: Tensor, n_q: int, n_k: int) -> Structure:
    """The cached :class:`~tgattn.engine.analysis.Structure` of a plain ``edge_index``, validated and
    analysed (:func:`analysed`) on first use.

    A hit is checked against the tensor's current contents
    (:func:`~tgattn.engine.analysis.same_edges`), so an edge set changed in place, by any route, is
    validated and analysed again; on a GPU against its :func:`~tgattn.engine.analysis.device_stamp`
    instead (no host sync: an in-place write through PyTorch is seen, one through DLPack or ``.data``
    is not).

    Raises:
        ValueError: when ``edge_index`` is malformed or refers to nodes outside ``n_k`` / ``n_q``.

    Example:
        >>> from tgattn import builders
        >>> ei = builders.full(8)
        >>> structure_of(ei, 8, 8) is structure_of(ei, 8, 8)
        True
    """
    s = CACHE.get(edge_index, n_q, n_k)
    if s is None:
        s = analysed(edge_index, n_q, n_k)
        CACHE.put(edge_index, n_q, n_k, s)
    return s


def edge_set_of(edges, num_queries: int, num_keys: int) -> EdgeSet:
    """``edges`` as an :class:`EdgeSet`: a prepared one as it is (its sizes checked), a tensor prepared
    on the fly through the engine's cache (:func:`~tgattn.engine.analysis.structure_of`).

    Example:
        >>> ei = torch.tensor([[0, 1], [1, 0]])
        >>> edge_set_of(ei, 2, 2).structure is edge_set_of(ei, 2, 2).structure  # cached per tensor
        True
    """
    if isinstance(edges, EdgeSet):
        return edges.check_sizes(num_queries, num_keys)
    return EdgeSet(structure_of(edges, num_queries, num_keys))


def self_looped(edges, num_nodes: int) -> EdgeSet:
    """``edges`` without their self-loops, then one loop ``(i, i)`` per node, prepared: made once per
    prepared set (:meth:`EdgeSet.derived`), or once per tensor through the engine's cache, whose hit is
    checked against the tensor's contents (on a GPU its version counter), so that the layers of a
    model share one looped set and its analysis.

    Example:
        >>> self_looped(torch.tensor([[0, 1, 1], [1, 0, 1]]), 2).edge_index.tolist()
        [[0, 1, 0, 1], [1, 0, 0, 1]]
    """
    if isinstance(edges, EdgeSet):
        edges.check_sizes(num_nodes, num_nodes)
        return edges.derived(("self_loops", num_nodes), lambda: _looped(edges.edge_index, num_nodes))
    key = ("self_loops", num_nodes)
    found = CACHE.lookup(edges, key, _holds_input)
    if found is not None:
        return found[1]
    made = _looped(check_edge_index(edges, num_nodes, num_nodes, ranges=False), num_nodes)
    # Where the input had no loop of its own, the looped set begins with it: a hit compares the input
    # with that beginning, not with a copy of its own (16 bytes an edge, 1 GB at ogbn-products).
    appended = made.num_edges == edges.shape[1] + num_nodes
    copy = None if appended or device_stamp(edges) is not None else edges.detach().clone()
    CACHE.store(edges, key, (copy, made, edges.shape[1]))
    return made


def _looped(edge_index: Tensor, num_nodes: int) -> EdgeSet:
    """The looped set of a validated ``edge_index`` (:func:`self_looped`), prepared. On a device, the
    input and the loops are analysed as they are, counting the input's own loops in the analysis's one
    read; only where it has some (PyG's batches have none) are they removed and the set analysed again."""
    edge_index = edge_index.long()
    if not on_host(edge_index):
        loops = torch.arange(num_nodes, device=edge_index.device).expand(2, -1)  # [2, N]
        looped = torch.cat([edge_index, loops], dim=1)  # [2, E + N]
        with torch.no_grad():
            s = analyse_on_device(looped, num_nodes, num_nodes, loops_among=edge_index.shape[1])
        if not s.extras.pop("loops_among"):
            made = EdgeSet(s)
            made.derived("edge_index", lambda: _stamped(looped))
            return made
    return _prepared_own(_with_loops(edge_index, num_nodes), num_nodes)


def _prepared_own(looped: Tensor, num_nodes: int) -> EdgeSet:
    """:func:`prepare` of an edge set made here (no caller holds it): it serves as the set's
    :attr:`~EdgeSet.edge_index` as it is, without a copy."""
    made = EdgeSet(analysed(looped, num_nodes, num_nodes))
    made.derived("edge_index", lambda: _stamped(looped))
    return made


def _holds_input(edge_index: Tensor, entry: Tuple[Optional[Tensor], EdgeSet, int]) -> bool:
    """Whether ``edge_index`` still holds the edges its looped set was made from."""
    copy, looped, num_edges = entry
    held = looped.edge_index[:, :num_edges] if copy is None else copy
    return edge_index.shape == held.shape and torch.equal(held, edge_index)


def _with_loops(edge_index: Tensor, num_nodes: int) -> Tensor:
    """``[2, E']``: the edges without their self-loops, then ``(i, i)`` for every node. One pass of
    the extension on the CPU (which checks the node ids; :func:`prepare` names a bad one); on a
    device one boolean selection, the one read back it costs (the looped set's analysis is another)."""
    edge_index = edge_index.long()
    if on_host(edge_index) and native.available():
        try:
            return torch.ops.tgattn_fused.self_loops(edge_index, num_nodes)
        except RuntimeError:
            check_ranges(edge_index, num_nodes, num_nodes)  # names the bad node id
            raise
    edge_index = edge_index[:, edge_index[0] != edge_index[1]]  # [2, E - loops]
    loops = torch.arange(num_nodes, device=edge_index.device).expand(2, -1)  # [2, N]
    return torch.cat([edge_index, loops], dim=1)


def all_pairs_per_graph(batch: Tensor, lengths: Sequence[int]) -> EdgeSet:
    """Every (key, query) pair of nodes within each graph of a batch, prepared without an analysis:
    the set :func:`prepare` makes of ``builders.full(lengths)``, built where ``batch`` lies from sizes
    the host knows, so that on a GPU nothing is read back nor copied from the host (GPS's global
    attention on a new batch each step).

    ``batch [N]``: each node's graph, sorted (graph ``b``'s nodes contiguous, in order); ``lengths``:
    the node count of every graph, the counts of ``batch`` (not checked against it: the caller read
    them from it).

    Example:
        >>> es = all_pairs_per_graph(torch.tensor([0, 0, 1]), [2, 1])
        >>> es.edge_index.tolist(), es.kind, es.structure.lengths
        ([[0, 1, 0, 1, 2], [0, 0, 1, 1, 2]], 'packed_full', (2, 1))
    """
    n = batch.numel()
    sizes = tuple(int(length) for length in lengths if length)  # a graph without nodes is no sequence
    if sum(sizes) != n:
        raise ValueError(f"the graphs' lengths add up to {sum(sizes)}, but batch has {n} nodes")
    E = sum(length * length for length in sizes)
    device = batch.device
    # [B + 1] each graph's first node, then n (at least two entries, for the pairs of an empty batch's unfold)
    graphs = torch.searchsorted(batch, torch.arange(max(len(lengths), 1) + 1, device=device))
    bounds = graphs.unfold(0, 2, 1)[batch]  # [N, 2] each node's graph: its first node and the next graph's
    first, own = bounds[:, 0], bounds[:, 1] - bounds[:, 0]  # [N] and the size of its graph: its row's degree
    rowptr = torch.zeros(n + 1, dtype=torch.int32 if E < 2**31 else torch.long, device=device)
    torch.cumsum(own, 0, dtype=rowptr.dtype, out=rowptr[1:])  # [N + 1]
    dst = torch.repeat_interleave(own, output_size=E)  # [E] sorted queries: node i own[i] times
    src = torch.arange(E, device=device) + (first - rowptr[:-1])[dst]  # [E] each row's keys in order
    s = Structure(n, n, E, None, src, dst, rowptr, False)
    longest = max(sizes, default=0)
    if E:
        s.intervals = True
        s.extras["row_spans"] = (1 - longest, longest - 1, longest, True)
    if len(sizes) == 1:
        s.kind = "full"
    elif sizes:
        s.kind, s.lengths = "packed_full", sizes
    return EdgeSet(s)
