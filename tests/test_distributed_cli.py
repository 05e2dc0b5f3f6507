"""The distributed command lines: a missing data set is one line before any process starts,
and a run ends by saying where it wrote its files.

Offline, ``torchrun ... -m tgattn.distributed.gpt`` buried the hint in 193 lines of tracebacks
(one per rank) and ``python -m tgattn.distributed.gnn`` printed a network error with no hint.
"""
import os
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from conftest import REPO, one_line_error
from tgattn.distributed import gnn, gpt

launch_module = sys.modules["tgattn.distributed.launch"]  # the attribute tgattn.distributed.launch is the function

COMMANDS = [
    (gpt, "Tiny Shakespeare", "tinyshakespeare/input.txt"),
    (gnn, "Planetoid Cora", "planetoid/Cora/raw"),
]


@pytest.fixture
def no_launch(monkeypatch):
    """Fails the test if a command starts its processes."""
    def launch(*args, **kwargs):
        raise AssertionError("processes started without the data set")

    monkeypatch.setattr(launch_module, "launch", launch)


@pytest.mark.parametrize("module, name, inside", COMMANDS, ids=["gpt", "gnn"])
def test_offline_without_a_data_folder_is_one_line_and_exit_2(module, name, inside, cli, no_launch, monkeypatch,
                                                              tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))  # nothing cached
    monkeypatch.delenv("TGATTN_DATA", raising=False)

    def offline(url, *args, **kwargs):
        raise urllib.error.URLError(OSError(-2, "Name or service not known"))

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    status, err = cli(module.main, ["--nproc", "2"])
    message = one_line_error(err, f"python -m tgattn.distributed.{module.__name__.rsplit('.', 1)[1]}")
    assert status == 2 and err.count("\n") == 1
    assert message.startswith(f"{name} not found: TGATTN_DATA is not set, {tmp_path}/.cache/tgattn/")
    assert f"set TGATTN_DATA to a folder holding {inside}" in message and "Name or service not known" in message


@pytest.mark.parametrize("module, name, inside", COMMANDS, ids=["gpt", "gnn"])
def test_a_data_folder_without_the_set_is_one_line_and_exit_2(module, name, inside, cli, no_launch, tmp_path):
    status, err = cli(module.main, ["--data", str(tmp_path)])
    message = one_line_error(err, f"python -m tgattn.distributed.{module.__name__.rsplit('.', 1)[1]}")
    assert status == 2 and message.startswith(f"{name} not found: {tmp_path}/{inside}")


def _run(module: str, argv, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", module, "--nproc", "1", "--out", str(tmp_path), *argv], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_gpt_ends_by_naming_its_files(data_root, tmp_path):
    run = _run("tgattn.distributed.gpt", ["--data", str(data_root), "--length", "64", "--steps", "2", "--n-layer", "1",
                                          "--n-head", "2", "--n-embd", "16", "--window", "4"], tmp_path)
    assert run.returncode == 0, run.stderr
    last = run.stdout.splitlines()[-1]
    assert last == f"wrote {tmp_path / 'gpt_cp_1.csv'} and {tmp_path / 'gpt_cp_1.json'}"
    assert (tmp_path / "gpt_cp_1.csv").is_file() and (tmp_path / "gpt_cp_1.json").is_file()


@pytest.mark.slow
def test_gnn_ends_by_naming_its_file(data_root, tmp_path):
    run = _run("tgattn.distributed.gnn", ["--data", str(data_root), "--epochs", "2"], tmp_path)
    assert run.returncode == 0, run.stderr
    *_, summary, last = run.stdout.splitlines()
    assert summary.startswith("Cora on 1 rank: test accuracy ") and last == f"wrote {tmp_path / 'gnn_cora_1.json'}"
    assert (tmp_path / "gnn_cora_1.json").is_file()


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "argument --steps: must be an integer >= 1 (got '0')"),
    (["--length", "0"], "argument --length: must be an integer >= 1 (got '0')"),
    (["--nproc", "0"], "argument --nproc: must be an integer in [1, 1024] (got '0')"),
    (["--nproc", "-1"], "argument --nproc: must be an integer in [1, 1024] (got '-1')"),
    (["--timeout", "0"], "argument --timeout: must be a number > 0 (got '0')"),
    (["--pattern", "ring"], "argument --pattern: invalid choice: 'ring'"),
    (["--n-embd", "30", "--n-head", "4"], "--n-embd must be divisible by --n-head (got --n-embd=30, --n-head=4)"),
])
def test_gpt_refuses_bad_arguments_in_one_line_before_any_rank(argv, message, cli, no_launch, data_root):
    # Before: --steps 0 ended in a traceback, --length 0 in a traceback inside a rank, --nproc 0 / -1
    # exited 0 having done nothing.
    status, err = cli(gpt.main, ["--data", str(data_root), *argv])
    assert status == 2 and one_line_error(err, "python -m tgattn.distributed.gpt").startswith(message)


@pytest.mark.parametrize("argv, message", [
    (["--epochs", "0"], "argument --epochs: must be an integer >= 1 (got '0')"),
    (["--nproc", "-1"], "argument --nproc: must be an integer in [1, 1024] (got '-1')"),
    (["--partition", "ring"], "--partition must be one of auto, metis, louvain, bandwidth, contiguous (got 'ring')"),
])
def test_gnn_refuses_bad_arguments_in_one_line_before_any_rank(argv, message, cli, no_launch, data_root):
    status, err = cli(gnn.main, ["--data", str(data_root), *argv])
    assert status == 2 and one_line_error(err, "python -m tgattn.distributed.gnn").startswith(message)
