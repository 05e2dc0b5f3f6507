"""Cheap, cached analysis of an edge set: ordering, duplicates, CSR rows and dense structure.

Every check is an O(E) vectorized pass (a sort only when the edges come unsorted). A prepared
edge set (:func:`tgattn.engine.edgeset.prepare`) holds its analysis; a plain ``edge_index`` has
its analysis kept in :data:`CACHE`, keyed on the tensor's identity
(:func:`tgattn.engine.edgeset.structure_of`), so an edge set shared by the layers of a model is
analysed once. A hit is checked so that an edge set changed in place is not served a stale
analysis: on the CPU by comparing contents, on a GPU by the tensor's version counter and
address (:func:`device_stamp`), since reading its contents back would make the host wait for
the device on every call.
"""
from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Hashable, Optional, Tuple

import numpy
import torch
from torch import Tensor

from . import native

# Structure kinds the dense (SDPA) backend can run exactly.
DENSE_KINDS = ("full", "causal", "packed_full", "packed_causal")


@dataclass
class Structure:
    """What the engine knows about one edge set (edges in (target, source) order).

    Attributes:
        n_q, n_k: number of query and key nodes.
        num_edges: E.
        perm: ``None`` when the edges already come sorted by (target, source), else the
            permutation that sorts them (``sorted = original[:, perm]``).
        src, dst: sorted keys j and queries i ``[E]``.
        rowptr: CSR row pointer over queries ``[n_q + 1]``, int32 when ``E < 2**31`` (else
            int64; see :func:`row_pointer`).
        duplicates: whether some edge appears more than once.
        kind: ``"full"``, ``"causal"``, ``"packed_full"``, ``"packed_causal"`` or ``"general"``.
        lengths: sequence lengths of a packed (block-diagonal) kind, else ``None``.
        intervals: each query's keys form one contiguous range ``lo..hi`` (banded sets).
    """

    n_q: int
    n_k: int
    num_edges: int
    perm: Optional[Tensor]
    src: Tensor
    dst: Tensor
    rowptr: Tensor
    duplicates: bool
    kind: str = "general"
    lengths: Optional[Tuple[int, ...]] = None
    intervals: bool = False
    extras: Dict[object, object] = field(default_factory=dict)  # derived data (tiles, transpose): see memo
    lock: threading.RLock = field(default_factory=threading.RLock, init=False, repr=False, compare=False)

    def memo(self, key: Hashable, make: Callable[[], object]):
        """``extras[key]``, made by ``make()`` on first use, once even when threads ask at the same time
        (reentrant: ``make`` may ask for another key). The place for data derived from the edges alone
        (what :meth:`tgattn.engine.edgeset.EdgeSet.derived` hands out)."""
        try:
            return self.extras[key]
        except KeyError:
            pass
        with self.lock:
            if key not in self.extras:
                self.extras[key] = make()
            return self.extras[key]

    @property
    def density(self) -> float:
        return self.num_edges / max(self.n_q * self.n_k, 1)


# The fused extension sorts unsorted edges by counting, with an array of max(n_q, n_k) + 1
# counts; past this many nodes per edge an argsort of the edges runs instead, O(E log E) time
# and O(E) memory (10 edges among 10^7 nodes: no 80 MB of counts).
COUNTING_SORT_NODES_PER_EDGE = 4


def counting_sort(edge_index: Tensor, n_q: int, n_k: int) -> bool:
    """Whether :func:`_sorted_edges` runs the fused extension's sort on ``edge_index`` (CPU, at
    most ``COUNTING_SORT_NODES_PER_EDGE`` nodes per edge, the extension built), whose first
    pass refuses any node id outside ``[0, n_k) x [0, n_q)``."""
    few_nodes = max(n_q, n_k) <= COUNTING_SORT_NODES_PER_EDGE * edge_index.shape[1]
    return edge_index.device.type == "cpu" and few_nodes and native.available()


