"""Edge sets known by their shape: each query's keys one range, given by a rule, not a list.

A :class:`Band` states the keys of query ``i`` as the range ``i + lo .. i + hi`` clipped to the
keys, or to the query's own document when the set is packed (``lengths``): full (no bound),
causal (``hi = 0``), sliding windows (``-w .. w``), causal windows, block-diagonal documents,
full or causal (``lengths``). :func:`band_of` recognises one in an analysed set from O(1) facts
of the analysis and one O(n) count (never a pass over the edges), and :func:`band_structure`
makes the analysis of a band without its edges: the row pointer (O(n)) and the kind, with the
sorted edges ``src`` / ``dst`` made only if something reads them. The tile planner of the ``tc``
backend plans such a set from its rows' ranges in O(tiles) memory
(:func:`tgattn.engine.triton.band_plan.plan_band`): causal at n = 16,384 has 134 million edges,
which an edge list holds in 2.1 GB and a plan from the edges in tens more.

Example:
    >>> from tgattn import builders
    >>> from tgattn.engine.analysis import analyse
    >>> band_of(analyse(builders.window(64, 4), 64, 64)), band_of(analyse(builders.causal([3, 5]), 8, 8))
    (Band(lo=-4, hi=4, lengths=None), Band(lo=None, hi=0, lengths=(3, 5)))
    >>> s = band_structure(Band(hi=0), 6, 6)  # causal over 6 tokens, its 21 edges not made
    >>> s.kind, s.num_edges, "edges" in s.extras
    ('causal', 21, False)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import Tensor

from .analysis import Structure, _packed_kind, row_spans


@dataclass(frozen=True)
class Band:
    """Query ``i`` attends to keys ``max(start, i + lo) .. min(end, i + hi)`` (rows = queries i,
    columns = keys j): ``start .. end`` are all keys, or the keys of ``i``'s document when
    ``lengths`` packs documents (then queries and keys are the same tokens); ``None``: no bound."""

    lo: Optional[int] = None
    hi: Optional[int] = None
    lengths: Optional[Tuple[int, ...]] = None


def row_ranges(band: Band, n_q: int, n_k: int, device=None) -> Tuple[Tensor, Tensor]:
    """``(first, last) [n_q]`` (int64): each query's first and last key; ``last < first`` for a
    row without keys. O(n).

    Example:
        >>> [t.tolist() for t in row_ranges(Band(lo=-1, hi=0, lengths=(2, 3)), 5, 5)]
        [[0, 0, 2, 2, 3], [0, 1, 2, 3, 4]]
    """
    rows = torch.arange(n_q, device=device)
    if band.lengths is None:
        start, end = torch.zeros_like(rows), torch.full_like(rows, n_k - 1)
    else:
        lengths = torch.tensor(band.lengths, device=device)
        start = torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)  # [n] each row's document start
        end = start + torch.repeat_interleave(lengths, lengths) - 1
    first = start if band.lo is None else torch.maximum(start, rows + band.lo)
    last = end if band.hi is None else torch.minimum(end, rows + band.hi)
    return first, last


def _checked(band: Band, n_q: int, n_k: int) -> None:
    for name, n in (("n_q", n_q), ("n_k", n_k)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"{name} must be a node count, an int >= 0 (got {n!r})")
    if band.lengths is not None and not (n_q == n_k == sum(band.lengths) and min(band.lengths, default=1) > 0):
        raise ValueError(f"packed documents need n_q == n_k == sum(lengths) and lengths > 0 "
                         f"(got n_q={n_q}, n_k={n_k}, lengths summing to {sum(band.lengths)})")


def _kind(first: Tensor, last: Tensor, n_q: int, n_k: int, num_edges: int) -> Tuple[str, Optional[Tuple[int, ...]]]:
    """``(kind, lengths)`` of a band's edge set from its rows' ranges, as :func:`~.analysis.analyse`
    classes the edges (a diagonal is packed full documents of one token, one document is not packed)."""
    if num_edges and num_edges == n_q * n_k:
        return "full", None
    if not num_edges or n_q != n_k or bool((last < first).any()):  # the dense kinds have no empty row
        return "general", None
    rows = torch.arange(n_q)
    if num_edges == n_q * (n_q + 1) // 2 and bool((last <= rows).all()):
        return "causal", None
    kind, lengths = _packed_kind(first, last, n_q)
    return (kind, lengths) if kind is not None else ("general", None)


class BandStructure(Structure):
    """The :class:`~.analysis.Structure` of a :class:`Band` (:func:`band_structure`): ``src`` /
    ``dst`` (the sorted edges, int64) are made on their first read and kept (``extras["edges"]``)."""

    band: Band

    src = property(lambda s: s.memo("edges", s._edges)[0], lambda s, value: None)  # set to None by __init__
    dst = property(lambda s: s.memo("edges", s._edges)[1], lambda s, value: None)

    def _edges(self) -> Tuple[Tensor, Tensor]:
        first, _ = row_ranges(self.band, self.n_q, self.n_k, self.rowptr.device)
        ptr = self.rowptr.long()
        dst = torch.repeat_interleave(torch.arange(self.n_q, device=ptr.device), ptr[1:] - ptr[:-1])  # [E]
        src = first[dst] + torch.arange(self.num_edges, device=ptr.device) - ptr[dst]  # [E]
        return src, dst

    def __repr__(self) -> str:  # the dataclass's would read the edges
        return f"BandStructure({self.band}, n_q={self.n_q}, n_k={self.n_k}, num_edges={self.num_edges})"


def band_structure(band: Band, n_q: int, n_k: int, device=None) -> BandStructure:
    """The analysis of ``band``'s edge set over ``n_q`` queries and ``n_k`` keys, without its edges:
    what :func:`~.analysis.analyse` of the edge list finds (kind, lengths, row pointer, no
    duplicates), in O(n) memory; the sorted edges are made if something reads them.

    Raises:
        ValueError: a bad count, or packed lengths that do not sum to the tokens.

    Example:
        >>> s = band_structure(Band(lo=-1, hi=1), 4, 4)
        >>> s.rowptr.tolist(), s.src.tolist()
        ([0, 2, 5, 8, 10], [0, 1, 0, 1, 2, 1, 2, 3, 2, 3])
    """
    _checked(band, n_q, n_k)
    first, last = row_ranges(band, n_q, n_k)  # O(n) on the host, where E is read without a sync
    degree = (last - first + 1).clamp_(min=0)  # [n_q]
    num_edges = int(degree.sum())
    rowptr = torch.zeros(n_q + 1, dtype=torch.int32 if num_edges < 2**31 else torch.long)
    torch.cumsum(degree, 0, out=rowptr[1:])
    rowptr = rowptr.to(device)
    kind, lengths = _kind(first, last, n_q, n_k, num_edges)
    s = BandStructure(n_q, n_k, num_edges, None, None, None, rowptr, False, kind=kind, lengths=lengths,
                      intervals=num_edges > 0)
    s.band = band
    s.extras["band"] = band
    return s


def _recognised(s: Structure) -> Optional[Band]:
    if s.duplicates or not s.num_edges:
        return None
    if s.kind == "full":
        return Band()
    if s.kind in ("causal", "packed_causal", "packed_full"):
        return Band(hi=0 if s.kind.endswith("causal") else None, lengths=s.lengths)
    if not s.intervals or s.num_edges < s.n_q:  # (rows without keys: a graph's, whose O(n) count would outweigh E)
        return None
    lo, hi = row_spans(s)[:2]
    band = Band(lo, hi)
    first, last = row_ranges(band, s.n_q, s.n_k, s.rowptr.device)
    # Each row's keys are one range inside its clipped band; the ranges fill the bands exactly
    # when their sizes add up to E.
    return band if int((last - first + 1).clamp_(min=0).sum()) == s.num_edges else None


def band_of(s: Structure) -> Optional[Band]:
    """The :class:`Band` of ``s`` when its edges are exactly one (full, causal, packed documents,
    a window of any offsets), else ``None`` (cached on ``s``).

    Example:
        >>> from tgattn import builders
        >>> from tgattn.engine.analysis import analyse
        >>> band_of(analyse(builders.full(5), 5, 5)), band_of(analyse(builders.window(8, 2)[:, 1:], 8, 8))
        (Band(lo=None, hi=None, lengths=None), None)
    """
    return s.memo("band", lambda: _recognised(s))
