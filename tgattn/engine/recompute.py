"""The textbook edge-wise path, and gradients recomputed on it or on another backend.

Two cases make a backend's own backward pass the wrong tool, and both recompute instead:

* a double backward (``create_graph=True``): the kernels' gradients carry no graph, so the
  gradients are recomputed on :func:`gather_attention`, plain autograd ops that are
  differentiable any number of times;
* a non-finite upstream gradient on a dense backend (SDPA, tiles): dense kernels multiply
  masked cells by 0, and ``0 * nan`` would carry a NaN into the gradients of keys that the
  query never sees; the edge-wise CSR kernels touch the edges and nothing else.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .softmax import edge_softmax


def gather_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    src: Tensor,
    dst: Tensor,
    n_q: int,
    bias: Optional[Tensor],
    scale: float,
    mult: Optional[Tensor] = None,
    softcap: Optional[float] = None,
    sinks: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """Gather ``q_i``, ``k_j``, ``v_j`` per edge, softmax per target, sum at the target.

    Materializes ``[E, H, d]`` copies: the readable reference, not a fast path.
    ``mult`` (``[E, 1 or H]``) multiplies the weights after the softmax (dropout's
    ``keep / (1 - p)``, an explainer's edge mask). ``softcap`` caps the scaled scores,
    ``c * tanh(s / c)``, before the bias is added (Gemma 2's order); ``sinks`` (``[H]``) joins
    every softmax's max and denominator (:func:`~tgattn.engine.softmax.edge_softmax`).
    Returns ``(out [n_q, H, dv], weights [E, H])``.
    """
    scores = (q[dst] * k[src]).sum(-1) * scale  # [E, H]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if bias is not None:
        scores = scores + bias
    weights = edge_softmax(scores, dst, n_q, sinks)  # [E, H]
    used = weights if mult is None else weights * mult
    out = q.new_zeros(n_q, q.shape[1], v.shape[2]).index_add(0, dst, used.unsqueeze(-1) * v[src])  # [n_q, H, dv]
    return out, weights


def recompute_grads(
    fn: Callable[..., Sequence[Optional[Tensor]]],
    inputs: Sequence[Optional[Tensor]],
    grads: Sequence[Optional[Tensor]],
    needs: Sequence[bool],
) -> list:
    """Gradients of ``fn(*inputs)`` for the upstream ``grads``, one per input (``None`` where not needed).

    Called from an autograd ``backward``. Under ``create_graph=True`` (grad mode on there) views
    of the saved inputs are used, so the result is differentiable with respect to them;
    otherwise detached copies are.
    """
    create_graph = torch.is_grad_enabled()
    with torch.enable_grad():
        if create_graph:
            # A view of each input, not the input: the gradient for a view counts only the paths through
            # it, where one for the input itself would also count the paths through the other inputs
            # derived from it (q = k = v, or edge terms' W_h^T q_i with q), counting those twice.
            leaves = [None if t is None else t.view_as(t) for t in inputs]
        else:
            leaves = [None if t is None else t.detach().requires_grad_(bool(need)) for t, need in zip(inputs, needs)]
        outs = fn(*leaves)
    return grads_through(outs, leaves, grads, needs, create_graph=create_graph)


def grads_through(
    outs: Sequence[Optional[Tensor]],
    leaves: Sequence[Optional[Tensor]],
    grads: Sequence[Optional[Tensor]],
    needs: Sequence[bool],
    *,
    create_graph: bool = False,
    retain_graph: bool = False,
) -> list:
    """Gradients of the recorded ``outs`` with respect to ``leaves``, one per leaf (``None``
    where not needed; zeros for a needed leaf that the outputs do not depend on)."""
    pairs = [(o, g) for o, g in zip(outs, grads) if o is not None and g is not None and o.requires_grad]
    wanted = [i for i, t in enumerate(leaves) if t is not None and needs[i]]
    result = [None] * len(leaves)
    if not pairs or not wanted:
        return result
    got = torch.autograd.grad(
        [o for o, _ in pairs], [leaves[i] for i in wanted], [g for _, g in pairs],
        allow_unused=True, create_graph=create_graph, retain_graph=retain_graph or create_graph,
    )
    for i, g in zip(wanted, got):
        result[i] = torch.zeros_like(leaves[i]) if g is None else g
    return result


def dropout_factor(
    num_edges: int, heads: int, p: float, like: Tensor, generator: Optional[torch.Generator] = None
) -> Tensor:
    """``keep / (1 - p)`` per edge and head ``[E, H]`` in the dtype of ``like``, ``keep`` drawn
    with ``torch.rand`` (the mask of the csr and gather paths)."""
    keep = torch.rand(num_edges, heads, device=like.device, generator=generator) >= p  # [E, H]
    return keep.to(like.dtype) / (1.0 - p)


def all_finite(*tensors: Optional[Tensor]) -> bool:
    """Whether every given tensor holds only finite numbers (``None`` counts as finite)."""
    return all(t is None or bool(torch.isfinite(t).all()) for t in tensors)
