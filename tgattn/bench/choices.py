"""The names the benchmarks' command lines offer as choices, in a module that imports no torch.

``--help`` and a bad argument of :mod:`tgattn.bench.gnn`, :mod:`~tgattn.bench.planetoid` and
:mod:`~tgattn.bench.graph_transformers` are answered before torch is imported; the modules that
build what these names stand for import it.

Example (the models named here are those :mod:`tgattn.bench.models` builds):
    >>> from tgattn.bench import models
    >>> CONVS == tuple(models.MODELS) and MODEL_NAMES == models.MODEL_NAMES
    True
"""
CONVS = ("gat", "transformer", "tgattn", "tgattn_shared")  # the convs of bench.models.MODELS
MODEL_NAMES = (*CONVS, "tgattn_global", "tgattn_union")  # and the graph transformers of bench.models.GlobalNet
MOLECULE_SETS = ("FreeSolv", "Solubility")  # the data sets of bench.graph_transformers
NODE_SETS = ("Cora", "CiteSeer")
