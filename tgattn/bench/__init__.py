"""Benchmarks, run as code: ``python -m tgattn.bench ...``. Never part of the test suite's timing.

The top layer, with the command lines: a benchmark may import every room. Each benchmark is a
command line and imports no other benchmark. A benchmark in one file is a module here
(``big_graphs``, ``distributed``, ``gat_example``, ``gpu_compiled``, ``half``, ``hf``,
``influence``, ``never_seen``, ``planetoid``); a benchmark with parts is a package named by its
command, whose ``__main__`` runs ``command.main`` and whose parts only that benchmark imports:

* :mod:`~tgattn.bench.gpu`: ``python -m tgattn.bench.gpu`` and its ``--suite`` (the cases,
  peers, suite, steps, summary, packed sets, launch options and their sweep);
* :mod:`~tgattn.bench.graph_transformers`: the networks, training runs, scaling and tables;
* :mod:`~tgattn.bench.engine_scaling`: the memory probes and the timed sections;
* :mod:`~tgattn.bench.gnn`: the PyG workloads.

What benchmarks share lives in modules without a command line (:mod:`~tgattn.bench.measure`:
timing and memory probes; :mod:`~tgattn.bench.report`: tables, CSV files, plots;
:mod:`~tgattn.bench.models`: the GNN models and inputs; :mod:`~tgattn.bench.attention`: the
attention sweep; :mod:`~tgattn.bench.patterns`, :mod:`~tgattn.bench.peers`;
:mod:`~tgattn.bench.choices`: the names command lines offer before importing torch). The
package's own ``__main__`` is ``python -m tgattn.bench``, the attention core against its peers.
"""
