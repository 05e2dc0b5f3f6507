"""The peers of the GPU suite, each built for one case's inputs (:class:`Inputs`).

* ``tc``: :func:`tgattn.functional.graph_attention` with ``backend="tc"`` (tiles on tensor cores
  and the gathered remainder);
* ``triton``: the same function with ``backend="triton"``, the gather path;
* ``flex``: compiled FlexAttention with the case's own ``mask_mod`` and ``create_block_mask``;
* ``flex_edges``: compiled FlexAttention with the ``BlockMask`` built from the edge set
  (:func:`tgattn.engine.triton.flex.block_mask`: full and partial 128 x 128 tiles, a bitmask each);
* ``sdpa_mask``: ``scaled_dot_product_attention`` with the boolean mask of the edge set;
* ``sdpa_dense``: ``scaled_dot_product_attention`` without a mask, over all ``n**2`` pairs (the
  all-pairs line; ``is_causal`` on the causal set, which it then equals).

A peer's :class:`Built` holds its call and, apart, ``setup``: the work it does for a new edge set
before its kernel (tgattn: preparing the set and planning its tiles; Flex: creating its block
mask; SDPA: the boolean mask), timed on its own by the suite. Grouped-query cases give SDPA and
Flex ``enable_gqa``; tgattn's paths take the grouped heads in one call of ``graph_attention``
(``k``, ``v`` with ``kv_heads`` heads, as :mod:`tgattn.hf` passes them), which the row's note says.
A peer that cannot run here raises :class:`NotAvailable` with the reason.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .gpu_cases import Case
from .peers import _heads_first, require_backend

SUITE_PEERS = ("tc", "triton", "flex", "flex_edges", "sdpa_mask", "sdpa_dense")
FLEX_PEERS = ("flex", "flex_edges")
GROUPED = "grouped heads in one call"  # the note of a tgattn peer that took grouped-query heads so


class NotAvailable(Exception):
    """A peer that cannot run in this process; the message says why."""


@dataclass
class Inputs:
    """One case's inputs: ``q [n, heads, d]``, ``k``, ``v [n, kv_heads, d]`` (leaves), the edge
    list, what tgattn's peers take for it (``edges``: a prepared ``EdgeSet`` or the list itself),
    and ``flex``, the ``flex_attention`` to call (compiled on a GPU, eager in a dry run)."""

    case: Case
    edge_index: Tensor
    edges: object
    q: Tensor
    k: Tensor
    v: Tensor
    flex: Callable
    prepare: Optional[Callable[[], object]] = None  # a new edge set's analysis and tile plan (the tc path's setup)
    flex_options: Dict[str, dict] = field(default_factory=dict)  # Flex peer -> its kernel_options (none: Inductor's)


@dataclass
class Built:
    """A peer ready to run: ``call()`` returns its output; ``setup()`` redoes what a new edge set
    costs it before its kernel; ``backward``: whether it has a backward here."""

    call: Callable[[], Tensor]
    setup: Optional[Callable[[], object]] = None
    note: str = ""
    backward: bool = True


def _graph_attention(x: Inputs, backend: str) -> Built:
    from ..functional import graph_attention

    try:
        require_backend(backend, x.q)
    except ValueError as err:
        raise NotAvailable(str(err)) from None
    from ..engine import analyse

    q, k, v, edges = x.q, x.k, x.v, x.edges
    # a new edge set costs the gather path its analysis, the tc path the tile plan too
    setup = x.prepare if backend == "tc" else (lambda: analyse(x.edge_index, x.case.n, x.case.n))
    one = lambda: graph_attention(q, k, v, edges, backend=backend)  # noqa: E731  (grouped heads: k, v as they are)
    return Built(one, setup, note=GROUPED if x.case.groups > 1 else "")


def tc(x: Inputs) -> Built:
    return _graph_attention(x, "tc")


def triton(x: Inputs) -> Built:
    return _graph_attention(x, "triton")


def _flex(x: Inputs, peer: str, block_mask, setup: Callable, note: str = "") -> Built:
    leaves = (x.q, x.k, x.v) if x.q.is_cuda else (x.q.detach(), x.k.detach(), x.v.detach())  # a CPU refuses grad inputs
    qh, kh, vh = _heads_first(*leaves)
    kwargs = {"enable_gqa": True} if x.case.groups > 1 else {}
    options = x.flex_options.get(peer)
    if options:
        kwargs["kernel_options"] = options
    notes = [note, f"kernel_options {options}" if options else "",
             "" if x.q.is_cuda else "FlexAttention has no backward on a CPU"]
    return Built(lambda: x.flex(qh, kh, vh, block_mask=block_mask, **kwargs), setup, "; ".join(filter(None, notes)),
                 backward=x.q.is_cuda)


def flex(x: Inputs) -> Built:
    if x.case.mask_mod is None:
        raise NotAvailable("no simple mask_mod states this set (flex_edges runs Flex on the edge set)")
    from torch.nn.attention.flex_attention import create_block_mask

    n, device = x.case.n, x.q.device
    mask_mod = x.case.mask_mod(device)
    # Eager create_block_mask evaluates every pair (8 bytes each: 128 GiB at n = 131,072 on an H100);
    # compiled, it does not hold them.
    fits = 8.0 * n * n <= (0.75 * torch.cuda.get_device_properties(device).total_memory if x.q.is_cuda else 2**31)
    make = lambda: create_block_mask(mask_mod, None, None, n, n, device=str(device), _compile=not fits)  # noqa: E731
    return _flex(x, "flex", make(), make, "" if fits else "create_block_mask(_compile=True)")


def flex_edges(x: Inputs) -> Built:
    from ..engine import analyse
    from ..engine.triton.flex import block_mask

    n = x.case.n

    def make():
        s = analyse(x.edge_index, n, n)
        if s.duplicates:
            raise NotAvailable("the edge set has duplicated edges, which a BlockMask counts once")
        return block_mask(s)

    return _flex(x, "flex_edges", make(), make)


def _sdpa(x: Inputs, **kwargs) -> Callable[[], Tensor]:
    qh, kh, vh = _heads_first(x.q, x.k, x.v)
    if x.case.groups > 1:
        kwargs["enable_gqa"] = True
    return lambda: F.scaled_dot_product_attention(qh, kh, vh, **kwargs)


def sdpa_mask(x: Inputs) -> Built:
    from .. import builders

    make = lambda: builders.to_mask(x.edge_index, x.case.n, x.case.n)  # noqa: E731
    return Built(_sdpa(x, attn_mask=make()), make)


def sdpa_dense(x: Inputs) -> Built:
    return Built(_sdpa(x, is_causal=x.case.causal), note="is_causal" if x.case.causal else "all pairs")


def build(name: str, x: Inputs) -> Built:
    """The peer ``name`` (one of :data:`SUITE_PEERS`) for inputs ``x``.

    Raises:
        NotAvailable: the peer cannot run here (the message says why).
    """
    return {"tc": tc, "triton": triton, "flex": flex, "flex_edges": flex_edges, "sdpa_mask": sdpa_mask,
            "sdpa_dense": sdpa_dense}[name](x)
