"""GraphAttention: multi-head transformer attention as a PyG message-passing layer."""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch_geometric.nn import MessagePassing

from .. import functional
from ..edgeset import EdgeSet, checked_edges, edge_tensor, num_edges
from .explain import explain_edge_scale

PairTensor = Tuple[Tensor, Tensor]


class GraphAttention(MessagePassing):
    r"""Transformer multi-head attention over the edges of a graph.

    The same function as :class:`torch.nn.MultiheadAttention` with the boolean mask
    ``mask[i, j] = (j, i) in edge_index``: for each head h with
    :math:`q_i = W_Q^h x_i,\ k_j = W_K^h x_j,\ v_j = W_V^h x_j`,

    .. math::
        \alpha_{ij} = \operatorname{softmax}_{j \in N(i)}
            \Big(\frac{\langle q_i, k_j\rangle}{\sqrt{d}} + b_{ij}\Big), \qquad
        x'_i = W_O \big\Vert_{h} \sum_{j \in N(i)} \alpha^h_{ij} v^h_j

    Edge convention: ``edge_index[0]`` = source = key/value node j, ``edge_index[1]`` =
    target = query node i. The layer never adds self-loops; a node without incoming edges
    outputs ``W_O 0 + b_O`` (its attention output is 0). Under a PyG explainer
    (``torch_geometric.explain``) the explainer's edge mask multiplies the attention weights,
    on the fast path as on the message-passing path.

    Args:
        embed_dim (int): model dimension D (the query and output size).
        num_heads (int): number of heads H; ``embed_dim`` must be divisible by it.
        dropout (float, optional): dropout on attention weights in training mode (default: 0).
        bias (bool, optional): bias in the input and output projections (default: True).
        kdim (int, optional): feature size of key nodes (default: ``embed_dim``).
        vdim (int, optional): feature size of value nodes (default: ``embed_dim``).

    Shapes:
        - input: ``x [N, D]`` or ``(x_kv [Nk, kdim], x_q [Nq, D])``, ``edge_index [2, E]``,
          ``edge_bias [E]`` or ``[E, H]`` (optional, may hold ``-inf``)
        - output: ``[Nq, D]``, and ``(edge_index [2, E], alpha [E, H])`` with
          ``return_attention_weights=True``

    Example:
        >>> from tgattn import builders
        >>> layer = GraphAttention(16, 4)
        >>> x = torch.randn(6, 16)
        >>> out, (ei, alpha) = layer(x, builders.causal(6), return_attention_weights=True)
        >>> out.shape, alpha.shape
        (torch.Size([6, 16]), torch.Size([21, 4]))
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        dropout: float = 0.0,
        bias: bool = True,
        kdim: Optional[int] = None,
        vdim: Optional[int] = None,
    ):
        super().__init__(aggr="add", node_dim=0)
        for name, value in (("embed_dim", embed_dim), ("num_heads", num_heads), ("kdim", kdim), ("vdim", vdim)):
            if value is None and name in ("kdim", "vdim"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int (got {value!r})")
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1) (got {dropout})")
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.dropout = dropout
        self.kdim = embed_dim if kdim is None else kdim
        self.vdim = embed_dim if vdim is None else vdim
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.k_proj = nn.Linear(self.kdim, embed_dim, bias=bias)
        self.v_proj = nn.Linear(self.vdim, embed_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.reset_parameters()

    def reset_parameters(self):
        # The initialisation of nn.MultiheadAttention: Xavier-uniform inputs, zero biases.
        super().reset_parameters()
        for lin in (self.q_proj, self.k_proj, self.v_proj):
            nn.init.xavier_uniform_(lin.weight)
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)
        self.out_proj.reset_parameters()
        if self.out_proj.bias is not None:
            nn.init.zeros_(self.out_proj.bias)

    def project(self, x: Union[Tensor, PairTensor]) -> Tuple[Tensor, Tensor, Tensor]:
        """Per-head queries ``[Nq, H, d]``, keys ``[Nk, H, d]`` and values ``[Nk, H, d]``."""
        x_kv, x_q = (x, x) if isinstance(x, Tensor) else x
        h, d = self.num_heads, self.head_dim
        q = self.q_proj(x_q).view(-1, h, d)  # [Nq, H, d]
        k = self.k_proj(x_kv).view(-1, h, d)  # [Nk, H, d]
        v = self.v_proj(x_kv).view(-1, h, d)  # [Nk, H, d]
        return q, k, v

    def forward(
        self,
        x: Union[Tensor, PairTensor],
        edge_index: Union[Tensor, EdgeSet],
        edge_bias: Optional[Tensor] = None,
        return_attention_weights: bool = False,
        *,
        backend: str = "auto",
    ):
        """Attend along ``edge_index``.

        Args:
            x: node features ``[N, D]``, or ``(x_kv, x_q)`` for cross attention.
            edge_index: ``[2, E]``, row 0 = key j, row 1 = query i; or an :class:`~tgattn.EdgeSet`
                (:func:`tgattn.prepare`: checked and analysed once, for every layer and call).
            edge_bias: additive score per edge ``[E]`` or ``[E, H]``.
            return_attention_weights: also return ``(edge_index, alpha [E, H])``.
            backend: ``"message_passing"`` runs PyG's ``propagate`` (the readable
                ``message()`` path); anything else goes to
                :func:`tgattn.functional.graph_attention` with that backend.
        """
        q, k, v = self.project(x)
        p = self.dropout if self.training else 0.0
        if backend == "message_passing":
            out, alpha = self._propagate(q, k, v, edge_index, edge_bias, p)
        else:
            # Ask for weights only when returned: the fast backends then never build them.
            result = functional.graph_attention(
                q, k, v, edge_index, bias=edge_bias, dropout_p=p, return_weights=return_attention_weights,
                backend=backend, edge_scale=explain_edge_scale(self, num_edges(edge_index)) if self._explain else None,
            )
            out, alpha = result if return_attention_weights else (result, None)
        out = self.out_proj(out.reshape(-1, self.embed_dim))  # [Nq, D]
        if return_attention_weights:
            return out, (edge_tensor(edge_index), alpha)
        return out

    def _propagate(self, q, k, v, edge_index, edge_bias, p):
        edge_index = checked_edges(edge_index, q.shape[0], k.shape[0])
        if edge_bias is not None and edge_bias.dim() == 1:
            edge_bias = edge_bias.unsqueeze(-1)
        size = (k.shape[0], q.shape[0])
        alpha = self.edge_updater(edge_index, q=(None, q), k=(k, None), edge_bias=edge_bias, size=size)
        used = F.dropout(alpha, p) if p > 0 else alpha
        out = self.propagate(edge_index, v=(v, None), alpha=used, size=size)  # [Nq, H, d]
        return out, alpha

    def edge_update(self, q_i: Tensor, k_j: Tensor, edge_bias: Optional[Tensor], index: Tensor, size_i: int) -> Tensor:
        score = (q_i * k_j).sum(dim=-1) * self.head_dim**-0.5  # [E, H]
        if edge_bias is not None:
            score = score + edge_bias
        return functional.edge_softmax(score, index, size_i)

    def message(self, v_j: Tensor, alpha: Tensor) -> Tensor:
        return alpha.unsqueeze(-1) * v_j  # [E, H, d]: a_ij v_j, summed at i by aggr="add"

    @classmethod
    def from_multihead(cls, mha: nn.MultiheadAttention) -> "GraphAttention":
        """A layer with the weights of ``mha`` (copied): same outputs for the same mask."""
        if mha.bias_k is not None or mha.add_zero_attn:
            raise ValueError("add_bias_kv and add_zero_attn have no edge-set equivalent; build the MHA without them")
        layer = cls(
            mha.embed_dim,
            mha.num_heads,
            dropout=mha.dropout,
            bias=mha.in_proj_bias is not None,
            kdim=mha.kdim,
            vdim=mha.vdim,
        ).to(device=mha.out_proj.weight.device, dtype=mha.out_proj.weight.dtype)
        D = mha.embed_dim
        if mha._qkv_same_embed_dim:
            w_q, w_k, w_v = mha.in_proj_weight.detach().split(D)
        else:
            w_q, w_k, w_v = (mha.q_proj_weight.detach(), mha.k_proj_weight.detach(), mha.v_proj_weight.detach())
        with torch.no_grad():
            for lin, w in ((layer.q_proj, w_q), (layer.k_proj, w_k), (layer.v_proj, w_v)):
                lin.weight.copy_(w)
            if mha.in_proj_bias is not None:
                for lin, b in zip((layer.q_proj, layer.k_proj, layer.v_proj), mha.in_proj_bias.detach().split(D)):
                    lin.bias.copy_(b)
            layer.out_proj.load_state_dict(mha.out_proj.state_dict())
        return layer

    def to_multihead(self, *, batch_first: bool = False) -> nn.MultiheadAttention:
        """The converse of :meth:`from_multihead`: an ``nn.MultiheadAttention`` with these weights."""
        w = self.out_proj.weight
        mha = nn.MultiheadAttention(
            self.embed_dim,
            self.num_heads,
            dropout=self.dropout,
            bias=self.q_proj.bias is not None,
            kdim=self.kdim,
            vdim=self.vdim,
            batch_first=batch_first,
        ).to(device=w.device, dtype=w.dtype)
        with torch.no_grad():
            weights = [lin.weight for lin in (self.q_proj, self.k_proj, self.v_proj)]
            if mha._qkv_same_embed_dim:
                mha.in_proj_weight.copy_(torch.cat(weights))
            else:
                for name, weight in zip(("q_proj_weight", "k_proj_weight", "v_proj_weight"), weights):
                    getattr(mha, name).copy_(weight)
            if mha.in_proj_bias is not None:
                mha.in_proj_bias.copy_(torch.cat([lin.bias for lin in (self.q_proj, self.k_proj, self.v_proj)]))
            mha.out_proj.load_state_dict(self.out_proj.state_dict())
        return mha

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}({self.embed_dim}, heads={self.num_heads})"
