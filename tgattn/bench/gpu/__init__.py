"""The GPU benchmark, ``python -m tgattn.bench.gpu`` (its ``--suite``: the GPU suite), by parts.

:mod:`~tgattn.bench.gpu.command`: the command line, the sweep's GNN steps and targets;
:mod:`~tgattn.bench.gpu.cases`: the suite's cases; :mod:`~tgattn.bench.gpu.peers`: the peers
each case runs; :mod:`~tgattn.bench.gpu.suite`: the attention measurements within the budget;
:mod:`~tgattn.bench.gpu.steps`: the training steps (issue 49's case);
:mod:`~tgattn.bench.gpu.summary`: the suite's tables and targets;
:mod:`~tgattn.bench.gpu.packed`: packed sequences and the varlen peer;
:mod:`~tgattn.bench.gpu.launch`: the tile kernels' launch options in the suite;
:mod:`~tgattn.bench.gpu.tune`: their launch-option sweep (``--tune``).
"""
