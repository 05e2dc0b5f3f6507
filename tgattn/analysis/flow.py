"""Attention flow: maximum flow from each input token to an output token through the layers."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, List, Optional, Sequence, Tuple, Union

import networkx as nx
import numpy as np
import torch
from scipy.sparse import csr_matrix
from torch import Tensor
from tqdm import tqdm

from ..builders._common import check_count
from .maxflow import Network
from .weights import Head, Layer, as_layers, count_nodes, layer_csr


@dataclass(frozen=True)
class Cone:
    """The layered graph of the nodes that reach ``(L, output)``, as arrays.

    ``levels[l]`` are the tokens of layer l in the cone, sorted (``levels[L] = [output]``,
    ``levels[0]`` the inputs that reach it). Node ``(l, levels[l][p])`` has the id
    ``offsets[l] + p``; edge e runs from ``src[e]`` (layer ``layer[e] - 1``) to ``dst[e]``
    (layer ``layer[e]``) with capacity ``cap[e] > 0``.
    """

    levels: List[Tensor]
    offsets: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    cap: np.ndarray
    layer: np.ndarray

    @property
    def num_nodes(self) -> int:
        return int(self.offsets[-1])

    @property
    def num_edges(self) -> int:
        return len(self.cap)

    def to_networkx(self) -> nx.DiGraph:
        """The cone as a ``DiGraph`` with nodes ``(layer, token)`` and edge attribute ``capacity``."""
        names = [(layer, token) for layer, level in enumerate(self.levels) for token in level.tolist()]
        graph = nx.DiGraph()
        graph.add_nodes_from(names)
        graph.add_edges_from((names[u], names[v], {"capacity": c})
                             for u, v, c in zip(self.src.tolist(), self.dst.tolist(), self.cap.tolist()))
        return graph


def attention_flow(
    attention: Union[Layer, Sequence[Layer]],
    output: int,
    *,
    head: Head = "mean",
    residual: bool = True,
    num_nodes: Optional[int] = None,
    flow_func: Optional[Callable] = None,
    progress: bool = False,
) -> Tensor:
    r"""Attention flow into token ``output`` after the last layer, from every input token.

    Abnar & Zuidema (ACL 2020) read a stack of L layers as a layered graph: node ``(l, i)``
    is token i after layer l (``l = 0`` are the inputs), edge ``(l-1, j) -> (l, i)`` has
    capacity :math:`\tilde A_l[i, j]` (the attention of query i on key j, mixed with the
    identity as in :func:`attention_rollout` when ``residual=True``). The flow of input j is
    the value of a maximum flow from ``(0, j)`` to ``(L, output)``.

    How it is computed:

    * Only the *cone* of the output is built (:func:`flow_cone`): the nodes from which
      ``(L, output)`` can be reached, walked backwards through the sparse layers. Every
      ``(0, j) -> (L, output)`` path lies in it, so the values are exact; inputs outside it
      get 0 without a flow.
    * One or two layers need no max-flow solver: with two, the paths from ``(0, j)`` are
      ``(0, j) -> (1, m) -> (2, output)``, and paths through different m share no edge, so the
      flow is :math:`\sum_m \min(\tilde A_1[m, j], \tilde A_2[o, m])`, summed for all inputs at once.
    * Deeper stacks: one maximum flow per input on the cone, by SciPy's compiled solver with
      integer capacities refined to a certified gap of 1e-13 (:class:`tgattn.analysis.maxflow.Network`).
      Each input's value is its own min cut; inputs compete for the same edges, so one flow from a
      super-source gives only the total, not each input's value.

    Cost: for ``window(n, w)`` and L layers, away from the sequence ends, the cone has
    :math:`V = (L + 1)(L w + 1)` nodes and :math:`E = (2w + 1)(L + w L (L - 1))` edges,
    whatever n is, and one output needs ``2 L w + 1`` max-flows on it. Full or causal patterns
    make the cone the whole graph. For a top-k question use :func:`top_flow`, which skips inputs.

    Args:
        attention: ``(edge_index, alpha)`` per layer, first layer first.
        output: the token whose inputs are measured (negative counts from the end).
        head: ``"mean"`` (default, as in the paper) or the index of one head.
        residual: mix each layer with the identity (default), else use raw attention.
        num_nodes: number of tokens (default: largest node id + 1).
        flow_func: a networkx max-flow function (e.g. ``networkx.algorithms.flow.edmonds_karp``)
            to solve every input with instead (pure Python: for comparisons, hundreds of times slower).
        progress: show a tqdm bar over the inputs.

    Returns:
        ``float64`` tensor ``[N]``: the flow from each input token to ``output``; NaN for an input
        with a path through a NaN or infinite weight (its max-flow is unknown; the others never
        touch that edge). A negative weight is refused (``ValueError`` naming layer and edge).

    Example (3 tokens; every value is worked out by hand in ``tests/test_analysis_flow.py``):
        >>> from tgattn import builders
        >>> ei = builders.causal(3)  # edges (j, i): (0,0) (0,1) (1,1) (0,2) (1,2) (2,2)
        >>> a1 = torch.tensor([1.0, 0.5, 0.5, 0.5, 0.25, 0.25])
        >>> a2 = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.5, 0.5])
        >>> attention_flow([(ei, a1), (ei, a2)], output=2)
        tensor([0.5000, 0.3750, 0.6250], dtype=torch.float64)

    References:
        Samira Abnar and Willem Zuidema, "Quantifying Attention Flow in Transformers",
        ACL 2020, https://arxiv.org/abs/2005.00928
    """
    n, output, matrices = _prepare(attention, output, head, residual, num_nodes)
    cone = flow_cone(matrices, output)
    values = torch.zeros(n, dtype=torch.float64)
    inputs = cone.levels[0]
    if flow_func is None and len(matrices) <= 2:
        values[inputs] = torch.from_numpy(_shallow_flows(cone))  # NaN capacities give NaN sums by themselves
        return values
    unknown = _unknown_inputs(cone)
    values[inputs[torch.from_numpy(unknown)]] = float("nan")
    solve = _solver(_finite_part(cone), flow_func)
    for r in tqdm(np.flatnonzero(~unknown).tolist(), disable=not progress, desc=f"flow into token {output}"):
        values[inputs[r]] = solve(r)
    return values


def top_flow(
    attention: Union[Layer, Sequence[Layer]],
    output: int,
    k: int,
    *,
    head: Head = "mean",
    residual: bool = True,
    num_nodes: Optional[int] = None,
    flow_func: Optional[Callable] = None,
    progress: bool = False,
) -> Tuple[Tensor, Tensor]:
    """The ``k`` inputs with the largest :func:`attention_flow` into ``output``, with fewer max-flows.

    Every input j gets an upper bound first, the smallest capacity of a *layer cut*: all
    edges from layer l-1 to layer l that lie on a path ``(0, j) -> (L, output)`` (every such
    path crosses each layer once, so removing them separates j from the output; see
    :func:`flow_upper_bounds`). Inputs are then solved in decreasing order of bound, and the
    search stops once the next bound is below the k-th value found: the rest cannot enter
    the top k. The result equals sorting :func:`attention_flow` (tolerance 1e-12). One or two
    layers are computed for all inputs at once (see :func:`attention_flow`).

    Returns:
        ``(index [<=k], value [<=k])``, largest flow first (ties: smaller token first),
        tokens with flow 0 left out.

    Example (the 3-token example of :func:`attention_flow`, flows ``[.5, .375, .625]``):
        >>> from tgattn import builders
        >>> ei = builders.causal(3)
        >>> a1 = torch.tensor([1.0, 0.5, 0.5, 0.5, 0.25, 0.25])
        >>> a2 = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.5, 0.5])
        >>> top_flow([(ei, a1), (ei, a2)], 2, k=2)
        (tensor([2, 0]), tensor([0.6250, 0.5000], dtype=torch.float64))
    """
    k = check_count("k", k)
    _, output, matrices = _prepare(attention, output, head, residual, num_nodes)
    return top_flow_of(matrices, output, k, flow_func=flow_func, progress=progress)


def top_flow_of(matrices: Sequence[csr_matrix], output: int, k: int, *, flow_func: Optional[Callable] = None,
                progress: bool = False) -> Tuple[Tensor, Tensor]:
    """:func:`top_flow` of layer matrices (:func:`~tgattn.analysis.weights.layer_csr`, first layer first).

    Only the rows in the output's cone are read (:func:`flow_cone`): the other rows may be left empty.
    """
    cone = flow_cone(matrices, output)
    check_finite_cone(cone, output)
    inputs = cone.levels[0]
    found: List[Tuple[float, int]] = []  # (flow, token), best first, at most k
    if flow_func is None and len(matrices) <= 2:
        return ranked(zip(_shallow_flows(cone).tolist(), inputs.tolist()), k)
    bound = flow_upper_bounds(matrices, cone.levels)  # [inputs]
    solve = _solver(cone, flow_func)
    for r in tqdm(torch.sort(-bound, stable=True).indices.tolist(), disable=not progress,
                  desc=f"top {k} flow into token {output}"):
        if len(found) == k and (k == 0 or float(bound[r]) < found[-1][0] - 1e-12):
            break
        found = sorted(found + [(solve(r), int(inputs[r]))], key=lambda p: (-p[0], p[1]))[:k]
    return ranked(found, k)


def ranked(found: Iterable[Tuple[float, int]], k: int) -> Tuple[Tensor, Tensor]:
    """``(index, value)`` of the ``k`` largest ``(flow, token)`` pairs (ties: smaller token first), zeros left out."""
    found = [(value, j) for value, j in sorted(found, key=lambda p: (-p[0], p[1]))[:k] if value > 0]
    index = torch.tensor([j for _, j in found], dtype=torch.long)
    return index, torch.tensor([value for value, _ in found], dtype=torch.float64)


def flow_upper_bounds(matrices: Sequence[csr_matrix], levels: Sequence[Tensor]) -> Tensor:
    """For each input of a cone, the smallest capacity of the layer cuts on its paths.

    ``levels[l]`` are the tokens of layer l in the cone (from :func:`flow_cone`). The
    layer-l cut of input j: the total capacity of the edges ``(l-1, a) -> (l, b)`` with
    ``(l-1, a)`` reachable from ``(0, j)`` and ``(l, b)`` in the cone. Returns
    ``float64 [len(levels[0])]``, the minimum over l, an upper bound of the max-flow.
    """
    inputs = len(levels[0])
    reach = csr_matrix(np.eye(inputs, dtype=np.float64))  # [cone nodes of layer l, inputs], 1 = reached
    bound = np.full(inputs, np.inf)
    for layer in range(1, len(matrices) + 1):
        sub = matrices[layer - 1][levels[layer].numpy()][:, levels[layer - 1].numpy()]  # [levels[l], levels[l-1]]
        bound = np.minimum(bound, np.asarray(reach.T @ np.asarray(sub.sum(0)).ravel()).ravel())
        reach = (sub @ reach).astype(bool).astype(np.float64)
    return torch.from_numpy(bound)


def _shallow_flows(cone: Cone) -> np.ndarray:
    """The flow of every input of a cone of one or two layers (the paths share no edge), ``float64``.

    A non-finite capacity gives NaN to exactly the inputs with a path through it (``np.minimum``
    and the sums carry it), as :func:`_unknown_inputs` says for deeper stacks.
    """
    inputs = len(cone.levels[0])
    cap = np.where(np.isfinite(cone.cap), cone.cap, np.nan)  # an infinite share is as unknown as a NaN one
    if len(cone.levels) == 2:  # one layer: the edge into the output is the only path
        return np.bincount(cone.src, weights=cap, minlength=inputs).astype(np.float64)  # (empty: int64)
    last = cone.layer == 2
    into_output = np.zeros(cone.num_nodes)
    into_output[cone.src[last]] = cap[last]  # per middle node m: capacity of (1, m) -> (2, output)
    first = ~last
    return np.bincount(cone.src[first], weights=np.minimum(cap[first], into_output[cone.dst[first]]),
                       minlength=inputs).astype(np.float64)


def _unknown_inputs(cone: Cone) -> np.ndarray:
    """``bool [inputs]``: the inputs with a path through an edge of non-finite capacity (their flow is NaN).

    Every node of the cone reaches the output, so an input's max-flow can use a NaN edge exactly
    when the input reaches the edge's tail; the others never touch it.
    """
    tainted = np.zeros(cone.num_nodes, dtype=bool)
    tainted[cone.src[~np.isfinite(cone.cap)]] = True
    for layer in range(len(cone.levels) - 1, 0, -1):  # from the output down: the tails of edges into tainted nodes
        edges = cone.layer == layer
        tainted[cone.src[edges][tainted[cone.dst[edges]]]] = True
    return tainted[: len(cone.levels[0])]


def _finite_part(cone: Cone) -> Cone:
    """The cone without its non-finite edges (no input solved on it reaches them)."""
    keep = np.isfinite(cone.cap)
    return Cone(cone.levels, cone.offsets, cone.src[keep], cone.dst[keep], cone.cap[keep], cone.layer[keep])


def check_finite_cone(cone: Cone, output: int) -> None:
    """A ranking needs every value: name the first non-finite capacity on a path into ``output``."""
    bad = np.flatnonzero(~np.isfinite(cone.cap))
    if len(bad):
        e = bad[0]
        layer = int(cone.layer[e])
        key = int(cone.levels[layer - 1][cone.src[e] - cone.offsets[layer - 1]])
        query = int(cone.levels[layer][cone.dst[e] - cone.offsets[layer]])
        raise ValueError(f"layer {layer - 1}: the weight of key {key} -> query {query} is not finite "
                         f"({cone.cap[e]}) on a path into token {output}: the flows through it are unknown "
                         "and cannot be ranked")


def _solver(cone: Cone, flow_func: Optional[Callable]) -> Callable[[int], float]:
    """``solve(r)``: the max-flow from input ``levels[0][r]`` to the output, by SciPy or ``flow_func``."""
    sink = cone.num_nodes - 1
    if flow_func is None:
        network = Network(cone.num_nodes, cone.src, cone.dst, cone.cap)
        return lambda r: network.max_flow(r, sink)
    graph, names = cone.to_networkx(), [(0, j) for j in cone.levels[0].tolist()]
    state = {"residual": None}  # networkx's residual network, built once and reused

    def solve(r: int) -> float:
        state["residual"] = flow_func(graph, names[r], (len(cone.levels) - 1, int(cone.levels[-1])),
                                      residual=state["residual"], value_only=True)
        return state["residual"].graph["flow_value"]

    return solve


def _prepare(attention, output, head, residual, num_nodes) -> Tuple[int, int, List[csr_matrix]]:
    layers = as_layers(attention)
    n = count_nodes(layers, num_nodes)
    if isinstance(output, bool) or not isinstance(output, int) or not -n <= output < n:
        raise ValueError(f"output must be a token index in [0, {n}) (got {output!r})")
    matrices = [layer_csr(ei, alpha, n, head=head, residual=residual) for ei, alpha in layers]
    return n, output % n, matrices


def flow_cone(matrices: Sequence[csr_matrix], output: int) -> Cone:
    """The :class:`Cone` of ``(L, output)``: the layered graph of the nodes that reach it.

    ``matrices`` are the layers' ``[N, N]`` matrices (:func:`~tgattn.analysis.weights.layer_csr`,
    rows = queries i), first layer first; edge ``(l-1, j) -> (l, i)`` gets ``capacity =
    matrices[l-1][i, j]``; zero entries are left out (they carry no flow), NaN ones kept.
    """
    current = np.array([output])
    levels, edges = [current], []
    for layer in range(len(matrices), 0, -1):
        matrix = matrices[layer - 1]
        starts, counts = matrix.indptr[current], np.diff(matrix.indptr)[current]
        pos = np.repeat(starts - np.cumsum(counts) + counts, counts) + np.arange(counts.sum())  # the rows' entries
        keep = ~(matrix.data[pos] <= 0)  # NaN kept: a flow through it is unknown, not 0
        rows, cols, caps = np.repeat(current, counts)[keep], matrix.indices[pos][keep], matrix.data[pos][keep]
        below = np.unique(cols)
        edges.insert(0, (layer, np.searchsorted(below, cols), np.searchsorted(current, rows), caps))
        current = below
        levels.insert(0, current)
    offsets = np.cumsum([0] + [len(level) for level in levels])
    src = np.concatenate([offsets[l - 1] + j for l, j, _, _ in edges])
    dst = np.concatenate([offsets[l] + i for l, _, i, _ in edges])
    cap = np.concatenate([c for _, _, _, c in edges]).astype(np.float64)
    layer = np.concatenate([np.full(len(c), l) for l, _, _, c in edges])
    return Cone([torch.from_numpy(level.astype(np.int64)) for level in levels], offsets, src, dst, cap, layer)
