"""Every layer of tgattn, PyG's way (``torch_geometric.nn``): the attention layers and the
graph-transformer layers built on them.

* :class:`GraphAttention` (:mod:`tgattn.nn.attention`): multi-head attention over an edge set;
* :class:`GraphAttentionConv` (:mod:`tgattn.nn.conv`): ``TransformerConv``'s interface, with its
  PyG glue (adjacency forms, explainer masks: :mod:`tgattn.nn.explain`); :class:`TransformerConv`,
  the same layer under PyG's name, repr and attributes (:mod:`tgattn.nn.transformer_conv`);
* :class:`GPSConv`, :class:`ExphormerConv`, :class:`VirtualNodes` and the structural attention
  biases (:class:`CentralityEncoding`, :class:`SpatialEncoding`).

Layer "nn" of the package: it imports the builders, :mod:`tgattn.functional` and the prepared-set
API (:mod:`tgattn.edgeset`), never the engine beneath them, nor the models, applications or
benchmarks above it (docs/conventions.md, "Layering"). Every layer takes a prepared
:class:`~tgattn.EdgeSet` wherever it takes an ``edge_index``.
"""
from .attention import GraphAttention
from .conv import GraphAttentionConv
from .exphormer import EDGE_KINDS, ExphormerConv, VirtualNodes, exphormer_edge_kinds
from .gps import GPSConv, check_gps, full_per_graph
from .structural import CentralityEncoding, SpatialEncoding, shortest_path_distance
from .transformer_conv import TransformerConv

__all__ = [
    "EDGE_KINDS",
    "CentralityEncoding",
    "ExphormerConv",
    "GPSConv",
    "GraphAttention",
    "GraphAttentionConv",
    "SpatialEncoding",
    "TransformerConv",
    "VirtualNodes",
    "check_gps",
    "exphormer_edge_kinds",
    "full_per_graph",
    "shortest_path_distance",
]
