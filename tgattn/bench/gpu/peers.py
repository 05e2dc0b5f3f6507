"""The peers of the GPU suite, each built for one case's inputs (:class:`Inputs`).

* ``tc``: :func:`tgattn.functional.graph_attention` with ``backend="tc"`` (tiles on tensor cores
  and the gathered remainder), over ``tgattn.edgeset.prepare_band``'s set where the case is a band
  (no edge list: the plan from the rows' key ranges), else over ``tgattn.prepare``'s;
* ``triton``: the same function with ``backend="triton"``, the gather path;
* ``flex``: compiled FlexAttention with the case's own ``mask_mod`` and ``create_block_mask``;
* ``flex_edges``: compiled FlexAttention with the ``BlockMask`` built from the edge set
  (:func:`tgattn.engine.triton.flex.block_mask`: full and partial 128 x 128 tiles, a bitmask each);
* ``flex_fa4``: ``flex`` on FlexAttention's CuTe backend (FlashAttention-4's kernels,
  ``kernel_options={"BACKEND": "FLASH"}``), block-sparse on the same ``BlockMask``;
  ``flex_fa4_dense``: the same backend without a block mask (all ``n**2`` pairs, no block
  sparsity). Where this torch has no such backend or lacks its kernels (``flash_attn.cute``, the
  ``flash-attn-4`` package) the row says so;
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

from .cases import Case
from ..peers import _heads_first, require_backend

SUITE_PEERS = ("tc", "triton", "flex", "flex_edges", "flex_fa4", "flex_fa4_dense", "sdpa_mask", "sdpa_dense")
FLEX_PEERS = ("flex", "flex_edges", "flex_fa4", "flex_fa4_dense")
TRITON_FLEX_PEERS = ("flex", "flex_edges")  # Flex on Inductor's Triton kernel (its tile options apply)
FLASH_PEERS = ("flex_fa4", "flex_fa4_dense")  # Flex on its CuTe backend, compiled with static shapes
GROUPED = "grouped heads in one call"  # the note of a tgattn peer that took grouped-query heads so


class NotAvailable(Exception):
    """A peer that cannot run in this process; the message says why."""


@dataclass
class Inputs:
    """One case's inputs: ``q [n, heads, d]``, ``k``, ``v [n, kv_heads, d]`` (leaves), the edge
    list (``None`` for a band past the suite's list size), what tgattn's peers take for it
    (``edges``: ``tgattn.prepare``'s ``EdgeSet`` of the list; ``band_edges``: ``prepare_band``'s, for
    a band), and ``flex``, the ``flex_attention`` to call (compiled on a GPU, eager in a dry run)."""

    case: Case
    edge_index: Optional[Tensor]
    edges: object
    band_edges: object
    q: Tensor
    k: Tensor
    v: Tensor
    flex: Callable
    prepare: Optional[Callable[[], object]] = None  # a new edge set's analysis and tile plan (the tc path's setup)
    flex_options: Dict[str, dict] = field(default_factory=dict)  # Flex peer -> its kernel_options (none: Inductor's)
    # flex_attention for the FLASH backend: compiled with static shapes, since FLASH cannot inline a
    # mask_mod's captured int that dynamic shapes turn symbolic (torch's own NYI error); recompiles per size
    flash: Optional[Callable] = None


@dataclass
class Built:
    """A peer ready to run: ``call()`` returns its output; ``setup()`` redoes what a new edge set
    costs it before its kernel; ``backward``: whether it has a backward here."""

    call: Callable[[], Tensor]
    setup: Optional[Callable[[], object]] = None
    note: str = ""
    backward: bool = True


def _graph_attention(x: Inputs, backend: str) -> Built:
    from ...functional import graph_attention

    try:
        require_backend(backend, x.q)
    except ValueError as err:
        raise NotAvailable(str(err)) from None
    from ...engine import analyse

    banded = backend == "tc" and x.band_edges is not None
    if not banded and x.edges is None:
        raise NotAvailable(_unlisted(x))
    q, k, v, edges = x.q, x.k, x.v, x.band_edges if banded else x.edges
    # a new edge set costs the gather path its analysis, the tc path the tile plan too
    setup = x.prepare if backend == "tc" else (lambda: analyse(x.edge_index, x.case.n, x.case.n))
    one = lambda: graph_attention(q, k, v, edges, backend=backend)  # noqa: E731  (grouped heads: k, v as they are)
    notes = [GROUPED if x.case.groups > 1 else "",
             "over tgattn.prepare_band's EdgeSet (no edge list)" if banded else "over tgattn.prepare's EdgeSet"]
    return Built(one, setup, note="; ".join(filter(None, notes)))


def _unlisted(x: Inputs) -> str:
    return (f"no edge list at {x.band_edges.num_edges:,} edges (the suite makes none past 2^28: "
            "the set runs through prepare_band)")


def tc(x: Inputs) -> Built:
    return _graph_attention(x, "tc")


def triton(x: Inputs) -> Built:
    return _graph_attention(x, "triton")


def _flex(x: Inputs, peer: str, block_mask, setup: Optional[Callable], note: str = "", options=None) -> Built:
    leaves = (x.q, x.k, x.v) if x.q.is_cuda else (x.q.detach(), x.k.detach(), x.v.detach())  # a CPU refuses grad inputs
    qh, kh, vh = _heads_first(*leaves)
    kwargs = {"enable_gqa": True} if x.case.groups > 1 else {}
    options = options or x.flex_options.get(peer)
    if options:
        kwargs["kernel_options"] = options
    notes = [note, f"kernel_options {options}" if options else "",
             "" if x.q.is_cuda else "FlexAttention has no backward on a CPU"]
    attend = x.flash if peer in FLASH_PEERS and x.flash is not None else x.flex
    return Built(lambda: attend(qh, kh, vh, block_mask=block_mask, **kwargs), setup, "; ".join(filter(None, notes)),
                 backward=x.q.is_cuda)


def _case_block_mask(x: Inputs):
    """``(block_mask, make, note)``: the BlockMask of the case's own ``mask_mod``, how to make it again."""
    if x.case.mask_mod is None:
        raise NotAvailable("no simple mask_mod states this set (flex_edges runs Flex on the edge set)")
    from torch.nn.attention.flex_attention import create_block_mask

    n, device = x.case.n, x.q.device
    mask_mod = x.case.mask_mod(device)
    # Eager create_block_mask evaluates every pair (8 bytes each: 128 GiB at n = 131,072 on an H100);
    # compiled, it does not hold them.
    fits = 8.0 * n * n <= (0.75 * torch.cuda.get_device_properties(device).total_memory if x.q.is_cuda else 2**31)
    make = lambda: create_block_mask(mask_mod, None, None, n, n, device=str(device), _compile=not fits)  # noqa: E731
    return make(), make, "" if fits else "create_block_mask(_compile=True)"


def flex(x: Inputs) -> Built:
    return _flex(x, "flex", *_case_block_mask(x))


FLASH = {"BACKEND": "FLASH"}  # FlexAttention's CuTe (FlashAttention-4) kernels


def flash_backend_missing(q: Tensor) -> str:
    """Why FlexAttention's ``BACKEND="FLASH"`` cannot run inputs like ``q`` here (``""``: it can).

    Example:
        >>> print(flash_backend_missing(torch.zeros(1)))  # doctest: +ELLIPSIS
        FlexAttention's FLASH backend runs on CUDA ...
    """
    import importlib.util

    from torch.nn.attention import flex_attention as fa

    if "BACKEND" not in getattr(fa, "FlexKernelOptions", dict).__annotations__:
        return f"torch {torch.__version__}'s flex_attention has no BACKEND kernel option (FLASH came later)"
    if not q.is_cuda or torch.cuda.get_device_capability(q.device)[0] not in (9, 10):
        return "FlexAttention's FLASH backend runs on CUDA (sm_90 / sm_100) only"
    if importlib.util.find_spec("flash_attn") is None or importlib.util.find_spec("flash_attn.cute") is None:
        return (f"torch {torch.__version__}'s BACKEND='FLASH' needs flash_attn.cute (pip flash-attn-4 and "
                "nvidia-cutlass-dsl), not installed here")
    return ""


def flex_fa4(x: Inputs) -> Built:
    missing = flash_backend_missing(x.q)
    if missing:
        raise NotAvailable(missing)
    block_mask, make, note = _case_block_mask(x)
    return _flex(x, "flex_fa4", block_mask, make, "; ".join(filter(None, ["block-sparse", note])), options=FLASH)


def flex_fa4_dense(x: Inputs) -> Built:
    missing = flash_backend_missing(x.q)
    if missing:
        raise NotAvailable(missing)
    return _flex(x, "flex_fa4_dense", None, None, "no block mask: all pairs", options=FLASH)


def flex_edges(x: Inputs) -> Built:
    from ...engine import analyse
    from ...engine.triton.flex import block_mask

    n = x.case.n
    if x.edge_index is None:
        raise NotAvailable(_unlisted(x))

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
    from ... import builders

    if x.edge_index is None:  # a band without its list: the mask from the rows' key ranges
        from ...engine.bands import row_ranges

        def make():
            first, last = row_ranges(x.case.band, x.case.n, x.case.n, x.q.device)
            keys = torch.arange(x.case.n, device=x.q.device)
            return (keys >= first[:, None]) & (keys <= last[:, None])  # [n, n]

        return Built(_sdpa(x, attn_mask=make()), make, note="mask from the band (no edge list)")
    make = lambda: builders.to_mask(x.edge_index, x.case.n, x.case.n)  # noqa: E731
    return Built(_sdpa(x, attn_mask=make()), make)


def sdpa_dense(x: Inputs) -> Built:
    return Built(_sdpa(x, is_causal=x.case.causal), note="is_causal" if x.case.causal else "all pairs")


def build(name: str, x: Inputs) -> Built:
    """The peer ``name`` (one of :data:`SUITE_PEERS`) for inputs ``x``.

    Raises:
        NotAvailable: the peer cannot run here (the message says why).
    """
    return {"tc": tc, "triton": triton, "flex": flex, "flex_edges": flex_edges, "flex_fa4": flex_fa4,
            "flex_fa4_dense": flex_fa4_dense, "sdpa_mask": sdpa_mask, "sdpa_dense": sdpa_dense}[name](x)
