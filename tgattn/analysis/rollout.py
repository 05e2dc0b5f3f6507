"""Attention rollout: how much each input token reaches each output token through the layers."""
from __future__ import annotations

import warnings
from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from .weights import Head, Layer, as_layers, count_nodes, layer_matrix


def attention_rollout(
    attention: Union[Layer, Sequence[Layer]],
    *,
    queries: Union[None, int, Sequence[int], Tensor] = None,
    head: Head = "mean",
    residual: bool = True,
    num_nodes: Optional[int] = None,
) -> Tensor:
    r"""Attention rollout of a stack of layers, with sparse products on the edge sets.

    Abnar & Zuidema (ACL 2020) model the skip connection of each layer by mixing its
    attention with the identity and multiply the layers:

    .. math::
        \tilde A_l = \operatorname{rownorm}(0.5\,A_l + 0.5\,I), \qquad
        R = \tilde A_L \cdots \tilde A_2 \tilde A_1

    ``R[i, j]`` is the share of input token j in token i after the last layer; each row
    sums to 1. Heads are averaged (``head="mean"``, as in the paper) unless ``head`` picks one.
    Nothing dense is formed: ``R`` is a sparse ``float64`` tensor whose nonzeros are the
    pairs joined by a path through the layers (for ``window(n, w)`` and L layers, the band
    ``|i - j| <= L w``). With ``queries``, only those rows are computed, from the left
    (``e_i^T \tilde A_L \cdots \tilde A_1``), which is cheaper still.

    Args:
        attention: ``(edge_index, alpha)`` per layer, first layer first; ``alpha [E, H]`` or ``[E]``.
        queries: output tokens whose rows to compute (default: all); row r of the result
            belongs to ``queries[r]``.
        head: ``"mean"`` (default) or the index of one head.
        residual: mix in the identity as above (default); ``False`` multiplies the raw
            attention matrices.
        num_nodes: number of tokens (default: largest node id + 1).

    Returns:
        Sparse COO ``float64`` tensor ``[N, N]``, or ``[len(queries), N]``.

    Example (3 tokens; row 2 of the result is worked out by hand in ``tests/test_analysis_rollout.py``):
        >>> from tgattn import builders
        >>> ei = builders.causal(3)  # edges (j, i): (0,0) (0,1) (1,1) (0,2) (1,2) (2,2)
        >>> a1 = torch.tensor([1.0, 0.5, 0.5, 0.5, 0.25, 0.25])
        >>> a2 = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.5, 0.5])
        >>> attention_rollout([(ei, a1), (ei, a2)], queries=2).to_dense()
        tensor([[0.2500, 0.2812, 0.4688]], dtype=torch.float64)

    References:
        Samira Abnar and Willem Zuidema, "Quantifying Attention Flow in Transformers",
        ACL 2020, https://arxiv.org/abs/2005.00928
    """
    layers = as_layers(attention)
    n = count_nodes(layers, num_nodes)
    matrices = [layer_matrix(ei, alpha, n, head=head, residual=residual) for ei, alpha in layers]
    if queries is None:
        result = matrices[0]
        for matrix in matrices[1:]:
            result = _mm(matrix, result)  # [N, N]
        return result.coalesce()
    rows = torch.as_tensor(queries, dtype=torch.long).reshape(-1)  # [Q]
    if rows.numel() and (int(rows.min()) < -n or int(rows.max()) >= n):
        raise ValueError(f"queries must lie in [0, {n}) (got {rows.tolist()})")
    rows = rows % max(n, 1)
    select = torch.sparse_coo_tensor(
        torch.stack([torch.arange(rows.numel()), rows]),
        torch.ones(rows.numel(), dtype=torch.float64),
        (rows.numel(), n),
        check_invariants=False,
    )
    result = select
    for matrix in reversed(matrices):
        result = _mm(result, matrix)  # [Q, N]
    return result.coalesce()


def _mm(a: Tensor, b: Tensor) -> Tensor:
    """Sparse @ sparse, without torch's note that it goes through (beta) CSR inside."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
        return torch.sparse.mm(a, b)
