"""Graph attention over a partitioned edge set: exchange the halo, then the ordinary engine."""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from .. import functional
from .exchange import halo_exchange
from .plan import HaloPlan


def exchange_keys_values(k: Tensor, v: Tensor, plan: HaloPlan) -> Tuple[Tensor, Tensor]:
    """Keys and values of the key table ``([K_r, H, dk], [K_r, H, dv])`` in one exchange.

    ``k`` and ``v`` travel concatenated (one message per rank pair instead of two); when they
    are the same tensor (a shared projection) it travels once.
    """
    if k is v:
        table = halo_exchange(k, plan)
        return table, table
    dk = k.shape[-1]
    table = halo_exchange(torch.cat([k, v], dim=-1), plan)  # [K_r, H, dk + dv]
    return table[..., :dk], table[..., dk:]


def graph_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    plan: HaloPlan,
    *,
    bias: Optional[Tensor] = None,
    scale: Optional[float] = None,
    dropout_p: float = 0.0,
    return_weights: bool = False,
    backend: str = "auto",
    edge_key=None,
    edge_value=None,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """:func:`tgattn.functional.graph_attention` over this rank's part of a partitioned edge set.

    Collective: every rank of ``plan.group`` calls it with its own rows. The outputs (and, in
    backward, the gradients of ``q``, ``k``, ``v`` and ``bias``) of all ranks together equal one
    process running :func:`tgattn.functional.graph_attention` on the whole edge set; dropout
    (``dropout_p > 0``) draws each rank's weights from its own random stream.

    Args:
        q, k, v: the rows of this rank's nodes ``[N_r, H, dk]``, ``[N_r, H, dk]``, ``[N_r, H, dv]``,
            in the order of ``plan.nodes``.
        plan: this rank's :class:`~tgattn.distributed.plan.HaloPlan`.
        bias: edge scores ``[E_r]`` or ``[E_r, H]`` in the order of ``plan.edge_index``.
        scale, dropout_p, return_weights, backend, edge_key, edge_value: as in
            :func:`tgattn.functional.graph_attention` (weights and edge terms in local edge order).

    Returns:
        ``out [N_r, H, dv]`` (and the weights with ``return_weights=True``).

    Example:
        >>> from tgattn import builders
        >>> from tgattn.distributed import contiguous, make_plan
        >>> plan = make_plan(builders.causal(4), contiguous(4, 1))  # one rank
        >>> q = k = v = torch.randn(4, 2, 8)
        >>> graph_attention(q, k, v, plan).shape
        torch.Size([4, 2, 8])
    """
    if q.shape[0] != plan.num_queries:
        raise ValueError(f"q has {q.shape[0]} rows, but rank {plan.rank} owns {plan.num_queries} queries")
    k_table, v_table = exchange_keys_values(k, v, plan)
    return functional.graph_attention(q, k_table, v_table, plan.edge_set, bias=bias, scale=scale,
                                      dropout_p=dropout_p, return_weights=return_weights, backend=backend,
                                      edge_key=edge_key, edge_value=edge_value)
