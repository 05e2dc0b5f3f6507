"""Attention written out edge by edge, in plain torch ops: an oracle that shares no code with tgattn.

For tests whose inputs the dense oracle (``tgattn.reference.dense_attention``) does not take:
per-edge key / value terms, attention sinks, duplicated edges. Slow (a loop over the queries):
for small inputs only.
"""
from typing import Optional, Tuple

import torch
from torch import Tensor


def edgewise_attention(q: Tensor, k: Tensor, v: Tensor, edge_index: Tensor, *, bias: Optional[Tensor] = None,
                       key_term: Optional[Tensor] = None, value_term: Optional[Tensor] = None,
                       sinks: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """``(out [Nq, H, dv], weights [E, H])`` of softmax attention along ``edge_index`` (row 0 = key j, row 1 = query i).

    Query i, head h: ``s_e = <q_i, k_j + key_term_e> / sqrt(dk) + bias_e`` over its edges e = (j, i),
    ``a_e = exp(s_e) / (exp(sinks_h) + sum exp(s))`` (no sink term without ``sinks``), and
    ``out_i = sum a_e (v_j + value_term_e)``; a query without edges outputs 0. Differentiable.

    Example:
        >>> q = k = v = torch.eye(2, dtype=torch.float64).view(2, 1, 2)
        >>> out, weights = edgewise_attention(q, k, v, torch.tensor([[0, 0, 1], [0, 1, 1]]))
        >>> weights[:, 0].tolist()[0], out[0, 0].tolist()
        (1.0, [1.0, 0.0])
    """
    src, dst = edge_index
    kj = k[src] if key_term is None else k[src] + key_term  # [E, H, dk]
    vj = v[src] if value_term is None else v[src] + value_term  # [E, H, dv]
    scores = (q[dst] * kj).sum(-1) / q.shape[-1] ** 0.5  # [E, H]
    if bias is not None:
        scores = scores + (bias.view(-1, 1) if bias.dim() == 1 else bias)
    weights = torch.zeros_like(scores)
    rows = []
    for i in range(q.shape[0]):
        mine = (dst == i).nonzero().flatten()  # the query's edges, a duplicate once per copy
        logits = scores[mine] if sinks is None else torch.cat([scores[mine], sinks.view(1, -1).to(scores)])
        share = logits.softmax(0)[: mine.numel()]  # [edges of i, H] (the sink's share dropped)
        weights = weights.index_put((mine,), share)
        rows.append((share.unsqueeze(-1) * vj[mine]).sum(0))  # [H, dv]
    return torch.stack(rows), weights
