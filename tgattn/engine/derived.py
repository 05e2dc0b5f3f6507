"""Edge sets derived from an edge set (self-loops added, ...), made once per input edge set.

A layer that changes the edges it is given (``add_self_loops=True``) would otherwise build a
new tensor on every call, and every call would miss the engine's analysis cache. Here the
derived tensor is kept per input tensor, and handed out again only while the input still
holds the same edges (compared in full on every hit, as the analysis cache does), so the
layers of a model share one derived edge set and one analysis.
"""
from __future__ import annotations

from typing import Callable, Hashable

import torch
from torch import Tensor

from .analysis import TensorKeyed


class DerivedEdges(TensorKeyed):
    """``get(edge_index, key, make)``: ``make()``'s result for this input tensor and ``key``, cached.

    Example:
        >>> cache = DerivedEdges()
        >>> ei = torch.tensor([[0, 1], [1, 0]])
        >>> a = cache.get(ei, "flip", lambda: ei.flip(0))
        >>> a is cache.get(ei, "flip", lambda: ei.flip(0))
        True
        >>> ei[0, 0] = 1  # changed in place: made again
        >>> cache.get(ei, "flip", lambda: ei.flip(0)).tolist()
        [[1, 0], [1, 1]]
    """

    def get(self, edge_index: Tensor, key: Hashable, make: Callable[[], object]):
        entry = self.lookup(edge_index, key)
        if entry is not None:
            snapshot, value = entry
            if snapshot.shape == edge_index.shape and torch.equal(snapshot, edge_index):
                return value
        value = make()
        self.store(edge_index, key, (edge_index.detach().clone(), value))
        return value


DERIVED = DerivedEdges()
