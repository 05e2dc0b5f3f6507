"""Validation of user edge sets: every path into the engine's kernels goes through here."""
from __future__ import annotations

import torch
from torch import Tensor


def check_edge_index(edge_index: Tensor, num_keys: int, num_queries: int, *, ranges: bool = True) -> Tensor:
    """Validate an edge set against node counts and return it as ``torch.long``.

    ``ranges=False`` checks the type, shape and dtype only, for a caller whose next pass over
    the edges checks every node id itself (:func:`check_ranges` then names a bad one).

    Raises:
        TypeError: when ``edge_index`` is not a tensor.
        ValueError: naming the bad shape, dtype or node id.

    Example:
        >>> check_edge_index(torch.tensor([[0, 1], [1, 1]]), 2, 2).tolist()
        [[0, 1], [1, 1]]
        >>> check_edge_index(torch.tensor([[0, 5], [1, 1]]), 2, 2)
        Traceback (most recent call last):
        ...
        ValueError: edge_index refers to key/source node 5, but there are 2 key nodes
    """
    if not isinstance(edge_index, Tensor):
        raise TypeError(f"edge_index must be a torch.Tensor (got {type(edge_index).__name__})")
    if edge_index.dim() != 2 or edge_index.shape[0] != 2:
        raise ValueError(f"edge_index must have shape [2, E] (got {list(edge_index.shape)})")
    if edge_index.dtype not in (torch.long, torch.int32):
        raise ValueError(f"edge_index must be an integer tensor of dtype torch.long (got {edge_index.dtype})")
    edge_index = edge_index.long()
    if ranges:
        check_ranges(edge_index, num_keys, num_queries)
    return edge_index


def check_ranges(edge_index: Tensor, num_keys: int, num_queries: int) -> None:
    """Raise a ValueError naming a node id of ``edge_index [2, E]`` outside ``[0, num_keys)`` (sources)
    or ``[0, num_queries)`` (targets): one pass over the edges, a second only when one may be out."""
    if edge_index.numel():
        lo, hi = (int(m) for m in torch.aminmax(edge_index))
        if lo < 0:
            raise ValueError(f"edge_index holds the negative node id {lo}")
        if hi < min(num_keys, num_queries):
            return
        src_max, dst_max = (int(m) for m in edge_index.max(dim=1).values)  # which row is out of range
        if src_max >= num_keys:
            raise ValueError(f"edge_index refers to key/source node {src_max}, but there are {num_keys} key nodes")
        if dst_max >= num_queries:
            raise ValueError(f"edge_index refers to query/target node {dst_max}, but there are {num_queries} query nodes")


def check_device(name: str, t: Tensor, q: Tensor) -> None:
    """Raise a ValueError naming ``name`` and its device when tensor ``t`` is not on ``q``'s device (the kernels
    read every tensor of a call on one device; a meta tensor holds no values to read).

    Example:
        >>> check_device("edge_key features", torch.zeros(2, device="meta"), torch.zeros(2))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: edge_key features is on the meta device, but q is on cpu: ...
    """
    if t.device != q.device:
        raise ValueError(f"{name} is on the {t.device} device, but q is on {q.device}: every tensor of the call "
                         f"must be on q's device")
