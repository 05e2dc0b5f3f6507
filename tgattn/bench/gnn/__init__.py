"""PyG workloads side by side, ``python -m tgattn.bench.gnn``: the command line
(:mod:`~tgattn.bench.gnn.command`) and the workloads it times (:mod:`~tgattn.bench.gnn.workloads`).
"""
