"""The graph-transformer benchmark's networks and tables, on tiny synthetic inputs (no datamol needed)."""
import pytest
import torch
from torch_geometric.data import Batch, Data
from torch_geometric.utils.smiles import e_map, x_map

from tgattn.bench.graph_transformers import command as bench
from tgattn.bench.graph_transformers import scaling as gt_scaling, tables as gt_tables, training as gt_training
from tgattn.bench.graph_transformers.models import MoleculeNet, NodeNet, add_expander
from tgattn.bench.graph_transformers.scaling import measure_point, measure_scaling, ring_with_chords
from tgattn.bench.report import write_csv


def molecules(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    graphs = []
    for n in lengths:
        src = torch.arange(n - 1)
        ei = torch.cat([torch.stack([src, src + 1]), torch.stack([src + 1, src])], 1)
        x = torch.stack([torch.randint(0, len(v), (n,), generator=g) for v in x_map.values()], 1)
        e = torch.stack([torch.randint(0, len(v), (ei.shape[1],), generator=g) for v in e_map.values()], 1)
        graphs.append(Data(x=x, edge_index=ei, edge_attr=e, y=torch.randn(1, 1, generator=g)))
    add_expander(graphs)
    return Batch.from_data_list(graphs)


def test_gps_on_tgattn_equals_gps_mha_of_the_same_seed():
    batch = molecules([5, 1, 9, 3])
    out = {}
    for model in ("gps_mha", "gps_tgattn"):
        torch.manual_seed(3)
        net = MoleculeNet(model).train()
        out[model] = net(batch)
        out[model].sum().backward()
        out[model + "_grad"] = net.head[0].weight.grad
    torch.testing.assert_close(out["gps_tgattn"], out["gps_mha"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["gps_tgattn_grad"], out["gps_mha_grad"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model", ["gine", "exphormer"])
def test_other_molecule_models_predict_one_value_per_graph(model):
    batch = molecules([4, 7, 2])
    torch.manual_seed(0)
    out = MoleculeNet(model)(batch)
    assert out.shape == (3,) and bool(torch.isfinite(out).all())


def test_random_walk_encoding_enters_the_atom_embedding():
    from torch_geometric.transforms import AddRandomWalkPE

    batch = Batch.from_data_list([AddRandomWalkPE(4)(g) for g in molecules([4, 7]).to_data_list()])
    torch.manual_seed(0)
    net = MoleculeNet("gps_tgattn", rwse=4, norm="none").eval()
    out = net(batch)
    batch.random_walk_pe = batch.random_walk_pe + 1.0
    assert out.shape == (2,) and not torch.allclose(net(batch), out)


def test_molecule_training_stops_early():
    graphs = molecules([3, 6, 2, 5, 4, 3]).to_data_list()
    settings = dict(bench.FULL, mol_epochs=50, mol_patience=2)
    row = gt_training.run_molecules((graphs[:4], graphs[4:5], graphs[5:]), "D", "gine", 0, settings)
    assert 3 <= row["epochs"] < 50 and row["value"] > 0


@pytest.mark.parametrize("model", ["gps_mha", "gps_tgattn", "exphormer"])
@pytest.mark.parametrize("norm", ["batch_norm", "none"])
def test_node_models_on_a_small_graph(model, norm):
    ei = ring_with_chords(30)
    torch.manual_seed(0)
    net = NodeNet(model, 6, 3, ei, 30, layers=2, norm=norm).eval()
    out = net(torch.randn(30, 6), ei)
    assert out.shape == (30, 3)
    if model == "gps_tgattn":
        torch.manual_seed(0)
        ref = NodeNet("gps_mha", 6, 3, ei, 30, layers=2, norm=norm).eval()
        torch.manual_seed(1)
        x = torch.randn(30, 6)
        torch.testing.assert_close(net(x, ei), ref(x, ei), rtol=1e-5, atol=1e-5)


def test_scaling_point_reports_time_and_memory():
    row = measure_point("exphormer", 64, repeats=1)
    assert row["ms"] > 0 and row["peak_mb"] >= 0 and row["steps"] == 1


@pytest.mark.slow  # a child process or a build: tens of seconds
def test_scaling_point_runs_out_of_memory_under_its_cap():
    # all pairs of 6000 nodes: 36M edges, >= 576 MB of indices alone; the cap is 200 MB
    (row,) = measure_scaling([6000], limit_mb=200, models=("gps_tgattn",))
    assert row["ms"] is None and row["note"].startswith("out of memory under a 200 MB address-space cap")


def test_summary_and_markdown():
    runs = [dict(dataset="D", model=m, seed=s, metric="rmse", value=v, val=v, epochs=1, ms_per_epoch=t,
                 min_ms_per_epoch=t, peak_mb=1.0, max_abs_diff_vs_mha="" if m == "gps_mha" else 1e-7)
            for m, t in (("gps_mha", 30.0), ("gps_tgattn", 20.0)) for s, v in ((0, 1.0), (1, 3.0))]
    rows = gt_tables.summarize(runs)
    assert [r["speedup_vs_mha"] for r in rows] == [1.0, 1.5]
    assert rows[1]["mean"] == 2.0 and rows[1]["std"] == pytest.approx(2 ** 0.5)
    text = gt_tables.markdown(rows, [{"model": "exphormer", "n": 10, "ms": 1.0, "peak_mb": 2.0, "note": ""}], "cmd")
    assert "| D | gps_tgattn | rmse | 2.000 ± 1.414 | 2 | 20.0 | 20.0 | 1.50x | 1.0 | 1.0e-07 |" in text
    assert "Command: `cmd`" in text


def test_arguments():
    args = bench.parse_args(["--quick", "--datasets", "Cora"])
    assert args.settings["seeds"] == 1 and args.datasets == ["Cora"]
    args = bench.parse_args(["--set", "node_layers=2", "node_norm=none", "mol_lr=0.01"])
    assert (args.settings["node_layers"], args.settings["node_norm"], args.settings["mol_lr"]) == (2, "none", 0.01)
    for bad in (["--datasets", "ZINC"], ["--set", "node_width=2"], ["--set", "seeds=3"], ["--set", "node_layers"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_epoch_timing_rows(monkeypatch):
    graphs = molecules([3, 6, 2, 5]).to_data_list()
    monkeypatch.setattr(gt_training, "molecule_splits", lambda name, rwse=0: (graphs, [], []))
    rows = gt_training.epoch_timing("FreeSolv", 1, models=("gps_mha", "exphormer"))
    assert [r["model"] for r in rows] == ["gps_mha", "exphormer"]
    assert rows[0]["speedup_vs_mha"] == 1.0 and rows[1]["min_ms"] > 0 and rows[0]["nodes_min_mean_max"] == "2/4.0/6"


def test_scaling_only_reuses_the_runs_of_out(tmp_path, monkeypatch, capsys):
    runs = [dict(dataset="FreeSolv", model=m, seed=0, metric="rmse", value=1.0, val=1.0, epochs=1, ms_per_epoch=2.0,
                 min_ms_per_epoch=2.0, peak_mb=1.0, max_abs_diff_vs_mha="") for m in ("gps_mha", "gps_tgattn")]
    write_csv(runs, tmp_path / "runs.csv", list(runs[0]))
    rows = [{"model": "exphormer", "n": 100, "ms": 1.0, "peak_mb": 2.0, "note": ""}]
    monkeypatch.setattr(gt_scaling, "measure_scaling", lambda *a, **k: rows)
    assert bench.main(["--scaling-only", "--out", str(tmp_path), "--no-progress"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "wrote " + ", ".join(
        str(tmp_path / name) for name in ("scaling.csv", "results.csv", "results.md", "graph_transformers.png"))
    text = (tmp_path / "results.md").read_text()
    assert "| FreeSolv | gps_tgattn | rmse | 1.000 ± 0.000 | 1 |" in text and "| exphormer | 100 | 1.0 | 2.0 |  |" in text
    assert (tmp_path / "graph_transformers.png").stat().st_size > 0


def test_tables_only_rebuilds_from_the_csv_files(tmp_path, capsys):
    runs = [dict(dataset="Cora", model=m, seed=0, metric="accuracy", value=0.5, val=0.5, epochs=1, ms_per_epoch=2.0,
                 min_ms_per_epoch=2.0, peak_mb=1.0, max_abs_diff_vs_mha="") for m in ("gps_mha", "exphormer")]
    write_csv(runs, tmp_path / "runs.csv", list(runs[0]))
    scaling = [{"model": "gps_tgattn", "n": 10, "ms": 1.0, "peak_mb": 2.0, "predicted_ms": None, "predicted_mb": None,
                "note": ""},
               {"model": "gps_tgattn", "n": 100, "ms": None, "peak_mb": None, "predicted_ms": 100.0,
                "predicted_mb": 200.0, "note": "out of memory under a 1 MB address-space cap (RLIMIT_AS)"}]
    write_csv(scaling, tmp_path / "scaling.csv", list(scaling[0]))
    assert gt_tables.read_scaling(tmp_path / "scaling.csv") == scaling
    assert bench.main(["--tables-only", "--out", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "wrote " + ", ".join(
        str(tmp_path / name) for name in ("results.csv", "results.md", "graph_transformers.png"))
    text = (tmp_path / "results.md").read_text()
    assert "| Cora | exphormer | accuracy (%) | 50.000 ± 0.000 | 1 |" in text and "| gps_tgattn | 100 | - | - | out of" in text


def test_a_last_batch_of_one_node_is_skipped():
    graphs = molecules([1] * 129).to_data_list()  # batches of 128 and 1 graph; batch norm fails on one node
    settings = dict(bench.FULL, mol_epochs=1)
    row = gt_training.run_molecules((graphs, graphs[:2], graphs[:2]), "D", "gine", 0, settings)
    assert row["epochs"] == 1
