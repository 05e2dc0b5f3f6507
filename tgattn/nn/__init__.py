"""Graph-transformer layers on tgattn: GPS, Exphormer, and structural attention biases."""
from .exphormer import EDGE_KINDS, ExphormerConv, VirtualNodes, exphormer_edge_kinds
from .gps import GPSConv, check_gps, full_per_graph
from .structural import CentralityEncoding, SpatialEncoding, shortest_path_distance

__all__ = [
    "EDGE_KINDS",
    "CentralityEncoding",
    "ExphormerConv",
    "GPSConv",
    "SpatialEncoding",
    "VirtualNodes",
    "check_gps",
    "exphormer_edge_kinds",
    "full_per_graph",
    "shortest_path_distance",
]
