"""The training runs of :mod:`tgattn.bench.graph_transformers`: the data sets and their splits, one
run of a model (a row of ``runs.csv``), and training epochs of the molecule models side by side.

Molecules (:func:`run_molecules`): regression, test RMSE at the best validation epoch, targets
standardised on train, Adam, batches of 128. Planetoid (:func:`run_nodes`): test accuracy at the
best validation epoch. Time per epoch is the training loop's wall time (data loading included,
evaluation excluded; on Planetoid taken epoch to epoch, evaluation included, for the minimum);
peak memory is the tensors created by one training step (:func:`tgattn.bench.measure.peak_extra_mb`).
"""
from __future__ import annotations

import statistics
import time
from typing import Dict, List

import torch

from ..choices import MOLECULE_SETS
from .models import MOLECULE_MODELS, MoleculeNet, NodeNet, add_expander
from ..measure import interleaved, peak_extra_mb


def molecule_splits(name: str, rwse: int = 0):
    """``(train, val, test)`` lists of graphs, each graph with its ``expander_index`` (and its
    ``random_walk_pe [N, rwse]`` when ``rwse > 0``)."""
    from torch_geometric.transforms import AddRandomWalkPE

    from ...datasets.molecules import load_freesolv, load_solubility

    g = torch.Generator().manual_seed(0)
    if name == "FreeSolv":
        graphs = load_freesolv()
        order = torch.randperm(len(graphs), generator=g).tolist()
        a, b = int(0.8 * len(graphs)), int(0.9 * len(graphs))
        parts = [[graphs[i] for i in order[:a]], [graphs[i] for i in order[a:b]], [graphs[i] for i in order[b:]]]
    else:
        train, test = load_solubility()
        order = torch.randperm(len(train), generator=g).tolist()
        cut = int(0.9 * len(train))
        parts = [[train[i] for i in order[:cut]], [train[i] for i in order[cut:]], test]
    for part in parts:
        add_expander(part)
        if rwse:
            part[:] = [AddRandomWalkPE(rwse)(g) for g in part]
    return parts


def _rmse(net, loader, mean: float, std: float) -> float:
    net.eval()
    with torch.no_grad():
        err = torch.cat([net(b) * std + mean - b.y.view(-1) for b in loader])
    return float(err.square().mean().sqrt())


def run_molecules(splits, dataset: str, model: str, seed: int, s: Dict) -> Dict:
    """Train one molecule model with the ``mol_*`` settings ``s``; its row of ``runs.csv``."""
    from torch_geometric.loader import DataLoader

    train, val, test = splits
    ys = torch.cat([g.y.view(-1) for g in train])
    mean, std = float(ys.mean()), float(ys.std())
    torch.manual_seed(seed)
    shape = dict(hidden=s["mol_hidden"], layers=s["mol_layers"], dropout=s["mol_dropout"], rwse=s["mol_rwse"],
                 norm=s["mol_norm"])
    net = MoleculeNet(model, **shape)
    row = {"dataset": dataset, "model": model, "seed": seed, "metric": "rmse", "max_abs_diff_vs_mha": ""}
    first = next(iter(DataLoader(train, batch_size=128)))
    if model == "gps_tgattn":  # the PyG twin of the same seed: same outputs before training
        torch.manual_seed(seed)
        twin = MoleculeNet("gps_mha", **shape).eval()
        with torch.no_grad():
            row["max_abs_diff_vs_mha"] = float((net.eval()(first) - twin(first)).abs().max())
    opt = torch.optim.Adam(net.parameters(), lr=s["mol_lr"], weight_decay=s["mol_wd"])
    loader = DataLoader(train, batch_size=128, shuffle=True, generator=torch.Generator().manual_seed(seed))
    vl, tl = DataLoader(val, batch_size=256), DataLoader(test, batch_size=256)
    net.train()
    row["peak_mb"] = peak_extra_mb(lambda: ((net(first) - (first.y.view(-1) - mean) / std) ** 2).mean(), True, [],
                                   torch.ones(()))
    best, times, waited = (float("inf"), None), [], 0
    for _ in range(s["mol_epochs"]):
        net.train()
        start = time.perf_counter()
        for b in loader:
            if b.num_nodes < 2:  # a last batch of one one-atom molecule: batch norm cannot train on it
                continue
            opt.zero_grad()
            loss = ((net(b) - (b.y.view(-1) - mean) / std) ** 2).mean()
            loss.backward()
            opt.step()
        times.append(time.perf_counter() - start)
        val_rmse = _rmse(net, vl, mean, std)
        if val_rmse < best[0]:
            best, waited = (val_rmse, _rmse(net, tl, mean, std)), 0
        else:
            waited += 1
            if waited >= s["mol_patience"]:
                break
    row.update(value=best[1], val=best[0], epochs=len(times), ms_per_epoch=1e3 * statistics.mean(times),
               min_ms_per_epoch=1e3 * min(times))
    return row