def _sorted_edges(edge_index: Tensor, n_q: int, n_k: int):
    """``(perm or None, src, dst, duplicates, rowptr, spans)`` of the edges in (target, source) order,
    ``rowptr`` their :func:`row_pointer` (by targets), ``spans`` ``(row_spans, rows with edges)`` where
    the extension found them, else None.

    On the CPU one call of the fused extension checks the order and, if needed, sorts (one counting
    sort by target, then each row by source where it is not in order already: PyG's batches come
    sorted by source), finds repeated edges, keeps the row pointer and the rows' spans (one pass over
    the sorted edges); elsewhere, and where the nodes outnumber the edges
    (``COUNTING_SORT_NODES_PER_EDGE``), a comparison pass and a stable argsort on a key ``[E]``.
    """
    src, dst = edge_index[0], edge_index[1]
    if counting_sort(edge_index, n_q, n_k):
        perm, src, dst, _, rowptr, stats = torch.ops.tgattn_fused.sort_edges(src, dst, n_q, n_k)
        lo, hi, deg, rows, inside, steps, duplicates = stats.tolist()  # one read
        duplicates = bool(duplicates)
        spans = ((lo, hi, deg, not duplicates and steps == inside), rows) if src.numel() else None
        return (perm if perm.numel() else None), src, dst, duplicates, rowptr, spans
    key = dst * max(n_k, 1) + src  # [E]
    if key.numel() < 2 or bool((key[1:] >= key[:-1]).all()):
        # Copies, not views: a view would keep the caller's tensor (the cache key) alive.
        perm, src, dst = None, src.clone(), dst.clone()
    else:
        perm = torch.argsort(key, stable=True)
        src, dst, key = src[perm], dst[perm], key[perm]
    duplicates = key.numel() > 1 and bool((key[1:] == key[:-1]).any())
    return perm, src, dst, duplicates, row_pointer(dst, n_q), None


def row_pointer(index: Tensor, n: int) -> Tensor:
    """The CSR pointer ``[n + 1]`` of ``index [E]`` (values in ``[0, n)``): entry ``i`` counts
    the values below ``i``, so sorted positions ``ptr[i] .. ptr[i + 1]`` hold ``i``.

    int32 when ``E < 2**31`` (every entry fits), else int64: of 10 edges among 10^7 nodes, the
    pointer is nearly all the analysis holds (38 MB, not 76). Counted and summed in place: one
    array of ``n + 1`` and O(E) work besides its fill and prefix sum (``bincount`` and
    ``cumsum`` would each make another array of ``n``).

    Example:
        >>> ptr = row_pointer(torch.tensor([0, 0, 2]), 4)
        >>> ptr.tolist(), ptr.dtype
        ([0, 2, 2, 3, 3], torch.int32)
    """
    dtype = torch.int32 if index.numel() < 2**31 else torch.long
    ptr = torch.zeros(n + 1, dtype=dtype, device=index.device)
    ptr[1:].index_add_(0, index, torch.ones(index.shape, dtype=dtype, device=index.device))
    return ptr.cumsum_(0)


