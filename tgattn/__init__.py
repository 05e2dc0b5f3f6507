"""tgattn: transformer self-attention as a PyTorch Geometric message-passing layer.

Attention patterns (full, causal, window, ...) are edge sets built by :mod:`tgattn.builders`;
:class:`GraphAttention` and :func:`tgattn.functional.graph_attention` attend along them and
equal dense masked attention (:func:`tgattn.reference.dense_attention`).

The package is layered, each role in one room importing only from the rooms below it:
engine < functional < builders < nn (with data, datasets) < models / lm / hf / distributed /
analysis / verify < bench and the command lines (docs/conventions.md, "Layering").

Names are imported on first use (:func:`tgattn._cli.lazy_exports`): ``import tgattn`` loads neither torch
nor PyG, so the command lines answer ``--help`` and bad arguments at once.
"""
from ._cli import lazy_exports

__version__ = "0.1.0"
__all__ = ["GraphAttention", "GraphAttentionConv", "builders", "data", "functional"]
__all__ += ["ExphormerConv", "GPSConv", "nn"]
__all__ += ["EdgeSet", "prepare"]
__all__ += ["__version__"]

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "GraphAttention": "nn.attention",
        "GraphAttentionConv": "nn.conv",
        "builders": "builders",
        "data": "data",  # sequences as PyG graphs
        "functional": "functional",
        "nn": "nn",  # graph-transformer layers (GPS, Exphormer) and structural biases
        "GPSConv": "nn",
        "ExphormerConv": "nn",
        "EdgeSet": "edgeset",  # an edge set validated and analysed once (plan once, run many)
        "prepare": "edgeset",
    },
)
