"""Maximum flow on a layered cone with SciPy's compiled solver, exact to a certified 1e-13.

:func:`scipy.sparse.csgraph.maximum_flow` takes integer capacities only. Rounding capacities
once to integers would err by up to half a unit per edge of the min cut, so instead the
flow is *refined*: each round scales the current residual capacities (clipped at a certified
bound on the flow still missing, so that the largest fits ``int32``), rounds them **down**
(the integer flow is then feasible for the real capacities, a lower bound), adds that flow,
and computes the exact capacity of the integer problem's min cut in the real residual
network (an upper bound). A round shrinks the gap between the bounds by a factor of at least
``LIMIT / cut edges`` (about 10^4 for a cut of 10^5 edges, 10^8 for 10 edges), so two or three
rounds close it to :data:`TOLERANCE`.
"""
from __future__ import annotations

import numpy as np
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import breadth_first_order, maximum_flow

LIMIT = 2**30  # the largest scaled capacity: flows and capacities stay within int32
TOLERANCE = 1e-13  # the certified gap (upper bound - value) at which refining stops
MAX_ROUNDS = 12  # a safety net (then an error, never an unproven value): each round so far closed the gap by 10^4+


class Network:
    """A directed graph with float capacities, prepared once for many maximum flows.

    Args:
        num_nodes: node ids are ``0 .. num_nodes - 1``.
        src, dst: ``int64 [E]`` edge ends; no edge may appear twice or in both directions.
        cap: ``float64 [E]`` capacities, > 0.

    Example (two paths 0 -> 1 -> 3 and 0 -> 2 -> 3; the flow is min(.5, .25) + min(.3, .9)):
        >>> net = Network(4, np.array([0, 1, 0, 2]), np.array([1, 3, 2, 3]), np.array([.5, .25, .3, .9]))
        >>> round(net.max_flow(0, 3), 15)
        0.55
    """

    def __init__(self, num_nodes: int, src: np.ndarray, dst: np.ndarray, cap: np.ndarray):
        self.num_nodes, self.cap = num_nodes, np.asarray(cap, dtype=np.float64)
        bad = np.flatnonzero(~(np.isfinite(self.cap) & (self.cap > 0)))
        if len(bad):  # the integer solver would drop such an edge (NaN scales to 0) and return a finite, wrong flow
            raise ValueError(f"capacities must be finite and > 0 (edge {bad[0]} has {self.cap[bad[0]]})")
        self.src, self.dst = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
        rows = np.concatenate([self.src, self.dst])  # forward residual edges, then backward ones
        cols = np.concatenate([self.dst, self.src])
        self._order = np.lexsort((cols, rows))  # CSR order of the 2E residual edges
        self._rows, self._cols = rows[self._order], cols[self._order]
        self._indptr = np.searchsorted(self._rows, np.arange(num_nodes + 1)).astype(np.int32)
        self._indices = self._cols.astype(np.int32)
        position = np.empty_like(self._order)
        position[self._order] = np.arange(len(self._order))
        # where edge e's forward and backward residual edges sit in CSR order
        self._forward, self._backward = position[: len(self.src)], position[len(self.src):]

    def _csr(self, data: np.ndarray) -> csr_matrix:
        return csr_matrix((data, self._indices, self._indptr), shape=(self.num_nodes, self.num_nodes))

    def max_flow(self, source: int, sink: int) -> float:
        """The value of a maximum flow from ``source`` to ``sink``, within :data:`TOLERANCE`."""
        flow = np.zeros_like(self.cap)  # [E] on the original edges, always feasible
        value = 0.0
        out_of_source, into_sink = self.cap[self.src == source].sum(), self.cap[self.dst == sink].sum()
        gap = float(min(out_of_source, into_sink))  # certified: the flow still missing is at most this
        for _ in range(MAX_ROUNDS):
            if gap <= TOLERANCE:
                return float(value)
            scale = LIMIT / gap
            residual = np.concatenate([self.cap - flow, flow])  # forward, backward
            # clipping at the gap changes no maximum flow (no edge carries more than the flow's value)
            scaled = np.floor(np.minimum(residual, gap) * scale)[self._order].astype(np.int32)
            result = maximum_flow(self._csr(scaled), source, sink)
            net = np.asarray(result.flow[self.src, self.dst]).ravel()  # on the forward edges, may be < 0
            flow += net / scale
            gained = result.flow_value / scale
            value += gained
            # the integer problem's min cut (what the source reaches in its integer residual network),
            # whose capacity in the real residual network bounds the flow still missing
            left = scaled.astype(np.int64)
            left[self._forward] -= net
            left[self._backward] += net
            gap = min(gap - gained, self._cut(source, left > 0, flow))
        if gap <= TOLERANCE:
            return float(value)
        raise RuntimeError(f"max-flow from {source} to {sink}: {MAX_ROUNDS} rounds left a gap of {gap:.3g} "
                           f"(> {TOLERANCE:g}) between the flow found and its bound")

    def _cut(self, source: int, open_edges: np.ndarray, flow: np.ndarray) -> float:
        """The real residual capacity of the cut around the nodes ``source`` reaches over ``open_edges``
        (a mask of the residual edges in CSR order)."""
        reach = csr_matrix((np.ones(int(open_edges.sum()), dtype=np.int8),
                            (self._rows[open_edges], self._cols[open_edges])), shape=(self.num_nodes, self.num_nodes))
        inside = np.zeros(self.num_nodes, dtype=bool)
        inside[breadth_first_order(reach, source, directed=True, return_predecessors=False)] = True
        residual = np.concatenate([self.cap - flow, flow])[self._order]
        return float(np.maximum(residual[inside[self._rows] & ~inside[self._cols]], 0.0).sum())
