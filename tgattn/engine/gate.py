"""The ``beta`` gate of :class:`~tgattn.nn.conv.GraphAttentionConv` (``TransformerConv``'s): the attention
output mixed with the root term by a learned per-node weight, in one pass forward and one backward."""
from __future__ import annotations

import torch
from torch import Tensor

from .native import takes


def beta_mix(out: Tensor, root: Tensor, weight: Tensor) -> Tensor:
    """``lerp(out, root, sigmoid(weight @ [out, root, out - root]))`` for ``out``, ``root`` ``[N, W]`` and
    ``lin_beta``'s ``weight`` ``[1, 3 W]``, as ``TransformerConv`` computes it, without the ``[N, 3 W]`` copy.

    On float32 / float64 CPU tensors outside ``torch.compile`` the fused extension does the forward and
    the backward in one pass each (``beta_gate``); elsewhere, and for a backward that builds a graph
    (``create_graph=True``), PyTorch ops.

    Example:
        >>> out, root, w = torch.randn(3, 4), torch.randn(3, 4), torch.randn(1, 12)
        >>> gate = torch.sigmoid(torch.cat([out, root, out - root], -1) @ w.T)
        >>> torch.allclose(beta_mix(out, root, w), gate * root + (1 - gate) * out, atol=1e-6)
        True
    """
    if takes(out, root, weight):
        return _BetaGate.apply(out.contiguous(), root.contiguous(), weight.reshape(-1))
    return _mix(out, root, weight.reshape(-1))


def _gate(out: Tensor, root: Tensor, w: Tensor):
    """``(s [N, 1], a, b)``: the gate ``sigmoid(a^T o + b^T r)`` with ``w^T [o, r, o - r] = a^T o + b^T r``,
    ``a = w_out + w_diff``, ``b = w_root - w_diff``: two products, no ``[N, 3 W]`` copy."""
    w_out, w_root, w_diff = w.view(3, -1)  # [W] each
    a, b = w_out + w_diff, w_root - w_diff
    return torch.addmv(root @ b, out, a).sigmoid().unsqueeze(-1), a, b


def _mix(out: Tensor, root: Tensor, w: Tensor) -> Tensor:
    """The gate in PyTorch ops."""
    return torch.lerp(out, root, _gate(out, root, w)[0])  # gate * root + (1 - gate) * out


class _BetaGate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, root, w):
        y, gate = torch.ops.tgattn_fused.beta_gate(out, root, w)
        ctx.save_for_backward(out, root, w, gate)
        return y

    @staticmethod
    def backward(ctx, grad):
        out, root, w, gate = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: the same gradients as differentiable ops
            return _mix_grads(grad, out, root, w)
        return tuple(torch.ops.tgattn_fused.beta_gate_backward(grad.contiguous(), out, root, w, gate))


def _mix_grads(grad: Tensor, out: Tensor, root: Tensor, w: Tensor):
    """``(d_out, d_root, d_w)`` of :func:`_mix` for the upstream ``grad``, in differentiable ops:
    ``dz_i = s_i (1 - s_i) <grad_i, root_i - out_i>``, ``d_out_i = (1 - s_i) grad_i + dz_i a``,
    ``d_root_i = s_i grad_i + dz_i b``, ``d_w = [da, db, da - db]`` with ``da = sum_i dz_i out_i``,
    ``db = sum_i dz_i root_i`` (``a = w_out + w_diff``, ``b = w_root - w_diff``)."""
    s, a, b = _gate(out, root, w)  # [N, 1]
    dz = s * (1 - s) * (grad * (root - out)).sum(-1, keepdim=True)  # [N, 1]
    da, db = out.T @ dz.squeeze(-1), root.T @ dz.squeeze(-1)
    return (1 - s) * grad + dz * a, s * grad + dz * b, torch.cat([da, db, da - db])
