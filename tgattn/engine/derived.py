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
        entry = self.lookup(edge_index, key)
        if entry is not None:
            witness, value = entry  # a stamp (GPU) or a copy of the contents (CPU)
            if isinstance(witness, Tensor):
                if witness.shape == edge_index.shape and torch.equal(witness, edge_index):
                    return value
            elif witness == device_stamp(edge_index):
                return value
        value = make()
        stamp = device_stamp(edge_index)
        self.store(edge_index, key, (edge_index.detach().clone() if stamp is None else stamp, value))
        return value


DERIVED = DerivedEdges()
