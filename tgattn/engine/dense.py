"""Dense backend: ``scaled_dot_product_attention`` for edge sets proven full or causal.

Used only when the analysis shows that the edge set *is* full or causal attention (of one
sequence, or block-diagonal over a packed batch), so the dense kernel does exactly the
work of the edge set and nothing else. Packed batches are grouped by sequence length and
each group runs as one batched SDPA call.

An edge bias becomes SDPA's float mask, one ``[H or 1, L, L]`` block per sequence (``-inf``
off the pattern), and dropout is SDPA's ``dropout_p``. Rows whose keys all carry bias
``-inf`` output 0 (the contract's empty-row rule; SDPA alone would give NaN).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .analysis import Structure, on_host
from .csr import recompute_exact
from .recompute import all_finite, grads_through, recompute_grads


def _sdpa(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, mask: Optional[Tensor], p: float) -> Tensor:
    """``[B, L, H, d]`` inputs, float ``mask [B, H or 1, L, L]`` -> ``[B, L, H, dv]``."""
    dead = None
    if mask is not None:
        dead = torch.isneginf(mask).all(-1, keepdim=True)  # [B, H or 1, L, 1] rows with no usable key
        if on_host(mask) and not bool(dead.any()):  # on a device, no read-back: fill unconditionally
            dead = None
        else:
            mask = mask.masked_fill(dead, 0.0)  # finite rows for SDPA (no NaN, also in backward); zeroed below
    if scale < torch.finfo(torch.float32).tiny:
        # SDPA's CPU kernels scale their causal -inf with the scores (0 * -inf = NaN; a negative
        # scale makes it +inf), in float32 for float32 inputs, where a scale of 1e-50 is 0 too:
        # give them scale 1 and queries scaled here.
        q, scale = q * scale, 1.0
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=mask, dropout_p=p, is_causal=causal and mask is None, scale=scale,
    )  # [B, H, L, dv]
    if dead is not None:
        out = out.masked_fill(dead, 0.0)
    return out.transpose(1, 2)


def _block_mask(bias: Tensor, s: Structure, first: Tensor, length: int, keys: int, causal: bool) -> Tensor:
    """Float mask ``[B, H or 1, L, keys]`` of the blocks whose first row is ``first [B]``.

    ``bias`` is ``[E, H or 1]`` in sorted (query, key) order, so each block's edges are one
    contiguous run, row-major: all ``L * keys`` cells of a full block, the lower triangle of a
    causal one (``-inf`` above it; causal blocks are square).
    """
    per_block = length * (length + 1) // 2 if causal else length * keys
    if first.numel() * per_block == bias.shape[0]:  # these blocks hold every edge, in order
        vals = bias
    else:
        offsets = torch.arange(per_block, device=bias.device)
        vals = bias[(s.rowptr[first].unsqueeze(1) + offsets).reshape(-1)]  # [B * per_block, Hb]
    vals = vals.view(first.numel(), per_block, bias.shape[1])
    if causal:
        rows, cols = torch.tril_indices(length, length, device=bias.device)  # row-major = sorted order
        mask = vals.new_full((first.numel(), length, length, bias.shape[1]), float("-inf"))
        mask[:, rows, cols] = vals
    else:
        mask = vals.view(first.numel(), length, keys, bias.shape[1])
    return mask.permute(0, 3, 1, 2)  # [B, Hb, L, keys]


class DenseAttention(torch.autograd.Function):
    """SDPA with a guarded backward: SDPA's own gradients, unless the upstream gradient holds
    NaN / inf (SDPA would spread it to keys outside a query's edges: ``0 * nan``) or a double
    backward is asked for (SDPA's CPU kernels have none); then edge-wise recomputation."""

    @staticmethod
    def forward(ctx, q, k, v, bias, s: Structure, scale: float, p: float):
        leaves = [None if t is None else t.detach().requires_grad_(t.requires_grad) for t in (q, k, v, bias)]
        with torch.enable_grad():
            out = _dense(*leaves[:3], s, scale, leaves[3], p)
        ctx.save_for_backward(q, k, v, bias)
        ctx.inner, ctx.s, ctx.scale, ctx.p = (leaves, out), s, scale, p
        return out.detach()

    @staticmethod
    def backward(ctx, grad_out):
        needs = ctx.needs_input_grad[:4]
        create_graph = torch.is_grad_enabled()
        if create_graph and ctx.p > 0:
            raise RuntimeError("tgattn: a double backward through attention dropout is not supported; use dropout_p=0")
        if create_graph or (ctx.p == 0 and on_host(grad_out) and not all_finite(grad_out)):
            exact = recompute_exact(ctx.s, ctx.scale, create_graph=create_graph)
            grads = recompute_grads(exact, ctx.saved_tensors, (grad_out,), needs)
            return (*grads, None, None, None)
        leaves, out = ctx.inner
        # retain_graph: gradcheck and retain_graph=True callers go through this node again; what
        # SDPA saved is mostly the inputs and output themselves (shared storage).
        grads = grads_through((out,), leaves, (grad_out,), needs, retain_graph=True)
        return (*grads, None, None, None)


def dense_attention(
    q: Tensor, k: Tensor, v: Tensor, s: Structure, scale: float, bias: Optional[Tensor] = None, dropout_p: float = 0.0
) -> Tensor:
    """Full / causal / packed attention through SDPA; ``s.kind`` must be in ``DENSE_KINDS``.

    ``bias`` is ``[E, 1 or H]`` in sorted edge order; ``dropout_p`` drops attention weights.
    With dropout, a NaN upstream gradient follows SDPA's backward (the dropped cells cannot be
    recomputed).
    """
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, bias)):
        return DenseAttention.apply(q, k, v, bias, s, scale, dropout_p)
    return _dense(q, k, v, s, scale, bias, dropout_p)


