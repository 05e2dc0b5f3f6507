import csv

import pytest
import torch

from conftest import DATA, one_line_error
from tgattn.bench import models
from tgattn.bench import planetoid as bench
from tgattn.datasets import load_planetoid


@pytest.fixture(autouse=True)
def one_thread():
    """Small sparse/graph ops: one thread is faster, and far faster on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def cora():
    if not DATA.is_dir():
        pytest.skip(f"shared data folder not found at {DATA} (set TGATTN_DATA)")
    return models.prepare(load_planetoid("Cora", DATA))


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tgattn", "gat"])
def test_few_epochs_on_cora_beat_chance(cora, model):
    torch.manual_seed(0)
    net = models.build_model(model, cora, "Cora")
    result = models.train(net, cora, epochs=30, patience=100)
    # 7 classes: chance is ~14 %, the majority class ~32 % of the test nodes
    assert result["test_acc"] > 0.7
    assert result["epochs"] == 30 and 1 <= result["best_epoch"] <= 30


def test_prepare_row_normalizes_into_csr(cora):
    assert cora.x.layout == torch.sparse_csr
    sums = cora.x.to_dense().sum(1)
    nonempty = sums > 0
    torch.testing.assert_close(sums[nonempty], torch.ones(int(nonempty.sum())))


def test_sparse_dropout_keeps_pattern_and_scales():
    x = torch.eye(4).to_sparse_csr()
    torch.manual_seed(0)
    out = models._dropout(x, 0.5, True).to_dense()
    assert set(out.unique().tolist()) <= {0.0, 2.0}
    assert torch.equal(models._dropout(x, 0.5, False).to_dense(), torch.eye(4))


def test_early_stopping_stops_after_patience(cora):
    torch.manual_seed(0)
    net = models.build_model("gat", cora, "Cora")
    seen = []
    with torch.no_grad():  # a model that never learns: validation never improves after epoch 1
        for p in net.parameters():
            p.zero_()
            p.requires_grad_(False)
    net.conv1.lin.weight.requires_grad_(True)  # Adam needs one parameter; its gradient stays 0
    result = models.train(net, cora, epochs=50, patience=3, on_epoch=seen.append)
    assert result["epochs"] == 4 and result["best_epoch"] == 1
    assert [s["epoch"] for s in seen] == [1, 2, 3, 4]


def test_summary_and_markdown():
    runs = [dict(dataset="Cora", model=m, seed=s, test_acc=a, epochs=10, ms_per_epoch=t)
            for m, t in (("gat", 2.0), ("tgattn", 3.0)) for s, a in enumerate((0.80, 0.82))]
    rows = bench.summarize(runs)
    assert [(r["model"], r["runs"]) for r in rows] == [("gat", 2), ("tgattn", 2)]
    assert rows[1]["test_acc_mean"] == pytest.approx(81.0)
    assert rows[1]["test_acc_std"] == pytest.approx(1.41421356, rel=1e-6)
    assert rows[1]["time_vs_gat"] == pytest.approx(1.5)
    assert "| Cora | tgattn | 81.0 ± 1.4 | 2 | 10 | 3.0 | 1.50 |" in bench.markdown(rows)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--dataset", "Karate"], "unknown dataset 'Karate'"),
        (["--model", "gcn"], "unknown model 'gcn'"),
        (["--seeds", "0"], "--seeds must be >= 1"),
        (["--jobs", "0"], "--jobs must be >= 1"),
    ],
)
def test_argument_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("root, message", [
    ("nope", "Planetoid CiteSeer not found: data folder '{root}' (from root) does not exist"),
    (".", "Planetoid CiteSeer not found: {root}/planetoid/CiteSeer/raw/ind.citeseer.x does not exist"),
])
def test_data_folder_without_planetoid(root, message, tmp_path, cli):
    root = tmp_path / root
    status, err = cli(bench.main, ["--dataset", "CiteSeer", "--data-root", str(root), "--out", str(tmp_path / "out")])
    assert status == 2 and one_line_error(err, "python -m tgattn.bench.planetoid").startswith(message.format(root=root))


def test_dataset_names_are_case_insensitive(data_root):
    args = bench.parse_args(["--dataset", "cora", "citeseer", "--model", "gat", "tgattn", "--data-root", str(data_root)])
    assert args.dataset == ["Cora", "CiteSeer"] and args.model == ["gat", "tgattn"]


@pytest.mark.slow
def test_main_writes_tables(data_root, tmp_path, capsys):
    out = tmp_path / "res"
    argv = ["--dataset", "Cora", "--model", "tgattn", "--seeds", "2", "--epochs", "2",
            "--data-root", str(data_root), "--out", str(out), "--no-progress"]
    assert bench.main(argv) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"wrote {out / 'runs.csv'}, {out / 'results.csv'}, {out / 'results.md'}"
    with (out / "runs.csv").open() as f:
        runs = list(csv.DictReader(f))
    assert [(r["model"], r["seed"], r["epochs"]) for r in runs] == [("tgattn", "0", "2"), ("tgattn", "1", "2")]
    assert "| Cora | tgattn |" in (out / "results.md").read_text()
    # worker processes give the same runs, in the same order (timings aside)
    assert bench.main(argv[:-3] + ["--out", str(tmp_path / "par"), "--jobs", "2", "--no-progress"]) == 0
    with (tmp_path / "par" / "runs.csv").open() as f:
        parallel = list(csv.DictReader(f))
    drop = lambda rows: [{k: v for k, v in r.items() if k != "ms_per_epoch"} for r in rows]  # noqa: E731
    assert drop(parallel) == drop(runs)
