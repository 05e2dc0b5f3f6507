"""Exphormer on tgattn: GPS layers whose global attention runs over the Exphormer edge set."""
from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor, nn

from .. import builders
from ..edgeset import EdgeSet
from ..builders._common import check_count
from .gps import GPSConv

# Kinds of Exphormer attention edges, in the order exphormer_edge_kinds numbers them.
EDGE_KINDS = ("graph", "self_loop", "virtual", "expander")


def exphormer_edge_kinds(attn_edge_index: Tensor, edge_index: Tensor, num_nodes: int) -> Tensor:
    """Kind of each edge of an Exphormer set: 0 graph edge, 1 self-loop, 2 virtual-node edge, 3 expander.

    An edge that is both (a graph edge that the expander drew too) gets the first kind.
    Virtual nodes are those numbered ``>= num_nodes`` (:func:`tgattn.builders.virtual_nodes`).

    Args:
        attn_edge_index: the Exphormer set ``[2, E]`` (:func:`tgattn.builders.exphormer`).
        edge_index: the graph's own edges on the ``num_nodes`` real nodes.
        num_nodes: number of real nodes N.

    Example:
        >>> path = torch.tensor([[0, 1], [1, 0]])
        >>> e = builders.exphormer(path, 2, 0)  # node 2 is virtual
        >>> exphormer_edge_kinds(e, path, 2).tolist()
        [1, 0, 2, 0, 1, 2, 2, 2, 1]
    """
    kind = torch.full((attn_edge_index.shape[1],), 3, dtype=torch.long, device=attn_edge_index.device)
    kind[(attn_edge_index >= num_nodes).any(0)] = 2
    kind[attn_edge_index[0] == attn_edge_index[1]] = 1
    kind[builders.membership(attn_edge_index, edge_index.to(attn_edge_index.device)) == 0] = 0
    return kind


class VirtualNodes(nn.Module):
    """Learned features of ``k`` virtual nodes per graph, appended after the real nodes.

    ``forward(x, num_graphs)`` returns ``[N + num_graphs * k, D]``: the rows of virtual node
    ``t`` of graph ``b`` sit at ``N + b * k + t``, the numbering of
    :func:`tgattn.builders.virtual_nodes`. Every graph starts from the same ``k`` vectors.

    Example:
        >>> VirtualNodes(2, 8)(torch.zeros(5, 8), num_graphs=3).shape
        torch.Size([11, 8])
    """

    def __init__(self, k: int, channels: int):
        super().__init__()
        self.k = check_count("k", k)
        self.weight = nn.Parameter(torch.empty(self.k, check_count("channels", channels, 1)))
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: Tensor, num_graphs: int) -> Tensor:
        return torch.cat([x, self.weight.repeat(num_graphs, 1)])  # [N + B k, D]


class ExphormerConv(GPSConv):
    r"""A GPS layer with Exphormer's sparse global attention, exact softmax, learned bias per edge kind.

    Shirzad et al., "Exphormer: Sparse Transformers for Graphs", ICML 2023
    (https://arxiv.org/abs/2303.06147): the global branch of a GPS layer (:class:`GPSConv`)
    attends over the graph's edges, a random regular expander and virtual nodes
    (:func:`tgattn.builders.exphormer`) instead of all node pairs, so its cost is linear in
    the number of nodes. Exphormer's code scores an edge by ``(q_i * k_j * e_ij).sum()`` with an
    edge embedding ``e_ij`` and normalises ``exp(clamp(score, -5, 5))`` by its sum ``+ 1e-6``
    (``graphgps/layer/Exphormer.py``): not a softmax (scores beyond ``±5`` are flattened, and
    the ``1e-6`` shrinks small sums). Here the score is the transformer's
    :math:`\langle q_i, k_j\rangle / \sqrt{d} + b^h_{\kappa(j, i)}` with a learned bias per edge
    kind :math:`\kappa` (graph / self-loop / virtual / expander, :data:`EDGE_KINDS`) and head,
    normalised by the exact softmax.

    ``x`` holds the N real nodes followed by the virtual nodes (:class:`VirtualNodes`); the
    local ``conv`` runs on ``edge_index`` among them as in :class:`GPSConv`.

    Args:
        channels (int): node feature size D.
        conv (MessagePassing, optional): the local message-passing layer.
        heads (int, optional): attention heads H (default: 1).
        dropout (float, optional): dropout of the GPS layer (default: 0).
        **kwargs: the other arguments of :class:`GPSConv` (``act``, ``norm``, ``attn_kwargs``, ...).

    Example:
        >>> path = torch.tensor([[0, 1, 1, 2], [1, 0, 2, 1]])
        >>> e = builders.exphormer(path, 3, 2, generator=torch.Generator().manual_seed(0))
        >>> kind = exphormer_edge_kinds(e, path, 3)
        >>> layer = ExphormerConv(8, None, heads=2)
        >>> x = VirtualNodes(1, 8)(torch.randn(3, 8), num_graphs=1)  # [4, 8]
        >>> layer(x, path, attn_edge_index=e, attn_edge_kind=kind).shape
        torch.Size([4, 8])
    """

    def __init__(self, channels: int, conv, heads: int = 1, dropout: float = 0.0, **kwargs):
        super().__init__(channels, conv, heads, dropout, **kwargs)
        self.kind_bias = nn.Embedding(len(EDGE_KINDS), heads)
        nn.init.zeros_(self.kind_bias.weight)

    def reset_parameters(self):
        super().reset_parameters()
        nn.init.zeros_(self.kind_bias.weight)

    def forward(
        self,
        x: Tensor,
        edge_index: Tensor,
        batch: Optional[Tensor] = None,
        *,
        attn_edge_index: Union[Tensor, EdgeSet],
        attn_edge_kind: Tensor,
        **kwargs,
    ) -> Tensor:
        """One layer; ``attn_edge_kind [E]`` from :func:`exphormer_edge_kinds`, ``kwargs`` to ``conv``."""
        bias = self.kind_bias(attn_edge_kind)  # [E, H]
        return super().forward(x, edge_index, batch, attn_edge_index=attn_edge_index, attn_bias=bias, **kwargs)
