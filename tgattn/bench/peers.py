"""The implementations the benchmark compares, all on the attention core ``(q, k, v) -> out``.

Each peer gets the same per-head ``q, k, v [N, H, d]`` and edge set, and returns a
callable that runs the forward pass (``None`` when the peer cannot run this case):

* ``tgattn``: :func:`tgattn.functional.graph_attention`, ``backend="auto"``;
* ``triton``: the same function, ``backend="triton"`` (the Triton kernels, CUDA only);
* ``tc``: the same function, ``backend="tc"`` (tiles on tensor cores and the gathered remainder,
  CUDA only; unavailable where the checkout has no such backend);
* ``gather``: the same function, ``backend="gather"`` (the textbook per-edge path);
* ``transformerconv``: PyG ``TransformerConv(root_weight=False)`` with identity
  projections, so that only its attention core runs (keys double as values);
* ``gatconv``: PyG ``GATConv`` (additive attention, Velickovic et al., 2018) with an identity
  projection and no added self-loops, on the same edges: the GNN layer users pick for speed;
  both PyG layers are cast to q's dtype (a bfloat16 run does not promote to their float32
  parameters);
* ``sdpa_mask``: ``scaled_dot_product_attention`` with the boolean mask, the kernel
  ``nn.MultiheadAttention`` runs for a masked call without weights;
* ``sdpa``: dense SDPA without a mask (``is_causal`` for causal), for full / causal only;
* ``flex``: compiled FlexAttention with the pattern's ``mask_mod`` (on CPU forward only);
* ``flex_csr``: compiled FlexAttention with the ``BlockMask`` built from the edge set's CSR
  structure (:func:`tgattn.engine.triton.flex.block_mask`), for any edge set without duplicates;
* ``floor``: not attention but a measuring stick: reading the key / value rows of every
  edge (and, backward, the rows the backward gathers) in the fused kernel's order, with
  nothing computed (:class:`tgattn.engine.fused.ReadsOnly`). Dense time / floor time bounds
  the speed-up any kernel that gathers rows per edge can reach on this machine.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

if TYPE_CHECKING:
    from torch import Tensor
    from .patterns import Pattern


PEERS = ("tgattn", "gather", "transformerconv", "sdpa_mask", "sdpa", "flex", "floor", "triton", "gatconv", "flex_csr", "tc")
CPU_PEERS = PEERS[:7]  # the default on CPU (triton and tc need CUDA)
GPU_PEERS = ("tgattn", "tc", "triton", "sdpa_mask", "sdpa", "flex", "flex_csr", "transformerconv", "gatconv")
FLEX = ("flex", "flex_csr")
FORWARD_ONLY_CPU = FLEX  # FlexAttention has no backward on CPU
# On CPU, flex refuses the probe's dispatch mode and floor allocates nothing of note (CUDA reads the allocator).
NO_MEMORY_PROBE = ("flex", "flex_csr", "floor")


def _heads_first(*ts: Tensor):
    return [t.transpose(0, 1).unsqueeze(0) for t in ts]  # [1, H, N, d]


def tgattn(q, k, v, ei, pattern: Pattern) -> Callable:
    from ..functional import graph_attention

    return lambda: graph_attention(q, k, v, ei)


def require_backend(backend: str, q: Tensor) -> None:
    """Nothing when ``graph_attention(q, ..., backend=backend)`` can run Triton's kernels on inputs
    like ``q`` here; else a ``ValueError`` saying why.

    Example:
        >>> import torch
        >>> require_backend("no such", torch.zeros(2, 1, 4))
        Traceback (most recent call last):
        ...
        ValueError: graph_attention has no backend 'no such' in this checkout
    """
    from ..engine.triton import available, usable
    from ..functional import BACKENDS

    if backend not in BACKENDS:
        raise ValueError(f"graph_attention has no backend {backend!r} in this checkout")
    if not available():
        raise ValueError("triton is not installed (or TGATTN_NO_TRITON is set)")
    if not usable(q, named=True):
        raise ValueError("Triton's kernels run on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1 set "
                         f"before triton is imported (got {q.device.type} {q.dtype})")


def triton(q, k, v, ei, pattern: Pattern) -> Optional[Callable]:
    from ..functional import graph_attention

    return (lambda: graph_attention(q, k, v, ei, backend="triton")) if q.is_cuda else None


def tc(q, k, v, ei, pattern: Pattern) -> Optional[Callable]:
    from ..functional import graph_attention

    if not q.is_cuda:
        return None
    require_backend("tc", q)
    return lambda: graph_attention(q, k, v, ei, backend="tc")


def gather(q, k, v, ei, pattern: Pattern) -> Callable:
    from ..functional import graph_attention

    return lambda: graph_attention(q, k, v, ei, backend="gather")


def transformerconv(q, k, v, ei, pattern: Pattern) -> Callable:
    from torch import nn
    from torch_geometric.nn import TransformerConv

    n, h, d = q.shape
    conv = TransformerConv(h * d, d, heads=h, root_weight=False).to(q.device, q.dtype)
    conv.lin_query = conv.lin_key = conv.lin_value = nn.Identity()
    return lambda: conv((k.reshape(n, h * d), q.reshape(n, h * d)), ei).view(n, h, d)


def gatconv(q, k, v, ei, pattern: Pattern) -> Callable:
    from torch import nn
    from torch_geometric.nn import GATConv

    n, h, d = q.shape
    conv = GATConv(h * d, d, heads=h, add_self_loops=False).to(q.device, q.dtype)  # its att / bias in q's dtype
    conv.lin = nn.Identity()
    return lambda: conv(k.reshape(n, h * d), ei).view(n, h, d)


def sdpa_mask(q, k, v, ei, pattern: Pattern) -> Callable:
    import torch.nn.functional as F

    from .. import builders

    mask = builders.to_mask(ei, q.shape[0], k.shape[0])
    qh, kh, vh = _heads_first(q, k, v)
    return lambda: F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask)


def sdpa(q, k, v, ei, pattern: Pattern) -> Optional[Callable]:
    import torch.nn.functional as F

    if pattern.dense is None:
        return None
    qh, kh, vh = _heads_first(q, k, v)
    return lambda: F.scaled_dot_product_attention(qh, kh, vh, is_causal=pattern.dense == "causal")


def flex(q, k, v, ei, pattern: Pattern) -> Optional[Callable]:
    import torch

    if pattern.mask_mod is None:
        return None
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch._dynamo.reset()  # a fresh compile per pattern (a failed one must not poison the next)
    compiled = torch.compile(flex_attention, dynamic=False)
    n = q.shape[0]
    block_mask = create_block_mask(pattern.mask_mod, None, None, n, n, device=str(q.device))
    qh, kh, vh = _heads_first(q, k, v)
    if not q.is_cuda:  # no backward on CPU
        qh, kh, vh = qh.detach(), kh.detach(), vh.detach()
    return lambda: compiled(qh, kh, vh, block_mask=block_mask)


def flex_csr(q, k, v, ei, pattern: Pattern) -> Optional[Callable]:
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    from ..engine import structure_of
    from ..engine.triton.flex import block_mask, flex_attention as csr_flex

    s = structure_of(ei, q.shape[0], k.shape[0])
    if s.duplicates:
        return None
    block_mask(s)  # built (and cached) outside the timed region
    torch._dynamo.reset()
    compiled = torch.compile(flex_attention, dynamic=False)
    if not q.is_cuda:  # no backward on CPU
        q, k, v = q.detach(), k.detach(), v.detach()
    return lambda: csr_flex(q, k, v, s, q.shape[-1] ** -0.5, compiled=compiled)


def floor(q, k, v, ei, pattern: Pattern) -> Optional[Callable]:
    from ..engine import fused, structure_of

    if q.is_cuda or not fused.available() or q.shape[-1] != v.shape[-1]:
        return None
    s = structure_of(ei, q.shape[0], k.shape[0])
    rows = tuple(t.detach() for t in (q, k, v))  # the layout fused_attention hands the kernels
    return lambda: fused.ReadsOnly.apply(q, k, v, rows, s)


def build(name: str, q, k, v, ei, pattern: Pattern) -> Optional[Callable]:
    return globals()[name](q, k, v, ei, pattern)
