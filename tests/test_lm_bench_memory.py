"""``python -m tgattn.lm memory-probe``: what it counts as a model's training memory."""
import json
import subprocess
import sys

import pytest

from conftest import REPO


def _probes(*configs):
    """Each configuration in its own fresh process (started together: most of their time is imports)."""
    runs = [subprocess.Popen([sys.executable, "-m", "tgattn.lm", "memory-probe", "--threads", "1", *args],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO) for args in configs]
    outs = [run.communicate(timeout=600) for run in runs]
    assert all(run.returncode == 0 for run in runs), [err for _, err in outs]
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]


@pytest.mark.slow
def test_memory_probe_counts_state_and_step():
    dense, graph = _probes(("--attention", "dense", "--pattern", "causal", "--block-size", "16", "--batch-size", "2"),
                           ("--attention", "graph", "--pattern", "window", "--window", "4", "--block-size", "16", "--batch-size", "2"))
    params = 4 * (65 * 128 + 16 * 128 + 4 * (4 * 128 * 128 + 2 * 4 * 128 * 128 + 2 * 128) + 128)  # bytes
    for row in (dense, graph):
        assert row["tensor_mb"] == pytest.approx(row["state_mb"] + row["step_mb"])
        # weights and Adam's two moments, plus at most the edge set, mask and their analysis
        assert 3 * params <= row["state_mb"] * 2**20 <= 3 * params + 64 * 1024
        assert row["step_mb"] * 2**20 > params  # the gradients alone
        assert row["rss_mb"] > 0
    assert graph["edges"] == 2 * sum(min(i, 4) + 1 for i in range(16))  # causal window, radius 4
    assert graph["state_mb"] > dense["state_mb"] - 16 * 16 * 2 / 2**20  # the edge set and its analysis
