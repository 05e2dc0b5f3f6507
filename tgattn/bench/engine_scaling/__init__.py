"""The engine's backward, scaling in n, threads and memory, ``python -m tgattn.bench.engine_scaling``:
the command line and the memory probes (:mod:`~tgattn.bench.engine_scaling.command`) and the timed
sections (:mod:`~tgattn.bench.engine_scaling.sections`).
"""