def _row_bounds(src: Tensor, dst: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(rows, lo, hi, deg) [R]``: each query that has edges, its first and last key and its
    degree (edges sorted by (target, source), at least one). O(E): nothing of size ``n_q``."""
    E = dst.numel()
    first = torch.ones(E, dtype=torch.bool, device=dst.device)
    first[1:] = dst[1:] != dst[:-1]
    starts = first.nonzero().flatten()  # [R] the first edge of each row
    ends = torch.cat([starts[1:], starts.new_tensor([E])])  # exclusive
    return dst[starts], src[starts], src[ends - 1], ends - starts


def _packed_kind(lo: Tensor, hi: Tensor, n: int):
    """Detect block-diagonal full / causal (``lo``/``hi`` are the bounds of every row, in order;
    rows are intervals)."""
    rows = torch.arange(n, device=lo.device)
    starts = (lo == rows).nonzero().flatten()  # a segment starts where a row's first key is itself
    if starts.numel() == 0 or int(starts[0]) != 0:
        return None, None
    seg = torch.cumsum(lo == rows, 0) - 1  # [n] segment of each row
    ends = torch.cat([starts[1:], starts.new_tensor([n])])  # exclusive
    if not bool((lo == starts[seg]).all()):
        return None, None
    lengths = tuple((ends - starts).tolist())
    if bool((hi == ends[seg] - 1).all()):
        return "packed_full", lengths
    if bool((hi == rows).all()):
        return "packed_causal", lengths
    return None, None


def _row_ends(s: Structure):
    """``(rows, first, last, deg) [R]`` of the rows that have edges (at least one edge).

    With ``n_q <= E``, from the row pointer: a few O(n_q) passes, on the host through NumPy
    (zero-copy views; a NumPy call costs a fraction of a torch call's overhead, which is what
    the analysis of a small never-seen edge set, a molecule batch, spends its time in), so the
    arrays are NumPy arrays there and tensors elsewhere (both take the same arithmetic). With
    fewer edges than queries, :func:`_row_bounds`: O(E), nothing of size ``n_q``.
    """
    if s.num_edges < s.n_q:
        return _row_bounds(s.src, s.dst)
    src, ptr = s.src, s.rowptr
    if on_host(src):
        src, ptr = src.numpy(), ptr.numpy()
        rows, gather = numpy.arange(s.n_q), src.take  # take: twice as fast as indexing by int32
    else:
        rows, gather = torch.arange(s.n_q, device=src.device), src.__getitem__
    starts, ends = ptr[:-1], ptr[1:]
    deg = ends - starts
    if int(deg.min()) == 0:
        keep = deg > 0
        rows, starts, ends, deg = rows[keep], starts[keep], ends[keep], deg[keep]
    return rows, gather(starts), gather(ends - 1), deg


def row_spans(s: Structure, ends=None) -> Tuple[int, int, int, bool]:
    """``(lo, hi, deg_max, intervals)``: the extreme ``j - i`` over the edges, the largest row
    degree and whether every row's keys form one contiguous range (never with duplicated
    edges), from each row's first and last key (rows are sorted): O(min(n_q, E)) (cached).

    ``ends``: :func:`_row_ends` of ``s``, when already at hand. ``s`` has at least one edge.

    Example:
        >>> from tgattn import builders
        >>> row_spans(analyse(builders.window(6, 1), 6, 6))
        (-1, 1, 3, True)
    """
    if "row_spans" not in s.extras:
        rows, first, last, deg = _row_ends(s) if ends is None else ends
        # Sorted keys without repeats: a row spans at least its degree, exactly when it is one
        # range, so the rows are all ranges when the spans add up to E.
        whole = not s.duplicates and int((last - first).sum()) + len(rows) == s.num_edges
        s.extras["row_spans"] = (int((first - rows).min()), int((last - rows).max()), int(deg.max()), whole)
    return s.extras["row_spans"]


def _classify(s: Structure, rows: Optional[int] = None) -> None:
    """``s.kind``, ``s.lengths`` and ``s.intervals``; ``rows``: the number of rows with edges, where the
    extension's sort counted them (with the row spans, then in ``s.extras``)."""
    n, E = s.n_q, s.num_edges
    if E == 0 or s.duplicates:
        return
    if E == s.n_q * s.n_k:  # unique edges inside [n_q, n_k] covering every pair
        s.kind = "full"
        s.intervals = True
        return
    ends = None if rows is not None else _row_ends(s)
    s.intervals = row_spans(s, ends)[3]
    rows = len(ends[0]) if rows is None else rows
    if not s.intervals or s.n_q != s.n_k or rows < n:  # the dense kinds have no empty row
        return
    # Every query has edges (n <= E): rows is 0 .. n - 1, and per-row work is O(E).
    if E == n * (n + 1) // 2 and bool((s.src <= s.dst).all()):
        s.kind = "causal"
        return
    ends = _row_ends(s) if ends is None else ends
    kind, lengths = _packed_kind(torch.as_tensor(ends[1]), torch.as_tensor(ends[2]), n)
    if kind is not None:
        s.kind, s.lengths = kind, lengths


def analyse(edge_index: Tensor, n_q: int, n_k: int) -> Structure:
    """Analyse a validated ``LongTensor[2, E]`` edge set (uncached; see :func:`structure_of`).

    O(E) time and memory besides the row pointer ``[n_q + 1]``, so that a few edges among
    many nodes cost little more than the edges.

    Example:
        >>> from tgattn import builders
        >>> analyse(builders.causal([2, 3]), 5, 5).kind, analyse(builders.causal([2, 3]), 5, 5).lengths
        ('packed_causal', (2, 3))
        >>> analyse(builders.window(6, 1), 6, 6).kind
        'general'
    """
    E = edge_index.shape[1]
    perm, src, dst, duplicates, rowptr, spans = _sorted_edges(edge_index, n_q, n_k)
    s = Structure(n_q, n_k, E, perm, src, dst, rowptr, duplicates)
    if spans is not None:
        s.extras["row_spans"] = spans[0]
    _classify(s, None if spans is None else spans[1])
    return s


def with_keys(s: Structure, src: Tensor, n_k: int) -> Structure:
    """``s`` with its keys renumbered: ``src [E]`` the sorted edges' new key ids among ``n_k`` keys, in an
    order-preserving renumbering (the edges stay sorted by (target, source), with the same permutation
    and duplicates), analysed for its kind."""
    renumbered = Structure(s.n_q, n_k, s.num_edges, s.perm, src, s.dst, s.rowptr, s.duplicates)
    _classify(renumbered)
    return renumbered


# Devices whose tensors the host reads without waiting (a content check costs one pass). On
# the others (CUDA), the steady path of a call never reads a value back: see device_stamp.
HOST_DEVICES = frozenset({"cpu"})


def on_host(t: Tensor) -> bool:
    """Whether ``t``'s values can be read on the host without a device sync (CPU tensors).

    Example:
        >>> on_host(torch.zeros(1))
        True
    """
    return t.device.type in HOST_DEVICES


