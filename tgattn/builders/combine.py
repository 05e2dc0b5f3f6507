"""Set algebra on edge sets: ``union``, ``intersection``, ``difference``, ``add_self_loops``, ``membership``.

Edge sets compose like the boolean masks they stand for (attention-gym's ``or_masks`` /
``and_masks``): ``to_mask(union(a, b)) == to_mask(a) | to_mask(b)``. Every result is sorted
by (target, source) without duplicates, whatever the order of the inputs.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ._common import Sizes, sort_unique, total_nodes


def _checked(edge_indices) -> list:
    if not edge_indices:
        raise ValueError("give at least one edge_index")
    for e in edge_indices:
        if not isinstance(e, Tensor) or e.dim() != 2 or e.shape[0] != 2:
            shape = list(e.shape) if isinstance(e, Tensor) else type(e).__name__
            raise ValueError(f"each edge_index must be a tensor of shape [2, E] (got {shape})")
        if e.numel() and int(e.min()) < 0:
            raise ValueError(f"edge_index holds the negative node id {int(e.min())}")
    return [e.long() for e in edge_indices]


def _num_keys(edge_indices) -> int:
    return max([int(e[0].max()) + 1 for e in edge_indices if e.numel()] + [1])


def _codes(edge_index: Tensor, num_keys: int) -> Tensor:
    return edge_index[1] * num_keys + edge_index[0]  # [E], one integer per (j, i)


def union(*edge_indices: Tensor) -> Tensor:
    """Edges found in any of the edge sets (mask ``a | b | ...``).

    Example:
        >>> from tgattn.builders import draw, global_tokens, window
        >>> print(draw(union(window(5, 1), global_tokens(5, [0]))))
        x x x x x
        x x x . .
        x x x x .
        x . x x x
        x . . x x
    """
    edge_indices = _checked(edge_indices)
    return sort_unique(torch.cat(edge_indices, dim=1), _num_keys(edge_indices))


def intersection(*edge_indices: Tensor) -> Tensor:
    """Edges found in every one of the edge sets (mask ``a & b & ...``).

    Example:
        >>> from tgattn.builders import causal, draw, window
        >>> print(draw(intersection(window(4, 1), causal(4))))
        x . . .
        x x . .
        . x x .
        . . x x
    """
    edge_indices = _checked(edge_indices)
    k = _num_keys(edge_indices)
    result = sort_unique(edge_indices[0], k)
    for other in edge_indices[1:]:
        result = result[:, torch.isin(_codes(result, k), _codes(other, k))]
    return result


def difference(a: Tensor, b: Tensor) -> Tensor:
    """Edges of ``a`` that are not in ``b`` (mask ``a & ~b``).

    Example:
        >>> from tgattn.builders import causal, draw, full
        >>> print(draw(difference(full(3), causal(3))))
        . x x
        . . x
        . . .
    """
    a, b = _checked((a, b))
    k = _num_keys((a, b))
    a = sort_unique(a, k)
    return a[:, ~torch.isin(_codes(a, k), _codes(b, k))]


def add_self_loops(edge_index: Tensor, n: Optional[Sizes] = None) -> Tensor:
    """``edge_index`` plus the self-loop ``(i, i)`` of every node ``i < n`` (no duplicates).

    Args:
        edge_index: ``LongTensor[2, E]``; row 0 = key j, row 1 = query i.
        n: number of nodes, or the lengths of a packed batch (default: largest node id + 1).

    Example:
        >>> from tgattn.builders import draw
        >>> print(draw(add_self_loops(torch.tensor([[0], [2]]), 3)))
        x . .
        . x .
        x . x
    """
    (edge_index,) = _checked((edge_index,))
    if n is None:
        n = int(edge_index.max()) + 1 if edge_index.numel() else 0
    n = total_nodes(n)
    if edge_index.numel() and int(edge_index.max()) >= n:
        raise ValueError(f"edge_index refers to node {int(edge_index.max())}, but n = {n}")
    loops = torch.arange(n, device=edge_index.device).expand(2, n)
    return union(edge_index, loops)


def membership(edge_index: Tensor, *parts: Tensor) -> Tensor:
    """For each edge, the index of the first of ``parts`` that holds it (``-1``: none of them).

    Tells apart the kinds of edges of a union, in the order of ``edge_index`` (e.g. graph
    edge / expander edge / virtual-node edge of :func:`tgattn.builders.exphormer`), so that a
    model can learn a score bias per kind.

    Example:
        >>> from tgattn.builders import causal, full
        >>> membership(full(2), causal(2), torch.tensor([[1], [0]]))
        tensor([0, 1, 0, 0])
    """
    (edge_index,) = _checked((edge_index,))
    parts = _checked(parts) if parts else []
    k = _num_keys([edge_index, *parts])
    codes = _codes(edge_index, k)
    label = torch.full_like(codes, -1)
    for index in reversed(range(len(parts))):  # earlier parts overwrite later ones
        label[torch.isin(codes, _codes(parts[index], k))] = index
    return label
