"""Which tokens influence a token: attention weights read as graphs.

* :func:`to_networkx`, :func:`to_networkx_layered`: attention of one layer / a stack as a
  weighted ``networkx.DiGraph`` (edge ``j -> i`` = key j to query i, PyG's flow direction).
* :func:`attention_rollout`, :func:`attention_flow`: Abnar & Zuidema's two ways to follow
  attention through layers; :func:`top_influencers` ranks tokens by either, or by direct weight.
* :func:`influence_data`, :func:`save_influence`, :func:`load_influence`, :func:`kept_edges`,
  :func:`kept_rollout`: what the page shows (kept edges, rollout, flow), as a JSON file
  (:mod:`tgattn.analysis.export`); :func:`attention_page`, :func:`page_from_data`: the page.
* :func:`flow_beside_jacobian`: attention flow into a node of a graph beside PyG's Jacobian
  influence (:mod:`tgattn.analysis.graph_influence`).
* :mod:`tgattn.analysis.plots`: pictures (matplotlib, imported only when drawing);
  :mod:`tgattn.analysis.figure`: the four panels of ``python -m tgattn show``
  (:mod:`tgattn.analysis.show`, the command line, which sits above :mod:`tgattn.hf`).

Names are imported on first use, so the command line answers ``--help`` without torch.

Layer "applications" (with models, lm, hf, distributed, analysis, verify): built on the layers
below, never importing a benchmark or a command line (docs/conventions.md, "Layering").
"""
from .._cli import lazy_exports

__all__ = [
    "Influencers",
    "attention_flow",
    "attention_page",
    "attention_rollout",
    "flow_beside_jacobian",
    "influence_data",
    "kept_edges",
    "kept_rollout",
    "layer_matrix",
    "load_influence",
    "page_from_data",
    "save_influence",
    "select_head",
    "to_networkx",
    "to_networkx_layered",
    "top_flow",
    "top_influencers",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "Influencers": "influence",
        "attention_flow": "flow",
        "attention_page": "page",
        "attention_rollout": "rollout",
        "flow_beside_jacobian": "graph_influence",
        "influence_data": "export",
        "kept_edges": "export",
        "kept_rollout": "export",
        "layer_matrix": "weights",
        "load_influence": "export",
        "page_from_data": "page",
        "save_influence": "export",
        "select_head": "weights",
        "to_networkx": "graph",
        "to_networkx_layered": "graph",
        "top_flow": "flow",
        "top_influencers": "influence",
    },
)
