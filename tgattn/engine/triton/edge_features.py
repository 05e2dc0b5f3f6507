"""Edge features inside the Triton kernels: ``(features [E, F], weight)`` key and value terms on the GPU.

For query i, key j, head h and the per-head maps ``W_h [d, F]`` of the terms (``edge_terms``):

    s_ij = scale * (<q_i, k_j> + <W^k_h^T q_i, e_ij>) + b_ij,      o_i = sum_j a_ij v_j + W^v_h sum_j a_ij e_ij

The kernels take the key features ``W^k_h^T q_i`` ``[Nq, H, F]`` and the features ``[E, F]`` (read in the
caller's order through the edge set's permutation) and return the value sums ``sum_j a_ij e_ij``
``[Nq, H, F]``; this node applies the maps around them with one batched product each, as the fused C++
kernel's :class:`~tgattn.engine.edge_terms.MappedAttention` does on the CPU: no per-edge tensor in the
forward, and in the backward only each head's share of the features' gradient ``[E, H, F]``, summed over
the heads once. Composed around the kernels instead, the terms cost about 25 kernels a training step
(a score bias and a scatter of the weights, each with its gradient); here 7.

The backward, with ``g_i = W^v_h^T dO_i``: ``dp_ij`` gains ``<g_i, e_ij>`` and ``delta_i`` is taken from
the output with the value term (``<dO_i, W^v_h s_i> = <g_i, s_i>``); then ``dkf_i = scale sum_j ds_ij e_ij``,
``de_ij = sum_h (scale ds_ij kf_i + a_ij g_i)``, ``dq_i += W^k_h dkf_i``, ``dW^k_h = sum_i q_i dkf_i^T`` and
``dW^v_h = sum_i dO_i s_i^T``.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from ..analysis import Structure
from .attention import _unit_stride, bias_and_sink_grads, blocks_for, draw_seed, kernels_module, softmax_delta, walks


def _per_head(x: Tensor, maps: Tensor) -> Tensor:
    """``W_h^T x_ih`` ``[N, H, F]`` for ``x [N, H, d]`` and ``maps [H, d, F]``: one batched product (a view of
    its ``[H, N, F]`` result, which the kernels read through its strides)."""
    return torch.bmm(x.transpose(0, 1), maps).transpose(0, 1)


class TritonMappedAttention(torch.autograd.Function):
    """The Triton kernels with edge features and their per-head maps: ``(out [n_q, H, dv], weights [E, H] or
    [0, H])`` (weights in sorted order). ``key_maps`` / ``value_maps`` ``[H, d, F]`` (either None; one tensor
    for both terms when they share their map), all of q's dtype."""

    @staticmethod
    def forward(ctx, q, k, v, bias, sinks, features, key_maps, value_maps, s: Structure, scale: float, p: float,
                weights: bool, blocks):
        kern = kernels_module()
        q, k, v = (_unit_stride(t) for t in (q, k, v))
        sinks = None if sinks is None else sinks.contiguous()
        features = features.contiguous()
        rows, _ = walks(s)
        seed = draw_seed() if p > 0 else 0
        key = None if key_maps is None else _per_head(q, key_maps)  # W_h^T q_i [n_q, H, F]
        edge = kern.EdgeFeatures(features, s.perm, key, value_maps is not None)
        out, lse, w, summed = kern.forward(q, k, v, bias, *rows, scale, p, seed, weights, blocks, None, sinks, edge)
        if summed is not None:  # o_i += W_h s_i in place: out keeps its layout (the caller flattens its heads)
            out.transpose(0, 1).baddbmm_(summed.transpose(0, 1), value_maps.transpose(1, 2))
        if not weights:
            ctx.mark_non_differentiable(w)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, bias, sinks, features, key_maps, value_maps, key, out, lse, w, summed)
        ctx.s, ctx.scale, ctx.p, ctx.seed, ctx.blocks = s, scale, p, seed, blocks
        ctx.shared = key_maps is not None and key_maps is value_maps
        return out, w

    @staticmethod
    def backward(ctx, grad_out, grad_w):
        if torch.is_grad_enabled():
            raise RuntimeError(
                "the Triton attention kernels have no second derivative; "
                "pass backend='csr' to graph_attention (or GraphAttention) for double backward"
            )
        q, k, v, bias, sinks, features, key_maps, value_maps, key, out, lse, w, summed = ctx.saved_tensors
        s, needs = ctx.s, ctx.needs_input_grad
        grad_out = torch.zeros_like(out) if grad_out is None else _unit_stride(grad_out)
        delta, grad_w = softmax_delta(grad_out, out, lse, w, grad_w, s)  # out holds the value term: its share too
        grad_sums = None if value_maps is None else _per_head(grad_out, value_maps)  # W_h^T dO_i [n_q, H, F]
        kern = kernels_module()
        bias_grad = bias is not None and needs[3]
        dq, dk, dv, d_scores, d_key, d_features = kern.backward(
            q, k, v, bias, grad_out, lse, delta, grad_w, *walks(s), ctx.scale, ctx.p, ctx.seed, bias_grad, ctx.blocks,
            None, kern.EdgeFeatures(features, s.perm, key, value_maps is not None, grad_sums),
        )
        grad_bias, grad_sinks = bias_and_sink_grads(bias, sinks, d_scores, lse, delta, bias_grad, needs[4])
        grad_key_maps = grad_value_maps = None
        if key is not None:
            if needs[0]:  # dq_i += W_h dkf_i, in the kernel's dq
                dq.transpose(0, 1).baddbmm_(d_key.transpose(0, 1), key_maps.transpose(1, 2))
            if needs[6]:  # sum_i q_ih dkf_ih^T [H, d, F]
                grad_key_maps = torch.bmm(q.permute(1, 2, 0), d_key.transpose(0, 1))
        if summed is not None and needs[7]:  # sum_i dO_ih s_ih^T, added to the key map's when the terms share it
            if ctx.shared and grad_key_maps is not None:
                grad_key_maps.baddbmm_(grad_out.permute(1, 2, 0), summed.transpose(0, 1))
            else:
                grad_value_maps = torch.bmm(grad_out.permute(1, 2, 0), summed.transpose(0, 1))
                if ctx.shared:
                    grad_key_maps, grad_value_maps = grad_value_maps, None
        grad_features = d_features.sum(1).to(features.dtype) if needs[5] else None  # over the heads
        return (dq if needs[0] else None, dk if needs[1] else None, dv if needs[2] else None, grad_bias, grad_sinks,
                grad_features, grad_key_maps, grad_value_maps, None, None, None, None, None)


