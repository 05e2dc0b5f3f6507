"""The applications' command lines answer ``--help``, bad arguments and unknown commands before
torch or PyG are imported (issue 47: each such answer used to wait 72-151 s on a loaded machine
for those imports).

Each case runs the command line's ``main`` in a fresh interpreter and reads ``sys.modules`` after
argparse has answered.
"""
import json
import subprocess
import sys

import pytest

from conftest import REPO

HEAVY = ("torch", "torch_geometric", "transformers")
PROBE = """
import json, sys
from importlib import import_module
try:
    import_module(sys.argv[1]).main(sys.argv[2:])
except SystemExit as exit:
    status = exit.code
else:
    status = None
print(json.dumps({"status": status, "loaded": [m for m in %r if m in sys.modules]}))
""" % (HEAVY,)

CASES = [
    ("tgattn.lm.__main__", ["--help"], 0),
    ("tgattn.lm.__main__", ["trian"], 2),  # unknown command
    ("tgattn.lm.__main__", ["train", "--help"], 0),
    ("tgattn.lm.__main__", ["train", "--n-embd", "0"], 2),  # a setting checked when the config is built
    ("tgattn.lm.__main__", ["train", "--n-layers", "2"], 2),  # unknown flag
    ("tgattn.lm.__main__", ["sample", "--temperature", "0"], 2),
    ("tgattn.lm.__main__", ["bench-train", "--steps", "0"], 2),
    ("tgattn.distributed.gpt", ["--help"], 0),
    ("tgattn.distributed.gpt", ["--steps", "0"], 2),
    ("tgattn.distributed.gpt", ["--n-embd", "30", "--n-head", "4"], 2),
    ("tgattn.distributed.gpt", ["--bogus"], 2),
    ("tgattn.distributed.gnn", ["--help"], 0),
    ("tgattn.distributed.gnn", ["--epochs", "-1"], 2),
]


@pytest.mark.parametrize("module, argv, status", CASES, ids=[" ".join([m.split(".")[-1], *a]) for m, a, _ in CASES])
def test_answers_before_torch_is_imported(module, argv, status):
    run = subprocess.run([sys.executable, "-c", PROBE, module, *argv], cwd=REPO, capture_output=True, text=True,
                         timeout=120, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    result = json.loads(run.stdout.splitlines()[-1])
    assert result == {"status": status, "loaded": []}, run.stderr
