"""``python -m tgattn.bench.big_graphs`` at a tiny size: the graph, the sampler, the capped children.

The command line runs end to end (full-batch points in capped children, mini-batches with the
own sampler) and writes its CSVs, plot and summary; a child over its cap reports the failed
allocation instead of dying; the graph is seeded, coalesced, power-law and homophilous; the
sampler keeps the fan-out and draws only edges of the graph.
"""
import csv

import pytest
import torch

from tgattn.bench import big_graphs
from tgattn.bench.measure import failed_allocation


def _rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.mark.slow  # a child process or a build: tens of seconds
def test_cli_tiny_run_writes_every_output(tmp_path, capsys):
    code = big_graphs.main(["--nodes", "300", "--cap-gb", "4", "--steps", "2", "--minibatch-nodes", "800",
                            "--batches", "2", "--batch-size", "32", "--fanout", "4", "3", "--sampler", "own",
                            "--out", str(tmp_path)])
    assert code == 0
    full = _rows(tmp_path / "full.csv")
    assert [(int(r["nodes"]), r["conv"]) for r in full] == [(300, c) for c in big_graphs.CONVS]
    for r in full:
        assert r["status"] == "ok" and int(r["steps"]) == 2 and float(r["cap_gb"]) == 4
        assert float(r["peak_mb"]) >= float(r["inputs_mb"]) > 0 and float(r["ms"]) > 0
        assert float(r["step_mb"]) == pytest.approx(float(r["peak_mb"]) - float(r["inputs_mb"]), abs=0.2)
    mini = _rows(tmp_path / "minibatch.csv")
    assert [r["conv"] for r in mini] == list(big_graphs.CONVS)
    assert {r["sampler"] for r in mini} == {"own"} and float(mini[1]["vs_gat"]) == 1.0
    assert all(float(r["steps_per_s"]) > 0 and int(r["batches"]) == 2 for r in mini)
    assert (tmp_path / "full.png").stat().st_size > 0
    assert "Largest size whose inputs fit: N = 300" in (tmp_path / "full.md").read_text()
    assert "steps per second tgattn / GATConv" in (tmp_path / "minibatch.md").read_text()
    assert "wrote" in capsys.readouterr().out


@pytest.mark.slow  # a child process or a build: tens of seconds
def test_a_child_over_its_cap_reports_the_failed_allocation(tmp_path):
    # 1.2 GB holds python, torch, PyG and the graph (4 million edges), not GATConv's [E, H, C] messages
    row = big_graphs.run_capped("full_point", dict(conv="gat", nodes=160_000, steps=1), cap_gb=1.2)
    assert row["status"] == "out of memory" and row["phase"] == "step" and row["steps"] == 0
    assert row["tried_mb"] > 0 and row["inputs_mb"] < row["peak_mb"] < 1.3 * 1024


@pytest.mark.slow  # a child process or a build: tens of seconds
def test_run_capped_raises_when_the_child_ends_without_a_report():
    with pytest.raises(ChildProcessError, match="exit status 1.*unknown conv"):
        big_graphs.run_capped("full_point", dict(conv="nope", nodes=100, steps=1), cap_gb=4)


