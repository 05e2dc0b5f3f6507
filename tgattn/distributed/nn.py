"""Layers whose forward takes this rank's part: ``layer(x_local, plan)``.

:class:`DistributedGraphAttention` and :class:`DistributedGraphAttentionConv` are
:class:`tgattn.GraphAttention` and :class:`tgattn.GraphAttentionConv` (same parameters, same
``state_dict``) whose forward projects the local rows, exchanges the halo of keys and values
(:func:`~tgattn.distributed.attention.exchange_keys_values`) and attends along
``plan.edge_index``. Keys and values travel after the projection: ``2 H d`` numbers per halo row
(on Cora's first layer 128 instead of the 1,433 input features).
"""
from __future__ import annotations

from typing import Optional

from torch import Tensor, nn

from ..nn.attention import GraphAttention
from ..nn.conv import GraphAttentionConv
from .attention import graph_attention
from .plan import HaloPlan


def _local_input(x, plan: HaloPlan) -> Tensor:
    if not isinstance(x, Tensor):
        raise ValueError("distributed layers run self-attention only: pass x [N_r, D], not a (x_kv, x_q) pair")
    if x.shape[0] != plan.num_queries:
        raise ValueError(f"x has {x.shape[0]} rows, but rank {plan.rank} owns {plan.num_queries} nodes")
    return x


class DistributedGraphAttention(GraphAttention):
    """:class:`tgattn.GraphAttention` over a partitioned graph: ``x [N_r, D] -> [N_r, D]``.

    Collective (every rank of ``plan.group`` calls it). All ranks together compute what one
    ``GraphAttention`` with the same weights computes on the whole graph.

    Example:
        >>> import torch
        >>> from tgattn import builders
        >>> from tgattn.distributed import contiguous, make_plan
        >>> layer = DistributedGraphAttention(16, 4)
        >>> plan = make_plan(builders.causal(6), contiguous(6, 1))  # one rank, no process group
        >>> layer(torch.randn(6, 16), plan).shape
        torch.Size([6, 16])
    """

    def forward(self, x: Tensor, plan: HaloPlan, edge_bias: Optional[Tensor] = None,
                return_attention_weights: bool = False, *, backend: str = "auto"):
        """Attend along ``plan.edge_index``.

        Args:
            x: features of this rank's nodes ``[N_r, D]`` (order of ``plan.nodes``).
            plan: this rank's :class:`~tgattn.distributed.plan.HaloPlan`.
            edge_bias: ``[E_r]`` or ``[E_r, H]`` in the order of ``plan.edge_index``.
            return_attention_weights: also return ``(edges [2, E_r] in global ids, alpha [E_r, H])``.
            backend: an engine backend of :func:`tgattn.functional.graph_attention`.
        """
        q, k, v = self.project(_local_input(x, plan))
        p = self.dropout if self.training else 0.0
        out = graph_attention(q, k, v, plan, bias=edge_bias, dropout_p=p, return_weights=return_attention_weights,
                              backend=backend)
        out, alpha = out if return_attention_weights else (out, None)
        out = self.out_proj(out.reshape(-1, self.embed_dim))  # [N_r, D]
        return (out, (plan.global_edges(), alpha)) if return_attention_weights else out

    @classmethod
    def from_layer(cls, layer: GraphAttention) -> "DistributedGraphAttention":
        """A distributed layer with a copy of ``layer``'s weights."""
        w = layer.out_proj.weight
        new = cls(layer.embed_dim, layer.num_heads, dropout=layer.dropout, bias=layer.q_proj.bias is not None,
                  kdim=layer.kdim, vdim=layer.vdim).to(device=w.device, dtype=w.dtype)
        new.load_state_dict(layer.state_dict())
        return new


