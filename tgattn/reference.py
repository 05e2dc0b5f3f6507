"""The dense oracle: explicit masked softmax attention, written for clarity, not speed.

Every test of tgattn compares a graph-attention result with :func:`dense_attention`, and
``python -m tgattn verify`` does on the user's machine (:mod:`tgattn.verify`). The design
contract names it ``tgattn.reference.dense_attention``: this module is its one path.
It materializes the full ``[H, Nq, Nk]`` score matrix, so use it on small inputs only.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def dense_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Optional[Tensor],
    *,
    bias: Optional[Tensor] = None,
    scale: Optional[float] = None,
    return_weights: bool = False,
):
    r"""Masked scaled-dot-product attention, computed densely.

    For query i, head h and the keys ``j`` with ``mask[h, i, j]`` true:

    .. math::
        s_{ij} = \text{scale}\,\langle q_i, k_j\rangle + b_{ij}, \qquad
        a_{ij} = \frac{\exp(s_{ij} - \max_j s_{ij})}{\sum_j \exp(s_{ij} - \max_j s_{ij})}, \qquad
        o_i = \sum_j a_{ij} v_j

    A query that sees no key (or only keys with score ``-inf``) outputs 0 with zero gradient,
    never NaN.

    Args:
        q: queries ``[Nq, H, dk]``.
        k: keys ``[Nk, H, dk]``.
        v: values ``[Nk, H, dv]`` (``dv`` may differ from ``dk``).
        mask: boolean ``[Nq, Nk]`` or per head ``[H, Nq, Nk]``; ``True`` = query i may attend
            to key j (rows = queries i, columns = keys j; the ``attn_mask`` convention of
            :func:`torch.nn.functional.scaled_dot_product_attention`). ``None`` = all pairs.
        bias: additive scores ``[Nq, Nk]`` or ``[H, Nq, Nk]``; may hold ``-inf``.
        scale: score scale (default: ``1 / sqrt(dk)``).
        return_weights: also return the attention matrix ``[H, Nq, Nk]``.

    Returns:
        ``out [Nq, H, dv]``, or ``(out, weights)`` with ``return_weights=True``.

    Example:
        >>> q = k = v = torch.eye(2).view(2, 1, 2)
        >>> mask = torch.tensor([[True, False], [True, True]])
        >>> dense_attention(q, k, v, mask, scale=0.0)[:, 0]
        tensor([[1.0000, 0.0000],
                [0.5000, 0.5000]])
    """
    nq, h, dk = q.shape
    nk = k.shape[0]
    if scale is None:
        scale = dk**-0.5
    scores = torch.einsum("ihd,jhd->hij", q, k) * scale  # [H, Nq, Nk]
    if bias is not None:
        scores = scores + bias.expand(h, nq, nk)
    if mask is None:
        mask = torch.ones(nq, nk, dtype=torch.bool, device=q.device)
    if nk == 0:
        weights = scores  # [H, Nq, 0]: nothing to normalise, every row is empty
    else:
        allowed = mask.expand(h, nq, nk) & (scores != float("-inf"))
        scores = scores.masked_fill(~allowed, float("-inf"))
        # The row maximum only shifts the exponent; empty rows use 0 to avoid inf - inf.
        row_max = scores.amax(dim=-1, keepdim=True).detach()
        row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
        expd = torch.exp(scores - row_max) * allowed
        denom = expd.sum(dim=-1, keepdim=True)
        weights = expd / torch.where(denom > 0, denom, torch.ones_like(denom))  # [H, Nq, Nk]
    out = torch.einsum("hij,jhd->ihd", weights, v)  # [Nq, H, dv]
    return (out, weights) if return_weights else out