def run_nodes(graph, dataset: str, model: str, seed: int, s: Dict) -> Dict:
    """Train one Planetoid model; its row of ``runs.csv``.

    The GAT baseline keeps the GAT paper's network and optimiser (lr 0.005, weight decay 5e-4);
    the graph transformers take the ``node_*`` settings ``s``. Both stop early after
    ``node_patience`` epochs without a better validation accuracy or loss.
    """
    import torch.nn.functional as F

    from ..models import build_model, train

    torch.manual_seed(seed)
    classes = int(graph.y.max()) + 1
    optim = {}
    if model == "gat":
        net = build_model("gat", graph, dataset)
    else:
        net = NodeNet(model, graph.num_features, classes, graph.edge_index, graph.num_nodes, seed=seed,
                      hidden=s["node_hidden"], layers=s["node_layers"], dropout=s["node_dropout"], norm=s["node_norm"])
        optim = dict(lr=s["node_lr"], weight_decay=s["node_wd"])
    net.train()
    mask = graph.train_mask
    peak = peak_extra_mb(lambda: F.cross_entropy(net(graph.x, graph.edge_index)[mask], graph.y[mask]), True, [],
                         torch.ones(()))
    times = []
    result = train(net, graph, epochs=s["node_epochs"], patience=s["node_patience"], **optim,
                   on_epoch=lambda _: times.append(time.perf_counter()))
    steps = [b - a for a, b in zip(times, times[1:])]  # epoch to epoch, evaluation included: only for the minimum
    return {"dataset": dataset, "model": model, "seed": seed, "metric": "accuracy", "value": result["test_acc"],
            "val": result["val_acc"], "epochs": result["epochs"], "ms_per_epoch": result["ms_per_epoch"],
            "min_ms_per_epoch": 1e3 * min(steps) if steps else result["ms_per_epoch"], "peak_mb": peak,
            "max_abs_diff_vs_mha": ""}


def epoch_timing(dataset: str, rounds: int, *, seed: int = 0, models=MOLECULE_MODELS) -> List[Dict]:
    """Training epochs of the molecule models, interleaved model by model, ``rounds`` times.

    The same fixed batches (shuffled once) for every model; one warm-up epoch each
    (:func:`~tgattn.bench.measure.interleaved`). On a shared machine the minimum over rounds,
    measured side by side in one process, is the number that compares models (the per-run
    times of ``runs.csv`` come from parallel workers).
    """
    from torch_geometric.loader import DataLoader

    train = molecule_splits(dataset)[0]
    batches = list(DataLoader(train, batch_size=128, shuffle=True, generator=torch.Generator().manual_seed(seed)))
    nets, opts = {}, {}
    for model in models:
        torch.manual_seed(seed)
        nets[model] = MoleculeNet(model).train()
        opts[model] = torch.optim.Adam(nets[model].parameters(), lr=1e-3)

    def epoch(model: str):
        def run(r: int) -> None:
            for b in batches:
                opts[model].zero_grad()
                ((nets[model](b) - b.y.view(-1)) ** 2).mean().backward()
                opts[model].step()

        return run

    times = {model: [] for model in models}
    interleaved({model: epoch(model) for model in models}, rounds,
                on_call=lambda model, seconds: times[model].append(seconds))
    sizes = torch.tensor([g.num_nodes for g in train])
    rows = [{"dataset": dataset, "model": m, "rounds": rounds, "batches": len(batches),
             "min_ms": 1e3 * min(t), "median_ms": 1e3 * statistics.median(t),
             "nodes_min_mean_max": f"{int(sizes.min())}/{float(sizes.double().mean()):.1f}/{int(sizes.max())}"}
            for m, t in times.items()]
    for row in rows:
        row["speedup_vs_mha"] = rows[models.index("gps_mha")]["min_ms"] / row["min_ms"]
    return rows


_DATA: Dict[tuple, object] = {}  # per-process cache of loaded data sets, by (name, rwse)


def load(dataset: str, rwse: int, data_root=None):
    """A molecule set's splits (:func:`molecule_splits`) or a prepared Planetoid graph, loaded
    once per process."""
    if (dataset, rwse) not in _DATA:
        if dataset in MOLECULE_SETS:
            _DATA[dataset, rwse] = molecule_splits(dataset, rwse)
        else:
            from ...datasets import load_planetoid
            from ..models import prepare

            _DATA[dataset, rwse] = prepare(load_planetoid(dataset, data_root))
    return _DATA[dataset, rwse]


def run_task(dataset: str, model: str, seed: int, settings: Dict, data_root=None, threads: int = 1) -> Dict:
    """One training run (in this process or a worker); its row of ``runs.csv``."""
    torch.set_num_threads(threads)
    data = load(dataset, settings["mol_rwse"], data_root)
    if dataset in MOLECULE_SETS:
        return run_molecules(data, dataset, model, seed, settings)
    return run_nodes(data, dataset, model, seed, settings)
