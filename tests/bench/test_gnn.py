"""The PyG-workload benchmark runs end to end and computes its ratios from its own rows."""
from __future__ import annotations

import csv

from tgattn.bench.gnn import command as gnn
from tgattn.bench.gnn import workloads as gnn_workloads


def test_ratios_are_taken_within_one_workload_mode_and_thread_count():
    rows = [
        dict(workload="cora", mode="train", threads=1, model="gat", ms=10.0),
        dict(workload="cora", mode="train", threads=1, model="transformer", ms=20.0),
        dict(workload="cora", mode="train", threads=1, model="tgattn", ms=15.0),
        dict(workload="cora", mode="train", threads=2, model="gat", ms=5.0),
        dict(workload="cora", mode="train", threads=2, model="tgattn", ms=6.0),
    ]
    gnn._ratios(rows)
    assert rows[2]["vs_gat"] == 1.5 and rows[2]["vs_transformer"] == 0.75
    assert rows[4]["vs_gat"] == 1.2 and rows[4]["vs_transformer"] is None
    assert "| cora | train | 1 | tgattn | 15.00 | 1.50x | 0.75x |" in gnn.summary(rows)


def test_cli_writes_csv_table_and_plot(tmp_path, capsys):
    argv = ["--workloads", "molecules", "--models", "gat", "tgattn", "--threads", "1", "--rounds", "1",
            "--out", str(tmp_path), "--no-progress"]
    assert gnn.main(argv) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last == f"wrote {tmp_path / 'gnn.csv'}, {tmp_path / 'gnn.md'}, {tmp_path / 'gnn.png'}"
    with open(tmp_path / "gnn.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["workload"], r["model"]) for r in rows] == [
        ("molecules", "gat"), ("molecules", "tgattn"), ("molecules", "tgattn_engine"), ("overhead", "tgattn")
    ]
    assert float(rows[0]["vs_gat"]) == 1.0 and float(rows[1]["ms"]) > 0
    assert float(rows[2]["ms"]) > 0
    assert (tmp_path / "gnn.png").stat().st_size > 0 and "molecules" in (tmp_path / "gnn.md").read_text()


def test_molecules_with_edge_features_compare_one_function():
    """molecules_edges: tgattn's EdgeNet is TransformerConv's (same seed, same weights, same output)."""
    import torch

    nets = {}
    for model in ("transformer", "tgattn"):
        torch.manual_seed(0)
        nets[model] = gnn_workloads.edge_net(model, features=8, channels=4, heads=2).double()
    x, edge_index = torch.randn(6, 8, dtype=torch.float64), torch.tensor([[0, 1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 0]])
    e = torch.randn(6, gnn_workloads.EDGE_FEATURES, dtype=torch.float64)
    torch.testing.assert_close(nets["tgattn"](x, edge_index, e), nets["transformer"](x, edge_index, e),
                               rtol=1e-10, atol=1e-10)
    rows = gnn_workloads.molecules_edges(["gat", "transformer", "tgattn", "tgattn_shared"], 1, _NoProgress())
    assert [r["model"] for r in rows] == ["gat", "transformer", "tgattn"] and all(r["ms"] > 0 for r in rows)


class _NoProgress:
    def update(self, n):
        pass
