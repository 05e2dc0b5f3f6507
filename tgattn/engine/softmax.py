"""Softmax over the edges that share a target: the normalisation of every edge-wise path."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def edge_softmax(scores: Tensor, index: Tensor, num_nodes: int, sinks: Optional[Tensor] = None) -> Tensor:
    """Softmax of edge scores ``[E, H]`` over the edges that share a target ``index``.

    Edges with score ``-inf`` get weight 0; a target whose edges are all ``-inf`` gets all-zero
    weights (and zero gradient) instead of NaN. ``sinks`` (``[H]``, gpt-oss's ``s_aux``) adds one
    logit per head to every target's max and denominator, with no edge: the weights then sum to
    ``1 - exp(sink - max) / denom``. A NaN score or sink makes its target's denominator, hence all
    of its weights, NaN (not a denominator of 1 that would leave the weights unnormalised).
    """
    h = scores.shape[1]
    idx = index.unsqueeze(-1).expand(-1, h)
    row_max = scores.new_full((num_nodes, h), float("-inf"))
    if sinks is not None:
        row_max = row_max.copy_(sinks.detach().expand(num_nodes, h))  # [n, H]
    row_max = row_max.scatter_reduce(0, idx, scores.detach(), "amax", include_self=True)
    # Rows without a finite score shift by 0: exp(-inf - 0) = 0 instead of NaN.
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    expd = torch.exp(scores - row_max[index])  # [E, H]
    denom = scores.new_zeros(num_nodes, h).index_add_(0, index, expd)
    if sinks is not None:
        denom = denom + torch.exp(sinks - row_max)  # [n, H]
    denom = torch.where(denom == 0, torch.ones_like(denom), denom)  # empty rows; NaN stays NaN
    return expd / denom[index]
