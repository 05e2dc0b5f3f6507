"""Attention flow: maximum flow from each input token to an output token through the layers."""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple, Union

import networkx as nx
import torch
from torch import Tensor
from tqdm import tqdm

from ..builders._common import check_count
from .weights import Head, Layer, as_layers, count_nodes, layer_matrix


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

    How it is computed, and what can and cannot be shared:

    * Only the *cone* of the output is built: the nodes from which ``(L, output)`` can be
      reached (walked backwards through the sparse layers). Every ``(0, j) -> (L, output)``
      path lies in it, so the values are exact; inputs outside it get 0 without a flow.
    * The cone and networkx's residual network are built **once per output** and reused
      for all its inputs.
    * One max-flow **per input** is still needed. Each input's value is its own min cut;
      inputs compete for the same edges, so a single flow from a super-source joined to all
      inputs gives only the *total* (at most the sum of the per-input values) and any split
      of it into per-input shares is arbitrary, not each input's maximum flow. No exact
      single-sink/all-sources shortcut exists for directed graphs in networkx (Gomory–Hu
      trees need undirected graphs).

    Cost: for ``window(n, w)`` and L layers, away from the sequence ends, the cone has
    :math:`V = (L + 1)(L w + 1)` nodes and :math:`E = (2w + 1)(L + w L (L - 1))` edges,
    whatever n is, and one output needs ``2 L w + 1`` max-flows on it (Edmonds–Karp:
    :math:`O(V E^2)` each; the default Boykov–Kolmogorov has no better worst-case bound but
    is faster on these graphs). It is pure Python; measured here
    (``python -m tgattn.bench.influence``, L = 4): w = 8, a cone of 1,700 edges, about 1 s
    per output; w = 16, 6,500 edges, about 12 s; cones of 10^5 edges (w = 64) are impractical. Full or causal patterns make the cone the whole graph: there a few hundred
    tokens is the limit. For a top-k question use :func:`top_flow`, which skips inputs.

    Args:
        attention: ``(edge_index, alpha)`` per layer, first layer first.
        output: the token whose inputs are measured (negative counts from the end).
        head: ``"mean"`` (default, as in the paper) or the index of one head.
        residual: mix each layer with the identity (default), else use raw attention.
        num_nodes: number of tokens (default: largest node id + 1).
        flow_func: a networkx max-flow function (default:
            :func:`networkx.algorithms.flow.boykov_kolmogorov`: 2.2x faster than networkx's
            default ``preflow_push`` on a ``window(512, 8)`` cone here, and equal to it within
            1e-15 on the tests' graphs; ``dinitz`` fails on float capacities).
        progress: show a tqdm bar over the inputs.

    Returns:
        ``float64`` tensor ``[N]``: the flow from each input token to ``output``.

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
    graph, levels = flow_cone(matrices, output)
    flow_func = flow_func or nx.algorithms.flow.boykov_kolmogorov
    sink = (len(matrices), output)
    values = torch.zeros(n, dtype=torch.float64)
    residual_network = None
    for j in tqdm(levels[0].tolist(), disable=not progress, desc=f"flow into token {output}"):
        residual_network = flow_func(graph, (0, j), sink, residual=residual_network, value_only=True)
        values[j] = residual_network.graph["flow_value"]
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
) -> Tuple[Tensor, Tensor]:
    """The ``k`` inputs with the largest :func:`attention_flow` into ``output``, with fewer max-flows.

    Every input j gets an upper bound first, the smallest capacity of a *layer cut*: all
    edges from layer l-1 to layer l that lie on a path ``(0, j) -> (L, output)`` (every such
    path crosses each layer once, so removing them separates j from the output; see
    :func:`flow_upper_bounds`). Inputs are then solved in decreasing order of bound, and the
    search stops once the next bound is below the k-th value found: the rest cannot enter
    the top k. The result equals sorting :func:`attention_flow` (tolerance 1e-12); on a
    ``window(512, 8)`` stack of 4 layers the top 8 needed 22 of the cone's 65 max-flows.

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
    graph, levels = flow_cone(matrices, output)
    bound = flow_upper_bounds(matrices, levels)  # [inputs]
    flow_func = flow_func or nx.algorithms.flow.boykov_kolmogorov
    sink = (len(matrices), output)
    found: List[Tuple[float, int]] = []  # (flow, token), best first, at most k
    residual_network = None
    for r in torch.sort(-bound, stable=True).indices.tolist():
        if len(found) == k and (k == 0 or float(bound[r]) < found[-1][0] - 1e-12):
            break
        j = int(levels[0][r])
        residual_network = flow_func(graph, (0, j), sink, residual=residual_network, value_only=True)
        found = sorted(found + [(residual_network.graph["flow_value"], j)], key=lambda p: (-p[0], p[1]))[:k]
    found = [(value, j) for value, j in found if value > 0]
    index = torch.tensor([j for _, j in found], dtype=torch.long)
    return index, torch.tensor([value for value, _ in found], dtype=torch.float64)


def flow_upper_bounds(matrices: Sequence[Tensor], levels: Sequence[Tensor]) -> Tensor:
    """For each input of a cone, the smallest capacity of the layer cuts on its paths.

    ``levels[l]`` are the tokens of layer l in the cone (from :func:`flow_cone`). The
    layer-l cut of input j: the total capacity of the edges ``(l-1, a) -> (l, b)`` with
    ``(l-1, a)`` reachable from ``(0, j)`` and ``(l, b)`` in the cone. Returns
    ``float64 [len(levels[0])]``, the minimum over l, an upper bound of the max-flow.
    """
    reach = torch.eye(len(levels[0]), dtype=torch.float64)  # [cone nodes of layer l, inputs]
    bound = torch.full((len(levels[0]),), float("inf"), dtype=torch.float64)
    for layer in range(1, len(matrices) + 1):
        sub = matrices[layer - 1].index_select(0, levels[layer]).index_select(1, levels[layer - 1]).to_dense()
        bound = torch.minimum(bound, sub.sum(0) @ reach)  # capacity leaving the reached nodes of layer l-1
        reach = ((sub > 0).double() @ reach > 0).double()
    return bound


def _prepare(attention, output, head, residual, num_nodes) -> Tuple[int, int, List[Tensor]]:
    layers = as_layers(attention)
    n = count_nodes(layers, num_nodes)
    if isinstance(output, bool) or not isinstance(output, int) or not -n <= output < n:
        raise ValueError(f"output must be a token index in [0, {n}) (got {output!r})")
    matrices = [layer_matrix(ei, alpha, n, head=head, residual=residual) for ei, alpha in layers]
    return n, output % n, matrices


def flow_cone(matrices: Sequence[Tensor], output: int) -> Tuple[nx.DiGraph, List[Tensor]]:
    """The layered graph of the nodes that reach ``(L, output)``, and its tokens per layer.

    ``matrices`` are sparse ``[N, N]`` layer matrices (rows = queries i), first layer first;
    edge ``(l-1, j) -> (l, i)`` gets ``capacity = matrices[l-1][i, j]``; zero entries are
    left out (they carry no flow). ``levels[l]`` (sorted tokens of layer l in the cone)
    ends with ``levels[L] = [output]``; ``levels[0]`` are the inputs that reach the output.
    """
    graph = nx.DiGraph()
    current = torch.tensor([output])
    levels = [current]
    graph.add_node((len(matrices), output))
    for layer in range(len(matrices), 0, -1):
        matrix = matrices[layer - 1]  # coalesced: entries sorted by row
        (row, col), val = matrix.indices(), matrix.values()
        crow = torch.zeros(matrix.shape[0] + 1, dtype=torch.long)
        crow[1:] = torch.cumsum(torch.bincount(row, minlength=matrix.shape[0]), 0)  # row i: crow[i]..crow[i+1]
        starts, ends = crow[current], crow[current + 1]
        counts = ends - starts  # [rows]
        pos = torch.repeat_interleave(starts - torch.cumsum(counts, 0) + counts, counts)
        pos = pos + torch.arange(int(counts.sum()))  # positions of the rows' entries in col / val
        rows = torch.repeat_interleave(current, counts)
        keep = val[pos] > 0
        rows, cols, caps = rows[keep].tolist(), col[pos][keep], val[pos][keep].tolist()
        graph.add_edges_from(
            ((layer - 1, j), (layer, i), {"capacity": c}) for i, j, c in zip(rows, cols.tolist(), caps)
        )
        current = torch.unique(cols)
        levels.insert(0, current)
    return graph, levels
