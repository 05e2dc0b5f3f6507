"""Rank the tokens that influence one token: by direct attention, rollout or flow."""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Sequence, Union

import torch
from torch import Tensor

from ..builders._common import check_count
from .flow import top_flow
from .rollout import attention_rollout
from .weights import Head, Layer, as_layers, count_nodes, layer_matrix

METHODS = ("direct", "rollout", "flow")


class Influencers(NamedTuple):
    """Top influencers of a token: ``index [k]`` (token ids, strongest first) and ``score [k]``."""

    index: Tensor
    score: Tensor


def top_influencers(
    i: int,
    k: int,
    attention: Union[Layer, Sequence[Layer]],
    *,
    method: str = "direct",
    head: Head = "mean",
    residual: bool = True,
    num_nodes: Optional[int] = None,
    flow_func: Optional[Callable] = None,
) -> Influencers:
    """The ``k`` tokens with the largest influence on token ``i``.

    * ``"direct"`` (default): the attention weights of query i in one layer (``attention`` is
      one ``(edge_index, alpha)`` pair or a list of one);
    * ``"rollout"``: row i of :func:`attention_rollout` over all layers;
    * ``"flow"``: :func:`attention_flow` into token i after the last layer, computed by
      :func:`tgattn.analysis.flow.top_flow` (max-flows only for inputs that can still
      reach the top k).

    ``head`` and, for rollout and flow, ``residual`` are passed on. Tokens with score 0 are
    left out (so fewer than k may come back); ties go to the smaller token id.

    Example:
        >>> from tgattn import builders
        >>> ei = builders.causal(3)  # edges (j, i): (0,0) (0,1) (1,1) (0,2) (1,2) (2,2)
        >>> a1 = torch.tensor([1.0, 0.5, 0.5, 0.5, 0.25, 0.25])
        >>> top_influencers(2, 2, (ei, a1))
        Influencers(index=tensor([0, 1]), score=tensor([0.5000, 0.2500], dtype=torch.float64))
        >>> a2 = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.5, 0.5])
        >>> top_influencers(2, 1, [(ei, a1), (ei, a2)], method="flow").index
        tensor([2])
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS} (got {method!r})")
    k = check_count("k", k)
    layers = as_layers(attention)
    n = count_nodes(layers, num_nodes)
    if isinstance(i, bool) or not isinstance(i, int) or not -n <= i < n:
        raise ValueError(f"i must be a token index in [0, {n}) (got {i!r})")
    i %= n
    if method == "direct":
        if len(layers) != 1:
            raise ValueError(f"method='direct' reads one layer (got {len(layers)}); pass attention[l]")
        row = layer_matrix(*layers[0], n, head=head, residual=False)
        scores = torch.zeros(n, dtype=torch.float64)
        mine = row.indices()[0] == i
        scores[row.indices()[1][mine]] = row.values()[mine]
    elif method == "rollout":
        scores = attention_rollout(layers, queries=i, head=head, residual=residual, num_nodes=n).to_dense()[0]
    else:  # solves only the inputs whose cut bound can still reach the top k
        return Influencers(*top_flow(layers, i, k, head=head, residual=residual, num_nodes=n, flow_func=flow_func))
    order = torch.sort(-scores, stable=True).indices[:k]
    order = order[scores[order] > 0]
    return Influencers(order, scores[order])
