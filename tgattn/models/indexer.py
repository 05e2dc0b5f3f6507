"""Attention that selects its keys per forward: DeepSeek-V3.2's lightning indexer and MoBA's block top-k.

A layer with ``attention="indexer_topk"`` owns a small :class:`Indexer`; each forward it scores
every causal key with it, keeps the ``k_top`` best per query (:func:`tgattn.builders.indexer_topk`)
and attends along those edges. ``attention="block_topk"`` needs no extra parameters: it gates
blocks of keys with the layer's own queries and keys (:func:`tgattn.builders.block_topk`).
Neither selection is differentiated (which keys win is a step function).

The indexer learns as in DeepSeek-V3.2: its target is the layer's attention distribution,
summed over heads and L1-normalised, detached; its loss is the KL divergence from that target
to the softmax of its scores over the same keys (:func:`indexer_kl`). During the warm-up the
layer attends densely (every causal key) and only the indexer trains; afterwards the layer
attends to the indexer's selection and the KL runs over the selected keys. The indexer reads
the layer's input detached, so its loss never reaches the main model and the language-model
loss never reaches the indexer.

DeepSeek-AI, "DeepSeek-V3.2" technical report, 2025 (DeepSeek Sparse Attention);
Lu et al., "MoBA: Mixture of Block Attention for Long-Context LLMs", 2025.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor, nn

from .. import builders, functional
from ..nn.attention import GraphAttention
from .config import GPTConfig


class Indexer(nn.Module):
    """The lightning indexer: ``I_ij = sum_h w_ih relu(<q_ih, k_j>)``, one key per token.

    ``q_index = W_q x`` ``[N, HI, dI]``, ``k_index = W_k x`` ``[N, dI]`` (shared by the indexer
    heads) and ``weights = W_w x / sqrt(HI dI)`` ``[N, HI]`` (the scale of DeepSeek's reference
    code, which keeps the scores of a fresh indexer near 0).

    Args:
        embed_dim (int): model dimension D.
        heads (int): indexer heads HI.
        dim (int): indexer head dimension dI.
        bias (bool, optional): bias in the projections (default: False).

    Example:
        >>> q_index, k_index, weights = Indexer(16, heads=2, dim=4)(torch.randn(5, 16))
        >>> q_index.shape, k_index.shape, weights.shape
        (torch.Size([5, 2, 4]), torch.Size([5, 4]), torch.Size([5, 2]))
    """

    def __init__(self, embed_dim: int, heads: int, dim: int, *, bias: bool = False):
        super().__init__()
        self.heads, self.dim = heads, dim
        self.q_proj = nn.Linear(embed_dim, heads * dim, bias=bias)
        self.k_proj = nn.Linear(embed_dim, dim, bias=bias)
        self.w_proj = nn.Linear(embed_dim, heads, bias=bias)

    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """``x [N, D]`` -> ``q_index [N, HI, dI]``, ``k_index [N, dI]``, ``weights [N, HI]``."""
        q = self.q_proj(x).view(-1, self.heads, self.dim)  # [N, HI, dI]
        return q, self.k_proj(x), self.w_proj(x) * (self.heads * self.dim) ** -0.5

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.q_proj.in_features}, heads={self.heads}, dim={self.dim})"


def index_scores(q_index: Tensor, k_index: Tensor, weights: Tensor, edge_index: Tensor) -> Tensor:
    """The indexer score ``I_ij = sum_h weights[i, h] relu(<q_index[i, h], k_index[j]>)`` of each edge: ``[E]``."""
    src, dst = edge_index
    return (weights[dst] * torch.einsum("ehd,ed->eh", q_index[dst], k_index[src]).relu()).sum(1)  # [E]


def indexer_kl(target: Tensor, logits: Tensor, dst: Tensor, n: int) -> Tensor:
    """Mean over the ``n`` queries of ``KL(target_i || softmax(logits_i))``, each over query i's edges.

    ``target [E]`` sums to 1 over each query's edges (``dst [E]`` names the query of an edge);
    ``logits [E]`` are the indexer's scores of the same edges. A query without edges adds 0.

    Example:
        >>> dst, target = torch.tensor([0, 1, 1]), torch.tensor([1.0, 0.25, 0.75])
        >>> kl = indexer_kl(target, torch.tensor([5.0, 1.0, 3.0]).log(), dst, 2)  # softmax: 1 | 1/4, 3/4
        >>> abs(float(kl)) < 1e-6, round(float(indexer_kl(target, torch.zeros(3), dst, 2)), 4)  # then 1 | 1/2, 1/2
        (True, 0.0654)
    """
    top = logits.detach().new_full((n,), float("-inf")).scatter_reduce(0, dst, logits.detach(), "amax")  # [n]
    total = logits.new_zeros(n).index_add(0, dst, (logits - top[dst]).exp())  # [n]
    log_p = logits - (total.log() + top)[dst]  # [E]: log softmax over each query's edges
    return (torch.xlogy(target, target) - target * log_p).sum() / n


class SelectedAttention(GraphAttention):
    """Graph attention over the keys that ``config.attention`` selects per forward.

    ``"indexer_topk"``: the ``config.k_top`` keys with the largest indexer score per query
    (shared by the heads). ``"block_topk"``: per head, the query's own block of
    ``config.block`` keys and its ``config.k_top - 1`` best earlier blocks. The parameters
    are :class:`GraphAttention`'s under the same names, plus ``indexer.*`` for the indexer.
    """

    def __init__(self, config: GPTConfig):
        super().__init__(config.n_embd, config.n_head, dropout=config.dropout, bias=config.bias)
        self.k_top, self.block = config.k_top, config.block
        self.indexer: Optional[Indexer] = None
        if config.attention == "indexer_topk":
            self.indexer = Indexer(config.n_embd, config.indexer_heads, config.indexer_dim, bias=config.bias)

    def select(self, x: Tensor, lengths: List[int], *, dense: bool = False, return_attention_weights: bool = False):
        """Attend ``x [N, D]`` (a packed batch of ``lengths``) along the selected keys.

        Args:
            dense: attend to every causal key instead (the indexer's warm-up).

        Returns:
            ``(out [N, D], (edge_index [2, E], alpha [E, H]) or None, kl)``: ``kl`` is the
            indexer's loss (:func:`indexer_kl`), ``None`` without an indexer.
        """
        q, k, v = self.project(x)  # [N, H, d] each
        index = self.indexer(x.detach()) if self.indexer is not None else None  # detached: a separate graph
        bias = None
        if dense:
            edge_index = builders.causal(lengths, device=x.device)
        elif index is not None:
            edge_index = builders.indexer_topk(*index, self.k_top, lengths=lengths)
        else:
            edge_index, bias = builders.block_topk(q, k, self.block, self.k_top, lengths=lengths)  # bias [E, H]: 0 / -inf
        weighted = return_attention_weights or index is not None
        p = self.dropout if self.training else 0.0
        out = functional.graph_attention(q, k, v, edge_index, bias=bias, dropout_p=p, return_weights=weighted)
        out, alpha = out if weighted else (out, None)
        kl = None
        if index is not None:
            target = alpha.detach().sum(1) / alpha.shape[1]  # [E]: heads summed, L1-normalised per query
            kl = indexer_kl(target, index_scores(*index, edge_index), edge_index[1], x.shape[0])
        out = self.out_proj(out.reshape(-1, self.embed_dim))  # [N, D]
        return out, ((edge_index, alpha) if return_attention_weights else None), kl