def device_stamp(t: Tensor) -> Optional[Hashable]:
    """What tells, without reading ``t``, that it still holds what it held: its address, layout
    and version counter; ``None`` where the contents must be compared instead (host tensors,
    and inference tensors, which have no version counter).

    Every in-place write through PyTorch (on ``t``, a view of it or a detached alias) bumps the
    version; writes that bypass it (through ``.data``, DLPack or another library's view of the
    memory) go unnoticed, on a GPU only: a CUDA tensor cannot be written through ``.numpy()``.

    Example:
        >>> device_stamp(torch.zeros(1)) is None  # a CPU tensor: compared by contents
        True
    """
    if on_host(t) or t.is_inference():
        return None
    return (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device, t._version)


def same_edges(edge_index: Tensor, s: Structure) -> bool:
    """Whether ``edge_index`` still holds the edges ``s`` was analysed from (one O(E) pass).

    A tensor can change without PyTorch noticing (writes through ``.numpy()``, ``.data`` or
    DLPack leave its version counter alone, and inference tensors have none), so the cache
    compares contents instead of trusting identity and version, wherever that needs no host
    sync (on the CPU; elsewhere :func:`device_stamp`, except for inference tensors).
    """
    if edge_index.shape != (2, s.num_edges) or edge_index.device != s.src.device:
        return False
    if on_host(edge_index) and s.src.dtype == torch.long and native.available():  # one pass, no gathered copies
        perm = s.src.new_empty(0) if s.perm is None else s.perm
        return torch.ops.tgattn_fused.same_edges(edge_index, perm, s.src, s.dst)
    src, dst = edge_index[0], edge_index[1]
    if s.perm is not None:
        src, dst = src[s.perm], dst[s.perm]
    if src.dtype != s.src.dtype:
        src, dst = src.to(s.src.dtype), dst.to(s.dst.dtype)
    return torch.equal(dst, s.dst) and torch.equal(src, s.src)


class TensorKeyed:
    """Values kept per (tensor identity, key): an entry dies with its tensor, past ``capacity``
    entries the oldest goes, and a value is handed out only while its tensor still holds what it
    held when stored: checked by :func:`device_stamp` on a GPU, by ``same(tensor, value)`` (a
    comparison of contents) where the stamp is ``None``.

    Safe under threads: the entries change only under ``lock``, the callback that drops a dead
    tensor's entry included. The lock is reentrant because that callback can fire inside a locked
    section of its own thread (a value dropped there, or a garbage collection, frees a tensor).
    """

    def __init__(self, capacity: int = 64):
        self.capacity = capacity
        self.entries: "OrderedDict[Tuple[int, Hashable], Tuple[weakref.ref, object]]" = OrderedDict()
        self.lock = threading.RLock()

    def lookup(self, tensor: Tensor, key: Hashable, same: Callable[[Tensor, Any], bool]) -> Optional[object]:
        with self.lock:
            entry = self.entries.get((id(tensor), key))
        if entry is None or entry[0]() is not tensor:
            return None
        stamp, value = entry[1]
        held = same(tensor, value) if stamp is None else stamp == device_stamp(tensor)
        return value if held else None

    def store(self, tensor: Tensor, key: Hashable, value: object) -> None:
        slot = (id(tensor), key)
        ref = weakref.ref(tensor, lambda _, slot=slot: self._forget(slot))
        stamped = (device_stamp(tensor), value)
        with self.lock:
            self.entries[slot] = (ref, stamped)
            # popitem, not a walk over the keys: a callback that fires meanwhile in this thread
            # cannot break it, nor empty the entries (the tensor stored here is alive).
            while len(self.entries) > self.capacity:
                self.entries.popitem(last=False)

    def _forget(self, slot: Tuple[int, Hashable]) -> None:
        with self.lock:
            self.entries.pop(slot, None)


class _Cache(TensorKeyed):
    """Structures keyed on (tensor identity, sizes), checked on every hit (against the tensor's
    contents, or its :func:`device_stamp` on a GPU); entries die with the tensor. ``hits`` and
    ``misses`` count the calls of :meth:`get` that found a structure or not."""

    def __init__(self, capacity: int = 64):
        super().__init__(capacity)
        self.hits = 0
        self.misses = 0

    def get(self, edge_index: Tensor, n_q: int, n_k: int) -> Optional[Structure]:
        s = self.lookup(edge_index, (n_q, n_k), same_edges)
        with self.lock:
            if s is None:
                self.misses += 1
            else:
                self.hits += 1
        return s

    def put(self, edge_index: Tensor, n_q: int, n_k: int, s: Structure) -> None:
        self.store(edge_index, (n_q, n_k), s)

    def clear(self) -> None:
        with self.lock:
            self.entries.clear()
            self.hits = self.misses = 0


CACHE = _Cache()
