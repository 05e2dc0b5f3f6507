"""Edge sets derived from an edge set (self-loops added, ...), made once per input edge set.

A layer that changes the edges it is given (``add_self_loops=True``) would otherwise build a
new tensor on every call, and every call would miss the engine's analysis cache. Here the
derived tensor is kept per input tensor, and handed out again only while the input still
holds the same edges (checked on every hit as the analysis cache does: by contents on the
CPU, by :func:`~tgattn.engine.analysis.device_stamp` on a GPU, without a host sync), so the
layers of a model share one derived edge set and one analysis.
"""
from __future__ import annotations

from typing import Callable, Hashable

import torch
from torch import Tensor

from .analysis import TensorKeyed, device_stamp


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
        entry = self.lookup(edge_index, key, _same_as_copy)
        if entry is not None:
            return entry[1]
        value = make()
        # A copy of the edges to compare with where no stamp can tell (the CPU); none on a GPU.
        copy = edge_index.detach().clone() if device_stamp(edge_index) is None else None
        self.store(edge_index, key, (copy, value))
        return value


def _same_as_copy(edge_index: Tensor, entry) -> bool:
    copy = entry[0]
    return copy.shape == edge_index.shape and torch.equal(copy, edge_index)


DERIVED = DerivedEdges()