class DistributedGraphAttentionConv(GraphAttentionConv):
    """:class:`tgattn.GraphAttentionConv` over a partitioned graph: ``x [N_r, F] -> [N_r, H * C]``.

    Same arguments as ``GraphAttentionConv`` except ``add_self_loops``, which must stay
    ``False``: the edge set is fixed when the plan is made, so add the loops to the graph
    before partitioning (``torch_geometric.utils.add_self_loops``).

    Example:
        >>> import torch
        >>> from tgattn.distributed import contiguous, make_plan
        >>> conv = DistributedGraphAttentionConv(16, 8, heads=2)
        >>> plan = make_plan(torch.tensor([[0, 1, 2], [1, 2, 0]]), contiguous(3, 1))
        >>> conv(torch.randn(3, 16), plan).shape
        torch.Size([3, 16])
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.add_self_loops:
            raise ValueError("add_self_loops=True would change the edge set after partitioning; add the loops "
                             "to the graph before making the plan and keep add_self_loops=False")

    def forward(self, x: Tensor, plan: HaloPlan, edge_attr: Optional[Tensor] = None,
                return_attention_weights: bool = False, *, edge_bias: Optional[Tensor] = None,
                backend: str = "auto"):
        """Attend along ``plan.edge_index``; ``edge_attr [E_r, edge_dim]`` and ``edge_bias`` follow
        its edge order. Other arguments as in :meth:`DistributedGraphAttention.forward`."""
        x = _local_input(x, plan)
        H, C = self.heads, self.out_channels
        if (edge_attr is None) != (self.edge_dim is None and self.edge_bias_dim is None):
            raise ValueError("edge_attr must be given exactly when edge_dim or edge_bias_dim is set "
                             f"(edge_dim={self.edge_dim}, edge_bias_dim={self.edge_bias_dim})")
        edge_attr = self._check_edge_attr(edge_attr, plan.edge_index.shape[1])  # [E_r, F] or None
        bias = self._score_bias(edge_attr, edge_bias)  # [E_r, H], [E_r] or None
        term = None if self.lin_edge is None else (edge_attr, self.lin_edge.weight)  # W_E e_ij in keys and values
        q = self.lin_query(x).view(-1, H, C)  # [N_r, H, C]
        k, v = (q, q) if self.shared_projection else (self.lin_key(x).view(-1, H, C), self.lin_value(x).view(-1, H, C))
        p = self.dropout if self.training else 0.0
        out = graph_attention(q, k, v, plan, bias=bias, dropout_p=p, return_weights=return_attention_weights,
                              backend=backend, edge_key=term, edge_value=term)
        out, alpha = out if return_attention_weights else (out, None)
        out = out.reshape(-1, H * C) if self.concat else out.mean(dim=1)  # [N_r, H*C] or [N_r, C]
        out = self._with_root(out, None if self.lin_skip is None else self.lin_skip(x))
        return (out, (plan.global_edges(), alpha)) if return_attention_weights else out

    @classmethod
    def from_conv(cls, conv: GraphAttentionConv) -> "DistributedGraphAttentionConv":
        """A distributed conv with a copy of ``conv``'s weights (``conv.add_self_loops`` must be False)."""
        if conv.add_self_loops:
            raise ValueError(f"{conv} adds self-loops; add them to the graph before partitioning and build "
                             "the conv with add_self_loops=False")
        w = conv.lin_query.weight
        new = cls(conv.in_channels, conv.out_channels, conv.heads, conv.concat, conv.beta, conv.dropout, conv.edge_dim,
                  conv.lin_query.bias is not None, conv.root_weight, edge_bias_dim=conv.edge_bias_dim,
                  shared_projection=conv.shared_projection).to(device=w.device, dtype=w.dtype)
        new.load_state_dict(conv.state_dict())
        return new


def distribute(module: nn.Module) -> nn.Module:
    """Swap, in place, every ``GraphAttention`` / ``GraphAttentionConv`` inside ``module`` for its
    distributed twin with a copy of its weights; returns ``module``.

    A model whose layers are called as ``layer(x, edge_index, ...)`` then runs on one rank's
    part when its forward receives a plan in place of the edge set (the tiny GPT's blocks and
    the Planetoid ``Net`` are such models).

    Raises:
        ValueError: for a conv with ``add_self_loops=True`` (see :class:`DistributedGraphAttentionConv`).
    """
    for name, child in module.named_children():
        if isinstance(child, (DistributedGraphAttention, DistributedGraphAttentionConv)):
            continue
        if isinstance(child, GraphAttention):
            setattr(module, name, DistributedGraphAttention.from_layer(child))
        elif isinstance(child, GraphAttentionConv):
            setattr(module, name, DistributedGraphAttentionConv.from_conv(child))
        else:
            distribute(child)
    return module
