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

COMMANDS = [
    (gpt, "Tiny Shakespeare", "tinyshakespeare/input.txt"),
    (gnn, "Planetoid Cora", "planetoid/Cora/raw"),
]


@pytest.fixture
def no_launch(monkeypatch):
    """Fails the test if a command starts its processes."""
    def launch(*args, **kwargs):
        raise AssertionError("processes started without the data set")

    monkeypatch.setattr(gpt, "launch", launch)
    monkeypatch.setattr(gnn, "launch", launch)


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
