"""Benchmarks, run as code: ``python -m tgattn.bench ...``. Never part of the test suite's timing."""
