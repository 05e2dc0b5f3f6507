"""Graph transformers side by side, ``python -m tgattn.bench.graph_transformers``, by parts.

:mod:`~tgattn.bench.graph_transformers.command`: the command line;
:mod:`~tgattn.bench.graph_transformers.models`: the networks;
:mod:`~tgattn.bench.graph_transformers.training`: the training runs;
:mod:`~tgattn.bench.graph_transformers.scaling`: the scaling in the number of nodes;
:mod:`~tgattn.bench.graph_transformers.tables`: the tables and the plot.
"""
