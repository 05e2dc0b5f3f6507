"""Benchmarks, run as code: ``python -m tgattn.bench ...``. Never part of the test suite's timing.

The top layer, with the command lines: a benchmark may import every room. Each benchmark is a
module with a command line and imports no other benchmark; what they share lives in modules
without one (:mod:`~tgattn.bench.measure`: timing and memory probes; :mod:`~tgattn.bench.report`:
tables, CSV files, plots; :mod:`~tgattn.bench.models`: the GNN models and inputs;
:mod:`~tgattn.bench.patterns`, :mod:`~tgattn.bench.peers`; :mod:`~tgattn.bench.choices`: the
names command lines offer before importing torch), and a long benchmark's parts sit beside its
command line (``engine_sections``, ``gnn_workloads``, ``gt_training``, ``gt_tables``,
``gt_models``, ``gt_scaling``, ``gpu_packed``).
"""
