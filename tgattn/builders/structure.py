"""Structural views of an edge set: density, degrees, and the receptive field over layers."""
from __future__ import annotations

from typing import Dict, NamedTuple, Optional

import torch
from torch import Tensor

from ._common import Sizes, check_count, sort_unique, total_nodes


def _square(edge_index: Tensor, n: Optional[Sizes]) -> int:
    n = total_nodes(n) if n is not None else (int(edge_index.max()) + 1 if edge_index.numel() else 0)
    if edge_index.numel() and int(edge_index.max()) >= n:
        raise ValueError(f"edge_index refers to node {int(edge_index.max())}, but n = {n}")
    return n


def density(edge_index: Tensor, n_q: Sizes, n_k: Optional[Sizes] = None) -> float:
    """Fraction of the ``n_q * n_k`` (query, key) pairs that are edges (duplicates count once).

    For a packed batch pass the lengths: the denominator is ``N**2`` for ``N = sum(lengths)``.

    Example:
        >>> from tgattn import builders
        >>> density(builders.causal(4), 4)
        0.625
    """
    n_q = total_nodes(n_q)
    n_k = n_q if n_k is None else total_nodes(n_k)
    edges = sort_unique(edge_index, n_k).shape[1]
    return edges / (n_q * n_k) if n_q * n_k else 0.0


class Degrees(NamedTuple):
    """Keys seen by each query (in-degree) and queries reached by each key (out-degree)."""

    keys_per_query: Tensor  # [Nq]
    queries_per_key: Tensor  # [Nk]

    def summary(self) -> Dict[str, Dict[str, float]]:
        """``{"keys_per_query": {"min", "mean", "max"}, "queries_per_key": {...}}``."""
        def stats(d: Tensor) -> Dict[str, float]:
            if d.numel() == 0:
                return {"min": 0.0, "mean": 0.0, "max": 0.0}
            return {"min": float(d.min()), "mean": float(d.double().mean()), "max": float(d.max())}

        return {"keys_per_query": stats(self.keys_per_query), "queries_per_key": stats(self.queries_per_key)}


def degree(edge_index: Tensor, n_q: Sizes, n_k: Optional[Sizes] = None) -> Degrees:
    """In- and out-degrees of an edge set (duplicates count once); see :class:`Degrees`.

    Example:
        >>> from tgattn import builders
        >>> d = degree(builders.window(6, 1), 6)
        >>> d.keys_per_query.tolist()
        [2, 3, 3, 3, 3, 2]
        >>> d.summary()["keys_per_query"]["max"]
        3.0
    """
    n_q = total_nodes(n_q)
    n_k = n_q if n_k is None else total_nodes(n_k)
    src, dst = sort_unique(edge_index, n_k)
    return Degrees(torch.bincount(dst, minlength=n_q), torch.bincount(src, minlength=n_k))


def receptive_field(edge_index: Tensor, n: Optional[Sizes] = None, layers: int = 1) -> Tensor:
    """Which keys can influence each query after ``layers`` layers of the same pattern: ``[N, N]`` bool.

    ``reach[i, j]`` is True when there is a path ``j -> ... -> i`` of at most ``layers``
    edges. A transformer block adds its attention output to the residual stream, so a
    token never loses its own information: the count starts from the identity (0 layers)
    and each layer maps ``R`` to ``R | A R`` (``A[i, j]`` = edge ``j -> i``). Rows = queries i,
    columns = keys j. Cost ``O(layers * E * N)`` (sparse times dense).

    Args:
        edge_index: ``LongTensor[2, E]``; row 0 = key j, row 1 = query i.
        n: number of nodes, or the lengths of a packed batch (default: largest id + 1).
        layers: number of stacked layers, ``>= 0``.

    Example:
        >>> from tgattn import builders
        >>> reach = receptive_field(builders.window(7, 1), 7, layers=2)
        >>> reach[3].long().tolist()  # two layers of radius 1 reach distance 2
        [0, 1, 1, 1, 1, 1, 0]
    """
    n = _square(edge_index, n)
    layers = check_count("layers", layers)
    reach = torch.eye(n, dtype=torch.bool, device=edge_index.device)
    for _ in range(layers):
        reach = _step(edge_index, reach)
    return reach


def _step(edge_index: Tensor, reach: Tensor) -> Tensor:
    n = reach.shape[0]
    src, dst = edge_index
    adjacency = torch.sparse_coo_tensor(
        torch.stack([dst, src]), torch.ones(src.numel(), device=reach.device), (n, n), check_invariants=True
    )
    return reach | (torch.sparse.mm(adjacency, reach.float()) > 0)


def receptive_field_growth(edge_index: Tensor, n: Optional[Sizes] = None, max_layers: int = 8) -> Tensor:
    """Number of (query, key) pairs within reach after ``0, 1, ..., max_layers`` layers: ``[L + 1]``.

    Stops early (repeating the last value) once a layer adds nothing. Divide by ``N**2``
    (or by ``N (N + 1) / 2`` for a causal pattern) to get the covered fraction.

    Example:
        >>> from tgattn import builders
        >>> receptive_field_growth(builders.window(8, 1), 8, 4).tolist()
        [8, 22, 34, 44, 52]
    """
    n = _square(edge_index, n)
    max_layers = check_count("max_layers", max_layers)
    reach = torch.eye(n, dtype=torch.bool, device=edge_index.device)
    counts = [int(reach.sum())]
    for _ in range(max_layers):
        if len(counts) > 1 and counts[-1] == counts[-2]:
            counts.append(counts[-1])
            continue
        reach = _step(edge_index, reach)
        counts.append(int(reach.sum()))
    return torch.tensor(counts)
