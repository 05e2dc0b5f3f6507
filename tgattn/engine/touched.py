"""Calls whose edges touch few of many keys run on the touched keys alone, so that memory follows the edges.

Several backends hold arrays of one entry per declared key: the backward's transposed pattern
(``colptr [n_k + 1]``), the key and value gradients ``[n_k, H, d]`` the fused kernel writes, the
head-major copies of ``k`` and ``v`` the CSR kernels read. A call with a few edges among very many
keys (16 queries over ``3e9`` keys given as an expanded view, 10 edges) then asked for 12 GB
(fused, auto) or 96 GB (csr) where the edges need kilobytes. Where the keys outnumber the edges
``KEYS_PER_EDGE`` times, the call runs on ``k[touched]`` and ``v[touched]`` (the sorted distinct keys
of the edges) over the edges renumbered into them; autograd takes the gradients back to ``k`` and
``v`` (a gradient the size of ``k`` only where ``k`` requires one, as its shape demands).
"""
from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from .analysis import Structure, with_keys

# Keys per edge above which a call runs on its touched keys: below it the arrays per key are no
# larger than those per edge (a self-attention set has E >= n_k), and the gather would be a copy
# of nearly all of k and v for nothing.
KEYS_PER_EDGE = 4


def on_touched_keys(s: Structure, k: Tensor, v: Tensor) -> Tuple[Structure, Tensor, Tensor]:
    """``(s, k, v)`` over the keys the edges touch where they are few (see the module), else as given.

    The renumbered structure is kept with ``s`` (:meth:`~tgattn.engine.analysis.Structure.memo`: one
    ``unique`` over the edges per edge set, also when threads ask at once).

    Example:
        >>> from tgattn.engine.analysis import analyse
        >>> k = v = torch.zeros(1, 1, 4).expand(10**12, 1, 4)  # a trillion keys, no memory
        >>> s, k2, v2 = on_touched_keys(analyse(torch.tensor([[5, 10**11], [0, 1]]), 2, 10**12), k, v)
        >>> s.n_k, s.src.tolist(), k2.shape
        (2, [0, 1], torch.Size([2, 1, 4]))
    """
    if s.n_k <= KEYS_PER_EDGE * s.num_edges:
        return s, k, v
    keys, touched = s.memo("touched_keys", lambda: _renumbered(s))
    return touched, k.index_select(0, keys), v.index_select(0, keys)


def _renumbered(s: Structure) -> Tuple[Tensor, Structure]:
    """``(keys [K], s over them)``: the sorted distinct keys of the edges and ``s`` renumbered into them."""
    keys, local = torch.unique(s.src, sorted=True, return_inverse=True)  # [K], [E]: renumbering keeps the order
    return keys, with_keys(s, local, keys.numel())
