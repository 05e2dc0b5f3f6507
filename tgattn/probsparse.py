"""ProbSparse self-attention (Informer): full attention for the active queries, mean of V for the rest."""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from .builders.informer import ProbSparsePattern, probsparse
from .functional import graph_attention


def lazy_values(
    v: Tensor, *, causal: bool = False, lengths: Optional[Sequence[int]] = None, num_queries: Optional[int] = None
) -> Tensor:
    """What a lazy query outputs: the mean of V over its sequence, or with ``causal=True`` the
    running mean ``(v_0 + ... + v_i) / (i + 1)``: ``[N, H, dv]`` (``[num_queries, H, dv]``
    for one non-causal sequence, where queries and keys may differ in number; no keys: 0).

    The Informer code gives causal lazy queries the cumulative *sum* of V. We use the running
    mean: it is what uniform attention over the visible keys ``j <= i`` outputs (the causal
    twin of the non-causal mean), and its scale does not grow with the position i.
    """
    if lengths is None and not causal:
        mean = v.sum(0) / max(v.shape[0], 1)  # [H, dv]
        return mean.expand(v.shape[0] if num_queries is None else num_queries, *mean.shape)
    if lengths is None:
        lengths = [v.shape[0]]
    seq = torch.repeat_interleave(torch.arange(len(lengths), device=v.device), torch.as_tensor(lengths, device=v.device))
    if not causal:
        sums = v.new_zeros(len(lengths), *v.shape[1:]).index_add_(0, seq, v)  # [B, H, dv]
        counts = torch.as_tensor(lengths, device=v.device, dtype=v.dtype).clamp(min=1)
        return (sums / counts.view(-1, 1, 1))[seq]
    csum = v.cumsum(0)  # [N, H, dv]
    starts = torch.as_tensor([0] + list(lengths[:-1]), device=v.device).cumsum(0)  # first node of each sequence
    before = torch.cat([v.new_zeros(1, *v.shape[1:]), csum])[starts[seq]]  # sum of earlier sequences
    position = torch.arange(v.shape[0], device=v.device) - starts[seq]
    return (csum - before) / (position + 1).to(v.dtype).view(-1, 1, 1)


def probsparse_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    factor: int = 5,
    *,
    causal: bool = False,
    generator: Optional[torch.Generator] = None,
    sample: Optional[Tensor] = None,
    lengths: Optional[Sequence[int]] = None,
    scale: Optional[float] = None,
    return_pattern: bool = False,
):
    """Informer's ProbSparse self-attention output ``[Nq, H, dv]``.

    Per head, the active queries chosen by :func:`tgattn.builders.probsparse` attend to all
    keys (``j <= i`` when causal) through :func:`tgattn.functional.graph_attention`; each
    lazy query outputs :func:`lazy_values` (mean of V, or its running mean when causal).
    Cost ``O(L log L)`` per head: ``L U`` sampled scores plus ``u L`` attended edges.
    Zhou et al., "Informer", AAAI 2021.

    Args:
        q, k, v: ``[Nq, H, d]``, ``[Nk, H, d]``, ``[Nk, H, dv]``.
        factor: sampling factor ``c`` (``u = U = c ceil(ln L)``).
        causal: causal variant (Informer's decoder self-attention).
        generator: ``torch.Generator`` for the key samples.
        sample: ``[Nq, U]`` key ids to score queries with instead of drawing them.
        lengths: lengths of a packed batch (each sequence on its own).
        scale: score scale for the active queries (default ``1 / sqrt(d)``).
        return_pattern: also return the :class:`~tgattn.builders.informer.ProbSparsePattern`.

    Example:
        >>> q, k, v = torch.randn(40, 2, 8), torch.randn(40, 2, 8), torch.randn(40, 2, 8)
        >>> out, p = probsparse_attention(q, k, v, 2, generator=torch.Generator().manual_seed(0), return_pattern=True)
        >>> lazy = ~p.active  # [N, H]
        >>> torch.allclose(out[lazy], v.mean(0).expand(40, 2, 8)[lazy])
        True
    """
    pattern: ProbSparsePattern = probsparse(q, k, factor, causal=causal, generator=generator, sample=sample, lengths=lengths)
    active_out = graph_attention(q, k, v, pattern.edge_index, bias=pattern.bias, scale=scale)  # [Nq, H, dv]
    lazy = lazy_values(v, causal=causal, lengths=lengths, num_queries=q.shape[0])  # [Nq, H, dv]
    out = torch.where(pattern.active.unsqueeze(-1), active_out, lazy)
    return (out, pattern) if return_pattern else out
