"""Dense backend: ``scaled_dot_product_attention`` for edge sets proven full or causal.

Used only when the analysis shows that the edge set *is* full or causal attention (of one
sequence, or block-diagonal over a packed batch), so the dense kernel does exactly the
work of the edge set and nothing else. Packed batches are grouped by sequence length and
each group runs as one batched SDPA call.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .analysis import Structure


def _sdpa(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> Tensor:
    """``[B, L, H, d]`` inputs -> ``[B, L, H, dv]`` (SDPA wants heads before positions)."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, scale=scale
    )
    return out.transpose(1, 2)


def dense_attention(q: Tensor, k: Tensor, v: Tensor, s: Structure, scale: float) -> Tensor:
    """Full / causal / packed attention through SDPA; ``s.kind`` must be in ``DENSE_KINDS``."""
    causal = s.kind in ("causal", "packed_causal")
    if s.kind in ("full", "causal"):
        return _sdpa(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), causal, scale)[0]
    lengths = torch.tensor(s.lengths, device=q.device)
    starts = torch.cumsum(lengths, 0) - lengths
    if bool((lengths == lengths[0]).all()):  # equal lengths: a reshape, no gather
        b, length = len(s.lengths), s.lengths[0]
        shape = lambda t: t.reshape(b, length, *t.shape[1:])  # noqa: E731  # [B, L, H, d]
        return _sdpa(shape(q), shape(k), shape(v), causal, scale).reshape(q.shape[0], q.shape[1], v.shape[2])
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
    pieces = []
    for length in torch.unique(lengths).tolist():
        first = starts[lengths == length]
        rows = (first.unsqueeze(1) + torch.arange(length, device=q.device)).reshape(-1)  # [B * L]
        shape = lambda t: t[rows].view(-1, length, *t.shape[1:])  # noqa: E731
        pieces.append((rows, _sdpa(shape(q), shape(k), shape(v), causal, scale).reshape(-1, *out.shape[1:])))
    rows = torch.cat([r for r, _ in pieces])
    return out.index_copy(0, rows, torch.cat([o for _, o in pieces]))
