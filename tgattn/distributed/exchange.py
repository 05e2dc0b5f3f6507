"""The halo exchange: fill a rank's key table with one ``all_to_all_single``, differentiably.

Forward, each rank sends the rows ``x[plan.send_index]`` its peers asked for and receives its
halo; the result is the key table ``[K_r, ...]`` of :class:`~tgattn.distributed.plan.HaloPlan`
(lower ranks' rows, own rows, higher ranks' rows). Backward runs the same routes in reverse:
the gradient of each halo row goes back to its owner, which adds it onto the row it sent
(``index_add``, since one row may go to several ranks). ``all_to_all_single`` takes uneven
split sizes on gloo (CPU) and NCCL (GPU), so nothing is padded.
"""
from __future__ import annotations

import time
from typing import Optional

import torch
from torch import Tensor

from .plan import ExchangeStats, HaloPlan


def _all_to_all(rows: Tensor, out_counts, in_counts, group, stats: Optional[ExchangeStats]) -> Tensor:
    import torch.distributed as dist

    start = time.perf_counter()
    rows = rows.contiguous()
    out = rows.new_empty((sum(out_counts),) + tuple(rows.shape[1:]))
    dist.all_to_all_single(out, rows, out_counts, in_counts, group=group)
    if stats is not None:
        stats.add(rows, out, time.perf_counter() - start)
    return out


class _HaloExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, plan: HaloPlan) -> Tensor:
        ctx.plan = plan
        halo = _all_to_all(x[plan.send_index], plan.recv_counts, plan.send_counts, plan.group, plan.stats)  # [R, ...]
        lo = plan.own_offset
        return torch.cat([halo[:lo], x, halo[lo:]])  # [K_r, ...]

    @staticmethod
    def backward(ctx, grad: Tensor):
        plan = ctx.plan
        lo, n = plan.own_offset, plan.num_queries
        halo_grad = torch.cat([grad[:lo], grad[lo + n:]])  # [R, ...], in the order received
        back = _all_to_all(halo_grad, plan.send_counts, plan.recv_counts, plan.group, plan.stats)  # [S, ...]
        return grad[lo:lo + n].index_add(0, plan.send_index, back), None


def halo_exchange(x: Tensor, plan: HaloPlan) -> Tensor:
    """The key table of this rank: its own rows ``x [N_r, ...]`` plus the halo from its peers.

    Collective: every rank of ``plan.group`` calls it (forward and backward) at the same time.
    With one rank it returns ``x`` itself.

    Args:
        x: this rank's rows ``[N_r, ...]`` (keys, values, or node features).
        plan: this rank's :class:`~tgattn.distributed.plan.HaloPlan` (its ``stats``, when
            set, count the exchange).

    Returns:
        ``[K_r, ...]``, row j holding global node ``plan.keys[j]``.
    """
    if x.shape[0] != plan.num_queries:
        raise ValueError(f"x has {x.shape[0]} rows, but rank {plan.rank} owns {plan.num_queries} nodes")
    if plan.world_size == 1:
        return x
    return _HaloExchange.apply(x, plan)