def triton_edge_features(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    s: Structure,
    bias: Optional[Tensor],
    scale: float,
    dropout_p: float,
    return_weights: bool,
    features: Tensor,
    key_maps: Optional[Tensor],
    value_maps: Optional[Tensor],
    *,
    sinks: Optional[Tensor] = None,
    blocks: Optional[Tuple[int, int]] = None,
) -> Tuple[Tensor, Optional[Tensor]]:
    """``(out [n_q, H, dv], weights [E, H] or None)`` with the edge-feature terms inside the kernels
    (:class:`TritonMappedAttention`); ``bias`` ``[E, 1 or H]`` sorted, ``features [E, F]`` in the caller's
    order, weights returned sorted. The blocks are those of head dim ``d + F``: the features' chunk
    ``[BLOCK_M, BLOCK_N, F]`` and its gradient beside the keys' and values' (at the blocks of ``d``, the dq
    kernel with every option spilled up to 600 bytes for sm_80 / sm_90 at F = d; with those of ``2 d``
    none spills: data/gpu/compiled.csv, ``tgattn.engine.triton.aot``).

    Example (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``)::

        maps = weight.view(H, d, F)  # TransformerConv's lin_edge, one map for keys and values
        out, _ = triton_edge_features(q, k, v, s, None, d ** -0.5, 0.0, False, edge_attr, maps, maps)
    """
    width = max(q.shape[2], v.shape[2]) + features.shape[1]
    blocks = blocks or blocks_for(width, width, q.dtype)
    out, w = TritonMappedAttention.apply(q, k, v, bias, sinks, features, key_maps, value_maps, s, scale, dropout_p,
                                         return_weights, blocks)
    return out, (w if return_weights else None)
