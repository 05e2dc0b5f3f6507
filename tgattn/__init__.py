"""tgattn: transformer self-attention as a PyTorch Geometric message-passing layer.

Attention patterns (full, causal, window, ...) are edge sets built by :mod:`tgattn.builders`;
:class:`GraphAttention` and :func:`tgattn.functional.graph_attention` attend along them and
equal dense masked attention (:func:`tgattn.reference.dense_attention`).
"""
from . import builders, functional, reference
from . import data, probsparse  # sequences as PyG graphs; Informer's ProbSparse attention
from .conv import GraphAttentionConv
from .layer import GraphAttention
from . import nn  # graph-transformer layers (GPS, Exphormer) and structural biases
from .nn import ExphormerConv, GPSConv

__version__ = "0.1.0"
__all__ = ["GraphAttention", "GraphAttentionConv", "builders", "data", "functional", "probsparse", "reference"]
__all__ += ["ExphormerConv", "GPSConv", "nn"]
__all__ += ["__version__"]
