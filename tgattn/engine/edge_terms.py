"""Per-edge key and value terms of graph attention (``edge_key=`` / ``edge_value=``).

For query i, key j and head h (``ek``, ``ev``: the terms of edge (j, i)):

    s_ij = scale * <q_i, k_j + ek_ij> + b_ij,      o_i = sum_j a_ij (v_j + ev_ij)

The engine attends over per-node keys and values, so the terms enter around it: the key term
is one more score bias, ``scale * <q_i, ek_ij>`` ``[E, H]``, and the value term is
``sum_j a_ij ev_ij``, a scatter of the weights the engine returns (both differentiable).

A term may come as vectors ``[E, H, d]`` or as a linear map of edge features,
``ek_ij = W^h e_ij`` (``(features [E, F], weight [H * d, F])``, ``TransformerConv``'s
``lin_edge``). With fewer features than head channels (F < d) the map is applied in its
factored form, ``<q_i, W^h e_ij> = <W^h^T q_i, e_ij>`` and
``sum_j a_ij W^h e_ij = W^h sum_j a_ij e_ij``, which holds ``[E, H, F]`` instead of
``[E, H, d]``. Per-edge vectors handed in are ``[E, H, d]`` by definition.

On the fused C++ kernel both terms of ``(features, weight)`` pairs over one features tensor run
inside the kernel instead (:func:`shared_features`): the key term's ``W^h^T q_i`` ``[Nq, H, F]``
(:func:`key_features`) goes in, the value term's ``sum_j a_ij e_ij`` ``[Nq, H, F]`` comes out and is
projected (:func:`project`), with no per-edge tensor in the forward. Those per-head maps and their
gradients run in the extension too (``head_map``, ``head_map_add``, ``head_outer``: each head's
``[d, F]`` map once, not a block-diagonal ``[H d, H F]`` product) for float32 / float64 CPU tensors, where
:class:`MappedAttention` runs them with the kernel as one autograd node (half precision keeps the three).
The Triton kernels take the same factored form on the GPU (:mod:`tgattn.engine.triton.edge_features`).
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple, Union

import torch
from torch import Tensor

from .fused import backward_pattern, textbook
from .native import takes
from .recompute import recompute_grads
from .validate import check_device

# What a caller passes: the vectors [E, H, d], or (features [E, F], weight [H * d, F]).
EdgeTerm = Union[Tensor, Tuple[Tensor, Tensor]]


class Term(NamedTuple):
    """A checked term: ``vectors [E, H, d]`` and no weight, or ``features [E, F]`` and ``weight [H, d, F]``."""

    values: Tensor
    weight: Optional[Tensor]

    def factored(self) -> bool:
        """Whether the map is cheaper applied to the features (F < d) than to the edges."""
        return self.weight is not None and self.weight.shape[2] < self.weight.shape[1]

    def vectors(self) -> Tensor:
        """``[E, H, d]``."""
        if self.weight is None:
            return self.values
        heads, dim, num_features = self.weight.shape
        return (self.values @ self.weight.reshape(heads * dim, num_features).T).view(-1, heads, dim)


def read(name: str, term: EdgeTerm, num_edges: int, heads: int, dim: int, q: Tensor) -> Term:
    """Check a caller's term against ``[E, H, d]`` and ``q``'s dtype and device; raise naming what is wrong."""
    dtype = q.dtype
    if isinstance(term, (tuple, list)):
        if len(term) != 2 or not all(isinstance(t, Tensor) for t in term):
            raise TypeError(f"{name} must be a tensor [E, H, d] or a pair of tensors (features, weight)")
        features, weight = term
        _check_dtype(name, features, dtype)
        _check_dtype(name, weight, dtype)
        check_device(f"{name} features", features, q)
        check_device(f"{name} weight", weight, q)
        if features.dim() != 2 or features.shape[0] != num_edges:
            raise ValueError(f"{name} features must have shape [E, F] with E = {num_edges} (got {list(features.shape)})")
        if weight.shape != (heads * dim, features.shape[1]):
            raise ValueError(
                f"{name} weight must have shape [H * d, F] = [{heads * dim}, {features.shape[1]}] "
                f"(got {list(weight.shape)})"
            )
        return Term(features, weight.view(heads, dim, features.shape[1]))
    if not isinstance(term, Tensor):
        raise TypeError(f"{name} must be a tensor [E, H, d] or a pair of tensors (features, weight) "
                        f"(got {type(term).__name__})")
    _check_dtype(name, term, dtype)
    check_device(name, term, q)
    if term.shape != (num_edges, heads, dim):
        raise ValueError(f"{name} must have shape [E, H, d] = [{num_edges}, {heads}, {dim}] (got {list(term.shape)})")
    return Term(term, None)


def _check_dtype(name: str, t: Tensor, dtype: torch.dtype) -> None:
    if t.dtype != dtype:
        raise ValueError(f"{name} must have q's dtype {dtype} (got {t.dtype})")


def per_head(term: Term, dtype: torch.dtype) -> Tensor:
    """The maps ``W [H, d, F]`` (head h's ``[d, F]``) in ``dtype``, as :func:`key_features` and :func:`project`
    take them."""
    return term.weight.to(dtype)


def key_features(q: Tensor, maps: Tensor) -> Tensor:
    """``W^h^T q_i`` per query and head ``[Nq, H, F]``; ``maps`` from :func:`per_head`."""
    if _native(q, maps):
        return _HeadMap.apply(q, maps)
    return torch.bmm(q.transpose(0, 1), maps).transpose(0, 1)  # [H, Nq, d] x [H, d, F]: each head's map once


def project(summed: Tensor, maps: Tensor, out: Optional[Tensor] = None) -> Tensor:
    """``W^h s_i`` per query and head ``[Nq, H, d]`` for feature sums ``s`` ``[Nq, H, F]``, added to ``out``
    ``[Nq, H, d]`` when given (in the same pass on the native maps); ``maps`` from :func:`per_head`."""
    if _native(summed, maps, out):
        return _Project.apply(summed, maps, out)
    # One batched product over the heads: a block-diagonal [H d, H F] matrix would do every map in one matrix
    # product, but its making and its gradient's split cost two more kernels, forward and backward, on a GPU.
    # maps as they are, so that their gradient is [H, d, F] in place (a transposed one would be copied to add up)
    mapped = torch.bmm(maps, summed.permute(1, 2, 0)).permute(2, 0, 1)  # [H, d, F] x [H, F, Nq] -> [Nq, H, d]
    return mapped if out is None else out + mapped


def _native(*tensors: Optional[Tensor]) -> bool:
    """Whether the fused extension's per-head maps (``head_map``, ``head_map_add``, ``head_outer``) take these
    tensors: float32 / float64 CPU tensors of one dtype, outside ``torch.compile``, with the extension built.

    They do each map's work in one pass over rows packed as they are: on a molecule batch (3,040 queries, H = 4,
    C = 16, F = 4, one thread) 25-38 us a map against 80-98 us a block-diagonal product (each map's work H times over).
    """
    return takes(*tensors)


class _HeadMap(torch.autograd.Function):
    """``y_ih = W_h^T x_ih`` ``[N, H, F]`` for ``x [N, H, d]``, ``W [H, d, F]``; the backward is
    ``dx_ih = W_h dy_ih`` and ``dW_h = sum_i x_ih dy_ih^T``, native too (twice differentiable through einsum)."""

    @staticmethod
    def forward(ctx, x, maps):
        x = x if x.stride(-1) == 1 else x.contiguous()  # the maps read rows with a contiguous last dimension
        ctx.save_for_backward(x, maps)
        return torch.ops.tgattn_fused.head_map(x, maps)

    @staticmethod
    def backward(ctx, grad):
        x, maps = ctx.saved_tensors
        need_x, need_maps = ctx.needs_input_grad
        if torch.is_grad_enabled():  # create_graph=True: differentiable products
            return (torch.einsum("nhf,hdf->nhd", grad, maps) if need_x else None,
                    torch.einsum("nhd,nhf->hdf", x, grad) if need_maps else None)
        grad = grad.contiguous()  # head_map_add reads [N, H, F] rows packed
        return (torch.ops.tgattn_fused.head_map_add(None, grad, maps) if need_x else None,
                torch.ops.tgattn_fused.head_outer(x, grad) if need_maps else None)


class _Project(torch.autograd.Function):
    """``out_ih + W_h s_ih`` ``[N, H, d]`` (``out`` may be None) for ``s [N, H, F]``, ``W [H, d, F]``;
    the backward is ``ds_ih = W_h^T g_ih``, ``dW_h = sum_i g_ih s_ih^T`` and ``d out = g``."""

    @staticmethod
    def forward(ctx, summed, maps, out):
        ctx.save_for_backward(summed, maps)
        return torch.ops.tgattn_fused.head_map_add(out, summed, maps)

    @staticmethod
    def backward(ctx, grad):
        summed, maps = ctx.saved_tensors
        need_s, need_maps, need_out = ctx.needs_input_grad
        if torch.is_grad_enabled():  # create_graph=True: differentiable products
            return (torch.einsum("nhd,hdf->nhf", grad, maps) if need_s else None,
                    torch.einsum("nhd,nhf->hdf", grad, summed) if need_maps else None, grad if need_out else None)
        rows = grad if grad.stride(-1) == 1 else grad.contiguous()  # rows with a contiguous last dimension
        return (torch.ops.tgattn_fused.head_map(rows, maps) if need_s else None,
                torch.ops.tgattn_fused.head_outer(rows, summed) if need_maps else None, grad if need_out else None)


class MappedAttention(torch.autograd.Function):
    """The fused kernel with its per-head maps, one autograd node: ``(out [n_q, H, dv], weights [H, E] or empty)``.

    ``out_i = o_i + W^v_h s_i`` for the kernel's ``o_i`` and value sums ``s_i = sum_j a_ij e_ij``, the key
    term's ``W^k_h^T q_i`` computed here and fed to the kernel (``key_maps`` / ``value_maps`` ``[H, d, F]``,
    either None, or one tensor for both); ``features [E, F]`` in the caller's order (read through ``s.perm``),
    ``bias`` ``[E, 1 or H]`` sorted, all of q's dtype, float32 or float64 (:func:`_native`), rows with a
    contiguous last dimension. The backward feeds the kernel ``W^v_h^T dO_i`` and adds ``W^k_h dqe_i`` to its
    ``dq`` in one pass (``head_map_add``): against :func:`key_features`, ``FusedAttention`` and :func:`project`
    as three nodes, no ``[n_q, H, d]`` gradient summed apart, no identity gradients passed along, one node's
    bookkeeping instead of three. ``create_graph=True`` recomputes on the textbook path (twice differentiable).
    """

    @staticmethod
    def forward(ctx, q, k, v, bias, sinks, features, key_maps, value_maps, s, scale: float, p: float, seed: int,
                weights: bool, softcap: Optional[float]):
        ops = torch.ops.tgattn_fused
        edge_q = None if key_maps is None else ops.head_map(q, key_maps)  # W_h^T q_i [n_q, H, F]
        sums = value_maps is not None
        out, lse, w, *rest = ops.forward(q, k, v, s.rowptr, s.src, bias, scale, p, seed, weights,
                                         0.0 if softcap is None else softcap, sinks, edge_q, features, sums, s.perm)
        summed = rest[0] if sums else None  # [n_q, H, F]
        # o_i + W_h s_i into the kernel's fresh output (no second [n_q, H, d] buffer): the backward's delta_i
        # = <dO_i, o_i + W_h s_i> then has the value term's share, <W_h^T dO_i, s_i>, already.
        result = out if summed is None else ops.head_map_add(out, summed, value_maps, True)
        ctx.set_materialize_grads(False)  # no zeros for an unused output
        if not weights:
            ctx.mark_non_differentiable(w)
        ctx.save_for_backward(q, k, v, bias, sinks, features, key_maps, value_maps, edge_q, result, lse,
                              w if weights else None, summed)
        ctx.s, ctx.scale, ctx.p, ctx.seed, ctx.softcap = s, scale, p, seed, softcap
        return result, w

    @staticmethod
    def backward(ctx, grad_out, grad_weights):
        q, k, v, bias, sinks, features, key_maps, value_maps, edge_q, out, lse, weights, summed = ctx.saved_tensors
        s, needs = ctx.s, ctx.needs_input_grad
        unused = (None,) * 6  # s, scale, p, seed, weights, softcap
        if grad_out is None and grad_weights is None:
            return (None,) * 8 + unused
        if torch.is_grad_enabled():  # create_graph=True: recompute on a twice-differentiable path
            inputs = (q, k, v, bias, sinks, features, key_maps, value_maps)
            return (*recompute_grads(_textbook(ctx), inputs, (grad_out, grad_weights), needs[:8]), *unused)
        ops = torch.ops.tgattn_fused
        grad_sums = rows = None
        if grad_out is None:  # only the returned weights got a gradient
            grad_out = torch.zeros_like(out)
        elif summed is not None:
            rows = grad_out if grad_out.stride(-1) == 1 else grad_out.contiguous()  # the maps read packed rows
            grad_sums = ops.head_map(rows, value_maps)  # W_h^T dO_i [n_q, H, F]
        colptr, row_t, perm_t = backward_pattern(s, True)
        sinks_grad = sinks is not None and needs[4]
        grads = ops.backward(
            grad_out, q, k, v, out, lse, weights, grad_weights, bias, s.rowptr, colptr, row_t, perm_t, ctx.scale, ctx.p,
            ctx.seed, needs[3], 0.0 if ctx.softcap is None else ctx.softcap, sinks if sinks_grad else None, edge_q,
            features, None, grad_sums, s.perm, s.src,  # no edge_sums: `out` holds the value term (see forward); col
        )
        grad_q, grad_k, grad_v, d_scores = grads[:4]
        d_edge_q, d_features = grads[-2:]
        grad_bias = None
        if needs[3]:
            grad_bias = d_scores.T if bias.shape[1] > 1 else d_scores.sum(0).unsqueeze(1)  # [E, 1 or H]
        grad_maps = [None, None]
        if key_maps is not None:
            if needs[0]:
                grad_q = ops.head_map_add(grad_q, d_edge_q, key_maps, True)  # dq_i += W_h dqe_i in the kernel's dq
            if needs[6]:
                grad_maps[0] = ops.head_outer(q, d_edge_q)  # sum_i q_ih dqe_ih^T
        if value_maps is not None and needs[7] and rows is not None:
            grad_maps[1] = ops.head_outer(rows, summed)  # sum_i dO_ih s_ih^T
        return (grad_q if needs[0] else None, grad_k if needs[1] else None, grad_v if needs[2] else None, grad_bias,
                grads[4] if sinks_grad else None, d_features if needs[5] else None, *grad_maps, *unused)


def _textbook(ctx):
    """:class:`MappedAttention`'s forward on plain autograd ops: the fused kernel's textbook path
    (:func:`tgattn.engine.fused.textbook`) with the maps as einsums, twice differentiable: what its backward
    differentiates under ``create_graph=True``."""

    def attend(q, k, v, bias, sinks, features, key_maps, value_maps):
        edge_q = None if key_maps is None else torch.einsum("nhd,hdf->nhf", q, key_maps)  # W_h^T q_i
        out, w, summed = textbook(ctx.s, ctx.scale, ctx.softcap, ctx.p, ctx.seed, value_maps is not None)(
            q, k, v, bias, sinks, edge_q, features)
        if value_maps is not None:  # + W_h sum_j a_ij e_ij
            out = out + torch.einsum("nhf,hdf->nhd", summed, value_maps)
        return out, w

    return attend


def shared_features(key: Optional[Term], value: Optional[Term]) -> Optional[Tensor]:
    """The features ``[E, F]`` the given terms map, when every given term is a ``(features, weight)``
    pair and both read the same features tensor: the form the fused kernel takes natively
    (:func:`tgattn.engine.fused.fused_attention`'s ``edge_features``); else None."""
    terms = [t for t in (key, value) if t is not None]
    if terms and all(t.weight is not None and t.values is terms[0].values for t in terms):
        return terms[0].values
    return None


def key_scores(q: Tensor, dst: Tensor, term: Term, scale: float) -> Tensor:
    """``scale * <q_i, ek_ij>`` per edge and head ``[E, H]``; ``q`` is ``[Nq, H, d]``, ``dst`` the queries i.

    They join the scores as a bias, where ``+inf`` is refused (a caller's ``+inf`` bias has no softmax).
    Here ``+inf`` comes from infinite inputs (edge features, queries): it becomes NaN, what the softmax
    of a ``+inf`` score is, so that its query's output is NaN on every backend, as with an infinite key
    or ``TransformerConv``'s edge features; ``-inf`` gives its edge weight 0, as in the softmax.
    """
    heads = q.shape[1]
    if term.factored():
        per_edge = key_features(q, per_head(term, q.dtype)).index_select(0, dst)  # [E, H, F]
        scores = torch.bmm(per_edge, term.values.to(q.dtype).unsqueeze(-1)).view(-1, heads) * scale  # [E, H]
    else:
        scores = (q.index_select(0, dst) * term.vectors().to(q.dtype)).sum(-1) * scale  # [E, H]
    return scores * (scores != float("inf"))  # inf * 0 is NaN; one kernel fewer than a where, and in its gradient


def value_sum(used: Tensor, dst: Tensor, term: Term, num_queries: int) -> Tensor:
    """``sum_j used_ij ev_ij`` per query and head ``[Nq, H, d]``; ``used`` are the weights ``[E, H]``
    as applied to the values (after dropout and an edge scale)."""
    heads = used.shape[1]
    if term.factored():
        features = term.values.to(used.dtype)  # [E, F]
        per_edge = torch.bmm(used.unsqueeze(-1), features.unsqueeze(1))  # [E, H, F]: a_ij e_ij
        summed = used.new_zeros(num_queries, heads, features.shape[1]).index_add_(0, dst, per_edge)  # [Nq, H, F]
        return project(summed, per_head(term, used.dtype))  # W^h sum_j a_ij e_ij
    vectors = term.vectors().to(used.dtype)  # [E, H, d]
    return used.new_zeros(num_queries, heads, vectors.shape[2]).index_add_(0, dst, used.unsqueeze(-1) * vectors)
