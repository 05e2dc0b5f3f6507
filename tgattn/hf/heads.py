"""Heads as graphs: the edges each attention head of a model actually uses, read from one forward.

One forward of the model on a text records every head's attention (:func:`tgattn.hf.attention_graph`);
:func:`select_heads` keeps, per query and head, either its ``topk`` heaviest keys or the fewest
keys holding a share ``mass`` of its softmax. The result, :class:`HeadGraphs`, is an edge set per
layer and head, and runs the model again on those edges in two ways:

* ``use_pattern(model, graphs.pattern)``: one edge set for every layer and head, the union of
  what the heads keep (what :func:`tgattn.hf.use_pattern` takes: one pattern for all heads);
* ``with heads_only(model, graphs): model(...)``: each layer's each head on its own edges (a
  score bias of ``-inf`` on the union's edges that head dropped, per layer).

So "keep what the model attends to" is one call: ``use_pattern(model, attended(model, ids, mass=0.9).pattern)``.
The edges belong to that text: the pattern refuses another length.

Rows = queries i, columns = keys j; ``edge_index[0]`` = key, ``edge_index[1]`` = query.
"""
from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..builders.scored import best_per_target
from .analysis import attention_graph
from .attention import Layer, attention_forward
from .interface import use_pattern
from .masks import EdgeMask

HEADS = "tgattn_heads"  # the attn_implementation of heads_only
_ACTIVE: ContextVar[Optional[List[Tensor]]] = ContextVar("tgattn_hf_heads", default=None)  # per layer: bias [E, H]


