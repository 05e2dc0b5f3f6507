"""Exphormer's edge sets: a random regular expander, virtual nodes, and their union with a graph.

Shirzad, Velingker, Venkatachalam, Sutherland, Sinop, "Exphormer: Sparse Transformers for
Graphs", ICML 2023 (https://arxiv.org/abs/2303.06147). Exphormer attends over the graph's own
edges, the edges of a random regular expander on the same nodes, and edges to a few virtual
nodes per graph; all three are builders here, and :func:`exphormer` is their union.
"""
from __future__ import annotations

from typing import List, Optional

import torch
from torch import Tensor

from ._common import Sizes, as_lengths, check_count, sort_unique


def _lengths(n: Sizes) -> List[int]:
    lengths = as_lengths(n)
    return [int(n)] if lengths is None else lengths


def expander(n: Sizes, degree: int, *, generator: Optional[torch.Generator] = None, device=None) -> Tensor:
    """A random ``degree``-regular expander on the nodes of each graph (both directions).

    Rows = queries i, columns = keys j; rule: ``j = p(i)`` or ``i = p(j)`` for one of
    ``degree / 2`` uniform random permutations ``p`` of the graph's nodes, and ``j != i``.
    The permutation model of random regular graphs: Friedman ("A proof of Alon's second
    eigenvalue conjecture", 2008) shows that its second adjacency eigenvalue is at most
    ``2 sqrt(degree - 1) + eps`` with high probability, i.e. a near-Ramanujan expander;
    Exphormer's ``Random-d`` construction draws its expander this way. The union of the
    permutations is a ``degree``-regular multigraph; the edge set keeps each pair once and
    drops self-loops, so a node has at most ``degree`` neighbours (fewer only where two
    permutations coincide, rarely once ``L >> degree``). The set is symmetric.

    The draw: for each of the ``degree / 2`` rounds, one ``torch.rand(N, dtype=float64)``
    from ``generator``; node ``p(i)`` is the node at the rank of ``i`` when the nodes of
    ``i``'s graph are sorted by their numbers. Deterministic for a given generator state;
    each graph of a packed batch gets its own permutations.

    Args:
        n: number of nodes, or the node counts of a packed batch of graphs (block-diagonal).
        degree: neighbours per node, even, ``>= 0`` (Exphormer's ``exp_deg = d`` is ``2 d``).
        generator: the ``torch.Generator`` to draw from (default: torch's global one).
        device: where to put the edges (the draw happens on the generator's device).

    Example:
        >>> from tgattn.builders import draw
        >>> e = expander(6, 2, generator=torch.Generator().manual_seed(0))
        >>> print(draw(e))
        . . x . . x
        . . x . x .
        x x . . . .
        . . . . x x
        . x . x . .
        x . . x . .
        >>> bool((draw(e) == draw(e.flip(0))))  # symmetric
        True
    """
    degree = check_count("degree", degree)
    if degree % 2:
        raise ValueError(f"degree must be even: the expander is a union of degree / 2 permutations (got {degree})")
    lengths = _lengths(n)
    total = sum(lengths)
    if total == 0 or degree == 0:
        return torch.empty(2, 0, dtype=torch.long, device=device)
    gen_device = generator.device if generator is not None else torch.device("cpu")
    sizes = torch.tensor(lengths)
    graph = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.float64), sizes)  # [N]
    nodes = torch.arange(total)
    parts = []
    for _ in range(degree // 2):
        u = torch.rand(total, generator=generator, dtype=torch.float64, device=gen_device).cpu()  # [N]
        perm = torch.argsort(graph + u, stable=True)  # [N]: graph blocks keep their place, shuffled inside
        parts += [torch.stack([perm, nodes]), torch.stack([nodes, perm])]
    edges = torch.cat(parts, dim=1)
    edges = edges[:, edges[0] != edges[1]]
    return sort_unique(edges, total).to(device)


def virtual_nodes(n: Sizes, k: int = 1, *, device=None) -> Tensor:
    """``k`` virtual nodes per graph, each joined to every node of its graph, both directions.

    Numbering: the ``N = sum(L)`` real nodes keep their numbers and the virtual nodes come
    after all of them, graph by graph: virtual node ``t`` of graph ``b`` is
    ``N + b * k + t``. So ``torch.cat([x, x_virtual])`` lines features up with the edges and
    ``out[:N]`` are the real nodes. Rows = queries i, columns = keys j; rule: ``i`` and ``j``
    in the same graph and exactly one of them virtual. No edges between virtual nodes, no
    self-loops. Edges: ``2 k N``. A virtual node of an empty graph has no edges.
    Virtual nodes go back to Gilmer et al., "Neural Message Passing for Quantum Chemistry",
    ICML 2017; Exphormer attends through them (Shirzad et al., 2023).

    Args:
        n: number of nodes, or the node counts of a packed batch of graphs.
        k: virtual nodes per graph, ``>= 0``.
        device: where to build the edges.

    Example:
        >>> from tgattn.builders import draw
        >>> print(draw(virtual_nodes([2, 1], 1)))  # real nodes 0..2, virtual nodes 3 and 4
        . . . x .
        . . . x .
        . . . . x
        x x . . .
        . . x . .
    """
    k = check_count("k", k)
    lengths = _lengths(n)
    total = sum(lengths)
    sizes = torch.tensor(lengths, dtype=torch.long)
    graph = torch.repeat_interleave(torch.arange(len(lengths)), sizes)  # [N]
    real = torch.arange(total).repeat_interleave(k)  # [N k]
    virtual = total + graph.repeat_interleave(k) * k + torch.arange(k).repeat(total)  # [N k]
    edges = torch.cat([torch.stack([virtual, real]), torch.stack([real, virtual])], dim=1)
    return sort_unique(edges, total + len(lengths) * k).to(device)


def exphormer(
    edge_index: Tensor,
    n: Sizes,
    degree: int,
    *,
    num_virtual: int = 1,
    generator: Optional[torch.Generator] = None,
    device=None,
) -> Tensor:
    """Exphormer's attention edges: graph edges, expander, virtual nodes and self-loops.

    The union ``edge_index | expander(n, degree) | virtual_nodes(n, num_virtual) | self-loops``
    on ``N + B * num_virtual`` nodes (virtual nodes numbered as in :func:`virtual_nodes`;
    every node, virtual ones included, gets a self-loop; Exphormer's code adds them to the
    real nodes). Rows = queries i, columns = keys j. Exphormer normalises its scores as
    ``exp(clamp(s, -5, 5)) / (sum + 1e-6)`` (``graphgps/layer/Exphormer.py`` of its code);
    tgattn attends over the same edges with the exact softmax. Use
    :func:`tgattn.builders.membership` to tell the kinds of edges apart.

    Args:
        edge_index: the graph's edges ``[2, E]`` on the ``N`` real nodes (row 0 = source j).
        n: number of nodes, or the node counts of a packed batch of graphs.
        degree: expander degree (even; see :func:`expander`).
        num_virtual: virtual nodes per graph (default: 1).
        generator: the ``torch.Generator`` for the expander (default: torch's global one).
        device: where to put the edges.

    Example:
        >>> from tgattn.builders import draw
        >>> path = torch.tensor([[0, 1, 1, 2], [1, 0, 2, 1]])
        >>> print(draw(exphormer(path, 3, 0)))  # degree 0: the graph, self-loops, node 3 virtual
        x x . x
        x x x x
        . x x x
        x x x x
    """
    lengths = _lengths(n)
    total = sum(lengths)
    if edge_index.dim() != 2 or edge_index.shape[0] != 2:
        raise ValueError(f"edge_index must have shape [2, E] (got {list(edge_index.shape)})")
    if edge_index.numel() and int(edge_index.max()) >= total:
        raise ValueError(f"edge_index refers to node {int(edge_index.max())}, but the graphs have {total} nodes")
    size = total + len(lengths) * check_count("num_virtual", num_virtual)
    loops = torch.arange(size).expand(2, size)
    parts = [edge_index.long().cpu(), expander(n, degree, generator=generator), virtual_nodes(n, num_virtual), loops]
    return sort_unique(torch.cat(parts, dim=1), size).to(device)
