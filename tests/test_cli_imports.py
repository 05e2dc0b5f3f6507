"""Command lines answer ``--help``, a bad argument or an unknown command before importing torch or PyG.

Each case runs in a fresh interpreter (the test process has imported torch long ago) and reports
the exit status and which heavy packages ``sys.modules`` holds when argparse has answered. A room
that makes its command line lazy adds its rows to ``CASES``: ``(module, argv, exit status)``.
"""
import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, command_modules

HEAVY = ("torch", "torch_geometric")
BAD_FLAG = ["--no-such-flag"]

# module, argv, the exit status argparse gives (0: help, 2: an argument error)
CASES = [
    ("tgattn", ["--help"], 0),
    ("tgattn", ["verify", "--help"], 0),
    ("tgattn", ["build", "--help"], 0),
    ("tgattn", ["no-such-command"], 2),
    ("tgattn", BAD_FLAG, 2),
    ("tgattn", ["verify", "--backend", "no-such-backend"], 2),
    ("tgattn", ["show", "--help"], 0),
    ("tgattn", ["show", *BAD_FLAG], 2),
    ("tgattn", ["fidelity", "--help"], 0),
    ("tgattn", ["fidelity", "--patterns", "window", "--out", "x"], 2),
]
# every benchmark with a command line of its own but the GPU room's, which import torch first (run where it is)
GPU_ROOM = {"tgattn.bench.gpu", "tgattn.bench.gpu_compiled"}
BENCHMARKS = ["tgattn.bench", "tgattn.bench.big_graphs", "tgattn.bench.distributed", "tgattn.bench.engine_scaling",
              "tgattn.bench.gat_example", "tgattn.bench.gnn", "tgattn.bench.graph_transformers", "tgattn.bench.half", "tgattn.bench.hf",
              "tgattn.bench.influence", "tgattn.bench.never_seen", "tgattn.bench.planetoid"]
CASES += [(module, argv, status) for module in BENCHMARKS for argv, status in [(["--help"], 0), (BAD_FLAG, 2)]]


def test_every_benchmark_is_checked():
    """A new benchmark, a module or a package with a ``__main__`` (bench/gpu/), joins the cases."""
    found = {m for m in command_modules() if m.startswith("tgattn.bench.")}
    assert found - GPU_ROOM == set(BENCHMARKS) - {"tgattn.bench"}


# Runs ``python -m module *argv`` as runpy does, then reports the exit status and the heavy packages loaded.
PROBE = """
import json, runpy, sys
module, argv, heavy = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
sys.argv = [module, *argv]
try:
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    status = 0
except SystemExit as exit:
    status = exit.code
print(json.dumps({"status": status, "heavy": [name for name in heavy if name in sys.modules]}))
"""


def answer(module, argv):
    """``(exit status, the heavy packages imported, stdout + stderr)`` of ``python -m module *argv``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", PROBE, module, json.dumps(argv), json.dumps(HEAVY)],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert done.stdout.strip(), done.stderr  # the probe prints its report last, unless the command crashed
    report = json.loads(done.stdout.splitlines()[-1])
    return report["status"], report["heavy"], done.stdout + done.stderr


@pytest.mark.parametrize("module, argv, status", CASES, ids=[f"{m} {' '.join(a)}" for m, a, _ in CASES])
def test_argparse_answers_before_torch_is_imported(module, argv, status):
    got, heavy, output = answer(module, argv)
    assert got == status, output
    assert heavy == [], f"python -m {module} {' '.join(argv)} imported {heavy} before answering"
    if status == 2:
        assert "error:" in output
