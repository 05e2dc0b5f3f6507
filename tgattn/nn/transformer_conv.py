"""``TransformerConv``: :class:`~tgattn.nn.GraphAttentionConv` under PyG's name, for code written against PyG."""
from __future__ import annotations

from .conv import GraphAttentionConv


class TransformerConv(GraphAttentionConv):
    r"""PyG's ``TransformerConv`` (Shi et al., "Masked Label Prediction", IJCAI 2021) on tgattn's engine.

    The same layer as :class:`~tgattn.nn.GraphAttentionConv` (its arguments, parameters and results,
    which are ``TransformerConv``'s), under PyG's name and with what PyG's class shows besides: the
    repr ``TransformerConv(8, 32, heads=2)`` and the attribute ``_alpha``, which PyG sets during a
    call and empties after it (None between calls; the weights come back as the call's result with
    ``return_attention_weights=True``, never stashed). A module written for PyG changes one import::

        from tgattn.nn import TransformerConv  # was: from torch_geometric.nn import TransformerConv

    PyG's own test file of the class passes so (``tests/nn/test_transformer_conv.py``).

    Example:
        >>> import torch
        >>> conv = TransformerConv(8, 32, heads=2, beta=True)
        >>> conv, conv._alpha
        (TransformerConv(8, 32, heads=2), None)
        >>> conv(torch.randn(4, 8), torch.tensor([[0, 1, 2, 3], [0, 0, 1, 1]])).shape
        torch.Size([4, 64])
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._alpha = None  # PyG's: the weights between its edge_updater and message steps
