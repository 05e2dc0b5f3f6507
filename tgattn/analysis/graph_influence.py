"""Who influences a node of a graph: attention flow beside PyG's Jacobian influence.

PyG 2.7 measures influence by the Jacobian (:func:`torch_geometric.utils.influence.jacobian_l1`:
the L1 norm of the derivative of node v's output with respect to each node's features, Gao et
al., 2025); attention flow measures it by the attention weights alone (Abnar & Zuidema, 2020).
They are different quantities: :func:`flow_beside_jacobian` puts them side by side, per node
and summed per hop, as a comparison, not a claim that they agree.
"""
from __future__ import annotations

from typing import List, NamedTuple, Sequence

import torch
from torch import Tensor

from .flow import attention_flow


class Beside(NamedTuple):
    """Attention flow and Jacobian influence into one node: per node ``[N]`` and per hop ``[hops + 1]``."""

    flow: Tensor
    jacobian: Tensor
    flow_per_hop: Tensor
    jacobian_per_hop: Tensor


class Stack(torch.nn.Module):
    """Attention layers applied in turn (ELU between them): ``forward(x, edge_index) -> [N, C]``, as
    :func:`torch_geometric.utils.total_influence` calls a model; :meth:`attention` returns each layer's
    ``(edge_index, alpha)``."""

    def __init__(self, convs: Sequence[torch.nn.Module]):
        super().__init__()
        self.convs = torch.nn.ModuleList(convs)

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        for number, conv in enumerate(self.convs):
            x = conv(x, edge_index)
            x = torch.nn.functional.elu(x) if number < len(self.convs) - 1 else x
        return x

    @torch.no_grad()
    def attention(self, x: Tensor, edge_index: Tensor) -> List:
        layers = []
        for number, conv in enumerate(self.convs):
            x, (ei, alpha) = conv(x, edge_index, return_attention_weights=True)
            x = torch.nn.functional.elu(x) if number < len(self.convs) - 1 else x
            layers.append((ei, alpha))
        return layers


def flow_beside_jacobian(model: Stack, x: Tensor, edge_index: Tensor, node: int) -> Beside:
    """Attention flow into ``node`` through ``model``'s layers, and PyG's Jacobian influence on it.

    Hops are counted as PyG counts them (:func:`torch_geometric.utils.influence.k_hop_subsets_exact`,
    messages flowing along ``edge_index[0] -> edge_index[1]``), up to the number of layers.

    Example:
        >>> from tgattn import GraphAttentionConv
        >>> _ = torch.manual_seed(0)
        >>> model = Stack([GraphAttentionConv(4, 4, heads=2, concat=False) for _ in range(2)])
        >>> edge_index = torch.tensor([[0, 1, 2, 3, 1, 2, 0], [1, 2, 3, 0, 1, 2, 0]])
        >>> side = flow_beside_jacobian(model, torch.randn(4, 4), edge_index, node=3)
        >>> side.flow_per_hop.shape, float(side.jacobian_per_hop[0])  # hop 0: the node itself, normalised to 1
        (torch.Size([3]), 1.0)
    """
    from torch_geometric.data import Data
    from torch_geometric.utils.influence import jacobian_l1, k_hop_subsets_exact

    n, hops = x.shape[0], len(model.convs)
    if isinstance(node, bool) or not isinstance(node, int) or not 0 <= node < n:
        raise ValueError(f"node must be in [0, {n}) (got {node!r})")
    flow = attention_flow(model.attention(x, edge_index), node, num_nodes=n)  # [N]
    # vectorize=False: the fused kernel's backward has no vmap batching rule (total_influence's default fails)
    jacobian = jacobian_l1(model, Data(x=x, edge_index=edge_index), hops, node, "cpu", vectorize=False).double()
    subsets = k_hop_subsets_exact(node, hops, edge_index, n, torch.device("cpu"))
    per_hop = [torch.stack([values[s].sum() for s in subsets]) for values in (flow, jacobian)]
    return Beside(flow, jacobian, per_hop[0] / per_hop[0][0], per_hop[1] / per_hop[1][0])