def _dense(q: Tensor, k: Tensor, v: Tensor, s: Structure, scale: float, bias: Optional[Tensor], dropout_p: float) -> Tensor:
    causal = s.kind in ("causal", "packed_causal")
    lengths = s.lengths if s.lengths is not None else (s.n_q,)  # host ints: no device read-back

    def attend(rows: Optional[Tensor], first: Tensor, length: int) -> Tensor:  # -> [B * L, H, dv]
        pick = (lambda t: t) if rows is None else (lambda t: t[rows])  # noqa: E731
        shape = lambda t: pick(t).reshape(first.numel(), -1, *t.shape[1:])  # noqa: E731  # [B, L, H, d]
        keys = s.n_k if s.kind == "full" else length  # a full set may be rectangular (cross attention)
        mask = None if bias is None else _block_mask(bias, s, first, length, keys, causal)
        return _sdpa(shape(q), shape(k), shape(v), causal, scale, mask, dropout_p).reshape(-1, q.shape[1], v.shape[2])

    if len(set(lengths)) == 1:  # equal lengths (one sequence included): a reshape, no gather
        return attend(None, torch.arange(0, s.n_q, lengths[0], device=q.device), lengths[0])
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
    pieces = [(rows, attend(rows, first, length)) for length, first, rows in _groups(s, q.device)]
    rows = torch.cat([r for r, _ in pieces])
    return out.index_copy(0, rows, torch.cat([o for _, o in pieces]))


def _groups(s: Structure, device: torch.device) -> list:
    """``[(length, first rows [B], rows [B * length])]`` per distinct sequence length, cached on ``s``.

    Built once per edge set, so later calls send no index tensor to the device (no sync).
    """
    cached = s.extras.get("dense_groups")
    if cached is None:
        lengths = torch.tensor(s.lengths, device=device)
        starts = torch.cumsum(lengths, 0) - lengths
        cached = []
        for length in sorted(set(s.lengths)):
            first = starts[lengths == length]  # [B]
            cached.append((length, first, (first.unsqueeze(1) + torch.arange(length, device=device)).reshape(-1)))
        s.extras["dense_groups"] = cached
    return cached
