"""Benchmarks that read a data set: a missing one is one line and exit status 2, before any work.

Offline, with ``TGATTN_DATA`` at an empty folder or unset, each of these ended in a traceback,
``python -m tgattn.bench.gnn`` after timing its molecule workloads and
``python -m tgattn.bench.gpu`` after its whole attention sweep.
"""
import urllib.error
import urllib.request

import pytest
import torch

import tgattn.distributed
import tgattn.distributed.partition
from conftest import one_line_error
from tgattn.bench import __main__ as bench_main
from tgattn.bench import attention, distributed, models, planetoid
from tgattn.bench.gnn import command as gnn, workloads as gnn_workloads
from tgattn.bench.gpu import command as gpu
from tgattn.bench.graph_transformers import command as graph_transformers, scaling as gt_scaling, training as gt_training


def _fail(*args, **kwargs):
    raise AssertionError("work started without the data set")


def _any_device(device):
    """``check_device`` that accepts "cuda" without a GPU, so that the CUDA path reads its data set here."""
    return torch.device(device)


# command: (module, argv, the module's work functions)
COMMANDS = {
    "bench": (bench_main, ["--device", "cuda", "--no-progress"], []),  # its work: attention.sweep, gpu.gnn_steps
    "distributed": (distributed, [], []),  # its work: tgattn.distributed's spawn and partition_graph
    "gnn": (gnn, ["--no-progress"], []),  # its work: gnn.workloads' workloads
    "gpu": (gpu, ["--no-progress"], ["gnn_steps"]),
    # its work: graph_transformers.training.run_task, .scaling.measure_scaling
    "graph_transformers": (graph_transformers, ["--datasets", "Cora", "CiteSeer", "--no-progress"], []),
    "planetoid": (planetoid, ["--dataset", "Cora", "CiteSeer", "--no-progress"], ["run_one"]),  # and models.train
}


@pytest.fixture
def no_work(monkeypatch):
    """Every work function of every command fails the test when called."""
    for module, _, work in COMMANDS.values():
        for name in work:
            monkeypatch.setattr(module, name, _fail)
    # the benchmarks that import their work when they run: patched where it is defined
    monkeypatch.setattr(attention, "sweep", _fail)
    monkeypatch.setattr(gpu, "gnn_steps", _fail)
    for name in ("molecules", "molecules_edges", "graph_workload", "new_edge_set_overhead"):
        monkeypatch.setattr(gnn_workloads, name, _fail)
    monkeypatch.setattr(gt_training, "run_task", _fail)
    monkeypatch.setattr(gt_scaling, "measure_scaling", _fail)
    monkeypatch.setattr(models, "train", _fail)
    monkeypatch.setattr(tgattn.distributed, "spawn", _fail)
    monkeypatch.setattr(tgattn.distributed.partition, "partition_graph", _fail)
    monkeypatch.setattr(gpu, "check_device", _any_device)


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """No network, nothing cached (``HOME`` is a fresh folder)."""
    def urlopen(url, *args, **kwargs):
        raise urllib.error.URLError(OSError(-3, "Temporary failure in name resolution"))

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))


def _prog(name: str) -> str:
    return "python -m tgattn.bench" + ("" if name == "bench" else f".{name}")


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_an_empty_data_folder_is_one_line_naming_the_set_and_exit_2(name, cli, no_work, offline, monkeypatch, tmp_path):
    empty = tmp_path / "data"
    empty.mkdir()
    monkeypatch.setenv("TGATTN_DATA", str(empty))
    module, argv, _ = COMMANDS[name]
    status, err = cli(module.main, [*argv, "--out", str(tmp_path / "out")])
    message = one_line_error(err, _prog(name))
    assert status == 2 and err.count("\n") == 1, err
    assert message.startswith(f"Planetoid Cora not found: {empty}/planetoid/Cora/raw/ind.cora.x does not exist"), message
    assert "TGATTN_DATA" in message


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_offline_without_a_data_folder_is_one_line_naming_the_set_and_exit_2(name, cli, no_work, offline, monkeypatch,
                                                                           tmp_path):
    monkeypatch.delenv("TGATTN_DATA", raising=False)
    module, argv, _ = COMMANDS[name]
    status, err = cli(module.main, [*argv, "--out", str(tmp_path / "out")])
    message = one_line_error(err, _prog(name))
    assert status == 2 and err.count("\n") == 1, err
    assert message.startswith(f"Planetoid Cora not found: TGATTN_DATA is not set, {tmp_path}/home/.cache/tgattn/"), message
    assert "Temporary failure in name resolution" in message and "set TGATTN_DATA to a folder holding planetoid/Cora/raw" in message