def test_failed_allocation_reads_torch_and_python_errors():
    assert failed_allocation(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 123 bytes")) == 123
    assert failed_allocation(RuntimeError("std::bad_alloc")) == 0
    assert failed_allocation(ValueError("x")) is None and failed_allocation(RuntimeError("index out of range")) is None


def test_power_law_graph_is_seeded_coalesced_power_law_and_homophilous():
    x, edge_index, y = big_graphs.power_law_graph(20_000, seed=3)
    again = big_graphs.power_law_graph(20_000, seed=3)
    assert torch.equal(edge_index, again[1]) and torch.equal(x, again[0]) and torch.equal(y, again[2])
    assert not torch.equal(edge_index, big_graphs.power_law_graph(20_000, seed=4)[1][:, : edge_index.shape[1]])
    n = 20_000
    key = edge_index[0] * n + edge_index[1]
    assert bool((key[1:] > key[:-1]).all())  # sorted by (source, target), no repeats
    assert bool((edge_index[0] != edge_index[1]).all())
    assert 0.85 * big_graphs.expected_edges(n) < edge_index.shape[1] <= big_graphs.expected_edges(n)
    degree = torch.bincount(edge_index[1], minlength=n).double()
    assert float(degree.max()) > 20 * float(degree.mean())  # a heavy tail: hubs
    assert float(degree.median()) < float(degree.mean())
    same = float((y[edge_index[0]] == y[edge_index[1]]).double().mean())
    assert 0.6 < same < 0.8  # 70 % drawn inside the class, 30 % anywhere (1/47 of those inside too)
    # the features carry the class: each class's mean is nearer its own centroid than the others'
    means = torch.stack([x[y == c].mean(0) for c in range(big_graphs.CLASSES)])
    assert bool((torch.cdist(means, means).fill_diagonal_(1e9).min(1).values > 0.3).all())
    with pytest.raises(ValueError, match="nodes must be an int >= 47.*10"):
        big_graphs.power_law_graph(10)


def test_fanout_batch_keeps_the_fanout_and_draws_edges_of_the_graph():
    n = 3000
    _, edge_index, _ = big_graphs.power_law_graph(n, seed=1)
    perm = torch.argsort(edge_index[1], stable=True)
    colptr = torch.zeros(n + 1, dtype=torch.long)
    colptr[1:] = torch.cumsum(torch.bincount(edge_index[1], minlength=n), 0)
    row = edge_index[0][perm]
    seeds = torch.arange(7, n, 150)
    k = len(seeds)
    ids, local = big_graphs.fanout_batch(colptr, row, seeds, [16, 2], torch.Generator().manual_seed(0))
    assert torch.equal(ids[:k], seeds) and len(torch.unique(ids)) == len(ids)
    edges = set(zip(edge_index[0].tolist(), edge_index[1].tolist()))
    pairs = list(zip(ids[local[0]].tolist(), ids[local[1]].tolist()))
    assert set(pairs) <= edges and len(set(pairs)) == len(pairs)
    into = torch.bincount(local[1], minlength=len(ids))
    degree = torch.bincount(edge_index[1], minlength=n)
    small = degree[seeds] <= 16
    assert bool((into[:k][small] == degree[seeds][small]).all())  # few neighbours: all of them
    assert bool((into[:k] <= 16).all()) and bool((into[:k][~small] >= 8).all()) and bool((into[k:] <= 2).all())
    assert bool((~small).any()) and bool(small.any())


def _point(nodes, conv, status, step_mb=None, ms=None):
    row = dict(nodes=nodes, edges=25 * nodes, conv=conv, status=status, phase="step" if status != "not run" else "")
    if status == "ok":
        row.update(inputs_mb=100, peak_mb=100 + step_mb, step_mb=step_mb, ms=ms, loss_first=3.8, loss_last=3.1)
    return row


def test_full_summary_judges_the_targets():
    rows = [_point(1000, "tgattn", "ok", 200, 10), _point(1000, "gat", "ok", 500, 30), _point(1000, "transformer", "ok", 800, 40),
            _point(2000, "tgattn", "ok", 400, 20), _point(2000, "gat", "ok", 1000, 60),
            _point(2000, "transformer", "out of memory"), _point(4000, "tgattn", "ok", 800, 40),
            _point(4000, "gat", "out of memory"), _point(4000, "transformer", "not run")]
    text = big_graphs.full_summary(rows)
    assert "Largest size whose inputs fit: N = 4,000: tgattn ok, GATConv out of memory, TransformerConv not run: met" in text
    assert "GATConv out of memory from N = 4,000, TransformerConv from N = 2,000" in text
    assert "N = 1,000: step memory tgattn / GATConv = 0.40x (<= 0.5) met" in text
    assert "tgattn / TransformerConv = 0.25x (<= 0.5) met" in text and "Step time tgattn / GATConv at N = 1,000: 0.33x" in text
    rows[6] = _point(4000, "tgattn", "out of memory")
    assert "TransformerConv not run: NOT met" in big_graphs.full_summary(rows)
    # without a peer there is nothing to judge
    assert "Largest" not in big_graphs.full_summary([r for r in rows if r["conv"] != "transformer"])


@pytest.mark.parametrize("argv, message", [
    (["--nodes", "10"], "at least 47, one node per class (got 10)"),
    (["--cap-gb", "0"], "--cap-gb: must be a number > 0"),
    (["--convs", "gcn"], "invalid choice: 'gcn'"),
])
def test_cli_refuses_settings_it_cannot_run(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_:
        big_graphs.main([*argv, "--out", str(tmp_path)])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_cli_refuses_neighbor_loader_without_a_sampling_library(monkeypatch, capsys, tmp_path):
    import torch_geometric.typing as pyg_typing

    monkeypatch.setattr(pyg_typing, "WITH_PYG_LIB", False)
    monkeypatch.setattr(pyg_typing, "WITH_TORCH_SPARSE", False)
    with pytest.raises(SystemExit):
        big_graphs.main(["--parts", "minibatch", "--sampler", "pyg", "--out", str(tmp_path)])
    assert "needs torch-sparse or pyg-lib" in capsys.readouterr().err
