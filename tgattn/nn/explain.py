"""PyG's explainer edge mask on tgattn's fast path.

:class:`torch_geometric.explain.Explainer` (``GNNExplainer``, ...) sets ``_explain`` and an
``_edge_mask`` on every ``MessagePassing`` module and expects each message ``m_ij`` to be
multiplied by ``sigmoid(mask_ij)`` inside ``propagate``. tgattn's layers skip ``propagate``
on their fast path, so they hand the same factor to the engine as ``edge_scale``.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch_geometric.nn import MessagePassing


def explain_edge_scale(module: MessagePassing, num_edges: int, num_loops: int = 0) -> Optional[Tensor]:
    """The factor PyG's ``explain_message`` would put on each of ``num_edges`` messages.

    ``None`` unless an explainer is active. As in PyG, when the module added ``num_loops``
    self-loops (after removing the given ones), the mask keeps the entries of the edges that
    were not self-loops and the added loops get factor 1 (not trained).

    Example:
        >>> from tgattn import GraphAttention
        >>> layer = GraphAttention(4, 1)
        >>> explain_edge_scale(layer, 3) is None
        True
        >>> layer.explain, layer._edge_mask = True, torch.zeros(3)
        >>> explain_edge_scale(layer, 3)
        tensor([0.5000, 0.5000, 0.5000])
    """
    if not module._explain:
        return None
    mask = module._edge_mask
    if mask is None:
        raise ValueError("Could not find a pre-defined 'edge_mask' to explain. Did you forget to initialize it?")
    if module._apply_sigmoid:
        mask = mask.sigmoid()
    if mask.shape[0] != num_edges:
        mask = torch.cat([mask[module._loop_mask], mask.new_ones(num_loops)])
    if mask.shape[0] != num_edges:
        raise ValueError(f"the explainer's edge mask has {mask.shape[0]} entries for {num_edges} edges")
    return mask