class HeadGraphs(NamedTuple):
    """What each head of each layer keeps (:func:`select_heads`).

    Attributes:
        length: tokens of the sequence the attention was read from.
        edges: per layer, ``edge_index [2, E_l]``: the edges some head of the layer keeps.
        keep: per layer, ``[E_l, H]``: which heads keep each of them.
        mass: ``[L, H]``: the share of each head's attention its kept edges hold, mean over queries.
    """

    length: int
    edges: List[Tensor]
    keep: List[Tensor]
    mass: Tensor

    def union(self) -> Tensor:
        """The edges any head of any layer keeps, ``[2, E]`` sorted by (query, key)."""
        key = torch.cat([ei[1] * self.length + ei[0] for ei in self.edges]).unique()  # sorted
        return torch.stack([key % self.length, key // self.length])

    def pattern(self, lengths: Sequence[int]) -> Tensor:
        """:meth:`union` as a builder for :func:`tgattn.hf.use_pattern` (for the text it was read from only)."""
        if list(lengths) != [self.length]:
            raise ValueError(f"these head graphs were read from one sequence of {self.length} tokens; "
                             f"they cannot be the pattern of documents of lengths {list(lengths)}")
        return self.union()

    def edge_share(self, full_edges: int) -> float:
        """Edges kept per head, as a share of ``full_edges`` (mean over layers and heads)."""
        return float(torch.stack([k.sum(0) for k in self.keep]).double().mean()) / full_edges


def _mass_keep(alpha: Tensor, dst: Tensor, n: int, mass: float) -> Tensor:
    """``keep [E, H]``: per query and head, its heaviest keys until they hold ``mass`` of the row (at least one)."""
    if mass >= 1:
        return torch.ones_like(alpha, dtype=torch.bool)
    keep = torch.empty_like(alpha, dtype=torch.bool)
    first = torch.zeros(n + 1, dtype=torch.long)
    first[1:] = torch.bincount(dst, minlength=n).cumsum(0)  # where each query's edges start, in (query, weight) order
    for h in range(alpha.shape[1]):
        by_weight = torch.sort(alpha[:, h], descending=True, stable=True).indices
        order = by_weight[torch.sort(dst[by_weight], stable=True).indices]  # edges by (query, weight desc)
        running = alpha[order, h].double().cumsum(0)
        start = first[dst[order]]
        row_start = torch.where(start > 0, running[start - 1], 0.0)  # the mass of the rows before
        before = running - alpha[order, h].double() - row_start  # the mass ahead of each edge in its row
        keep[order, h] = before < mass
    return keep


def select_heads(attention: Sequence[Layer], length: int, *, topk: Optional[int] = None,
                 mass: Optional[float] = None) -> HeadGraphs:
    """Each head's kept edges from its recorded attention: its ``topk`` heaviest keys per query, or the
    fewest keys holding ``mass`` of each query's weight.

    Args:
        attention: per layer ``(edge_index [2, E], alpha [E, H])`` over one sequence, edges sorted
            by (query, key) (what :func:`tgattn.hf.attention_graph` returns).
        length: the sequence's tokens.
        topk: keys kept per query and head, ``>= 1`` (ties to the smaller key).
        mass: share of each query's attention to keep, in ``(0, 1]`` (1 keeps every edge).

    Example:
        >>> ei = torch.tensor([[0, 0, 1], [0, 1, 1]])  # causal, 2 tokens
        >>> alpha = torch.tensor([[1.0], [0.3], [0.7]])  # one head
        >>> graphs = select_heads([(ei, alpha)], 2, mass=0.6)
        >>> graphs.edges[0].tolist(), graphs.mass  # query 0 keeps its key (1.0), query 1 key 1 (0.7 >= 0.6)
        ([[0, 1], [0, 1]], tensor([[0.8500]], dtype=torch.float64))
    """
    if (topk is None) == (mass is None):
        raise ValueError(f"give topk or mass, one of them (got topk={topk!r}, mass={mass!r})")
    if topk is not None and (isinstance(topk, bool) or not isinstance(topk, int) or topk < 1):
        raise ValueError(f"topk must be an integer >= 1 (got {topk!r})")
    if mass is not None and not 0 < mass <= 1:
        raise ValueError(f"mass must be in (0, 1] (got {mass!r})")
    edges, keeps, masses = [], [], []
    for edge_index, alpha in attention:
        dst = edge_index[1]
        keep = best_per_target(alpha, dst, length, topk) if topk is not None else _mass_keep(alpha, dst, length, mass)
        held = torch.zeros(length, alpha.shape[1], dtype=torch.float64).index_add_(
            0, dst, (alpha.double() * keep))  # [T, H]: weight kept per query and head
        used = keep.any(1)
        edges.append(edge_index[:, used])
        keeps.append(keep[used])
        masses.append(held.mean(0))
    return HeadGraphs(length, edges, keeps, torch.stack(masses))


def attended(model, input_ids, *, topk: Optional[int] = None, mass: Optional[float] = None) -> HeadGraphs:
    """:func:`select_heads` on one forward of a transformers ``model`` (:func:`tgattn.hf.attention_graph`).

    Example:
        >>> from transformers import BertConfig, BertModel
        >>> model = BertModel(BertConfig(vocab_size=16, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
        ...                              intermediate_size=16)).eval()
        >>> graphs = attended(model, [1, 5, 3, 2], topk=2)
        >>> [int(k.sum()) for k in graphs.keep]  # 2 keys x 4 queries x 2 heads per layer
        [16, 16]
        >>> _ = use_pattern(model, graphs.pattern)  # the union of what the heads keep, for this text
    """
    ids = torch.as_tensor(input_ids).view(-1)
    return select_heads(attention_graph(model, ids), ids.shape[0], topk=topk, mass=mass)


def _head_bias(graphs: HeadGraphs, union: Tensor) -> List[Tensor]:
    """Per layer, ``[E_union, H]``: 0 where the head keeps the union's edge, ``-inf`` where it does not."""
    n = graphs.length
    union_key = union[1] * n + union[0]
    biases = []
    for ei, keep in zip(graphs.edges, graphs.keep):
        kept = torch.zeros(union.shape[1], keep.shape[1], dtype=torch.bool)
        kept[torch.searchsorted(union_key, ei[1] * n + ei[0])] = keep
        biases.append(torch.zeros(kept.shape).masked_fill_(~kept, float("-inf")))
    return biases


def _heads_forward(module, query, key, value, attention_mask, *args, **kwargs):
    """:func:`tgattn.hf.attention_forward` with the head bias of ``module``'s layer on the union's edges."""
    biases = _ACTIVE.get()
    layer = getattr(module, "layer_idx", None)
    if biases is None or layer is None or not isinstance(attention_mask, EdgeMask) or attention_mask.bias is not None \
            or attention_mask.edge_index.shape[1] != biases[layer].shape[0]:
        raise ValueError("heads_only: the model must run inside `with heads_only(model, graphs)`, on the text the "
                         "graphs were read from, with layers that know their index (layer_idx) and no score bias")
    mask = dataclasses.replace(attention_mask, bias=biases[layer].to(query.device))
    return attention_forward(module, query, key, value, mask, *args, **kwargs)


@contextmanager
def heads_only(model, graphs: HeadGraphs) -> Iterator[None]:
    """Inside, ``model`` runs each head of each layer on its own kept edges of ``graphs`` (one sequence of
    ``graphs.length`` tokens, unpadded). Afterwards the model is back on its previous attention.

    Example:
        >>> from transformers import BertConfig, BertModel
        >>> model = BertModel(BertConfig(vocab_size=16, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
        ...                              intermediate_size=16)).eval()
        >>> graphs = attended(model, [1, 5, 3, 2], topk=1)
        >>> with heads_only(model, graphs):
        ...     model(torch.tensor([[1, 5, 3, 2]])).last_hidden_state.shape
        torch.Size([1, 4, 8])
    """
    from transformers import AttentionInterface

    previous = model.config._attn_implementation
    union = graphs.union()
    use_pattern(model, graphs.pattern, name=HEADS)  # registers HEADS with tgattn's function and mask builder
    AttentionInterface.register(HEADS, _heads_forward)  # then the function, per head
    token = _ACTIVE.set(_head_bias(graphs, union))
    try:
        yield
    finally:
        _ACTIVE.reset(token)
        use_pattern(model)
        model.set_attn_implementation(previous)
