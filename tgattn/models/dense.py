"""The dense twin of :class:`tgattn.GraphAttention` inside the GPT: SDPA with a boolean mask.

Same parameters under the same names (``q_proj``, ``k_proj``, ``v_proj``, ``out_proj``), so a
:class:`~tgattn.models.GPT` with ``attention="dense"`` loads the state dict of one with
``attention="graph"`` and computes the same function.
"""
from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class DenseAttention(nn.Module):
    """Multi-head self-attention over ``[B, T]`` token grids, masked by ``mask [B, T, T]``.

    ``mask[b, i, j] = True`` lets query i of sequence b attend to its key j (rows = queries i,
    columns = keys j). Every row must hold at least one ``True`` (the GPT checks this).

    Args:
        embed_dim (int): model dimension D.
        num_heads (int): number of heads H.
        dropout (float, optional): dropout on attention weights in training (default: 0).
        bias (bool, optional): bias in the projections (default: True).

    Example:
        >>> attn = DenseAttention(8, 2)
        >>> mask = torch.ones(3, 5, 5, dtype=torch.bool).tril()
        >>> attn(torch.randn(15, 8), mask).shape
        torch.Size([15, 8])
    """

    def __init__(self, embed_dim: int, num_heads: int, *, dropout: float = 0.0, bias: bool = True):
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, embed_dim // num_heads
        self.dropout = dropout
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)

    def project(self, x: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """Per-head queries, keys and values ``[N, H, d]`` (as :meth:`GraphAttention.project`)."""
        h, d = self.num_heads, self.head_dim
        return tuple(lin(x).view(-1, h, d) for lin in (self.q_proj, self.k_proj, self.v_proj))

    def forward(self, x: Tensor, mask: Tensor, return_attention_weights: bool = False):
        """``x [B*T, D]`` (sequences packed back to back) -> ``[B*T, D]``.

        With ``return_attention_weights=True`` also returns the weights ``[B, H, T, T]``
        (computed explicitly; the fast SDPA path does not expose them).
        """
        b, t = mask.shape[0], mask.shape[1]
        q, k, v = (z.view(b, t, self.num_heads, self.head_dim).transpose(1, 2) for z in self.project(x))  # [B, H, T, d]
        p = self.dropout if self.training else 0.0
        weights = None
        if return_attention_weights:
            scores = q @ k.transpose(-1, -2) * self.head_dim**-0.5  # [B, H, T, T]
            weights = scores.masked_fill(~mask.unsqueeze(1), float("-inf")).softmax(dim=-1)
            out = F.dropout(weights, p, self.training) @ v  # [B, H, T, d]
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1), dropout_p=p)
        out = self.out_proj(out.transpose(1, 2).reshape(b * t, self.embed_dim))  # [B*T, D]
        return (out, weights) if return_attention_weights else out
