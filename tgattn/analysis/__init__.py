"""Which tokens influence a token: attention weights read as graphs.

* :func:`to_networkx`, :func:`to_networkx_layered`: attention of one layer / a stack as a
  weighted ``networkx.DiGraph`` (edge ``j -> i`` = key j to query i, PyG's flow direction).
* :func:`attention_rollout`, :func:`attention_flow`: Abnar & Zuidema's two ways to follow
  attention through layers; :func:`top_influencers` ranks tokens by either, or by direct weight.
* :mod:`tgattn.analysis.plots`: pictures (matplotlib, imported only when drawing);
  :mod:`tgattn.analysis.figure`: the four panels of ``python -m tgattn show``
  (:mod:`tgattn.analysis.show`, the command line, which sits above :mod:`tgattn.hf`).

Layer "applications" (with models, lm, hf, distributed, analysis, verify): built on the layers
below, never importing a benchmark or a command line (docs/conventions.md, "Layering").
"""
from .flow import attention_flow, top_flow
from .graph import to_networkx, to_networkx_layered
from .influence import Influencers, top_influencers
from .rollout import attention_rollout
from .weights import layer_matrix, select_head

__all__ = [
    "Influencers",
    "attention_flow",
    "attention_rollout",
    "layer_matrix",
    "select_head",
    "to_networkx",
    "to_networkx_layered",
    "top_flow",
    "top_influencers",
]
