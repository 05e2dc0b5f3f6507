"""Planetoid node classification (Cora, CiteSeer, PubMed) with GATConv, TransformerConv and tgattn.

Protocol of the GAT paper (Velickovic et al., "Graph Attention Networks", ICLR 2018), public split:
two attention layers, 8 heads x 8 hidden channels and ELU in the first, an output layer with 1
head (8 averaged heads on PubMed), dropout 0.6 on the inputs of both layers and on the attention
weights, Adam with lr 0.005 and weight decay 5e-4 (PubMed: lr 0.01, weight decay 0.001), early
stopping with patience 100 on validation loss and accuracy. Each model runs once per seed; the
table reports the test accuracy at the best validation epoch, mean ± std over seeds.

    python -m tgattn.bench.planetoid --dataset Cora CiteSeer --model gat transformer tgattn

Writes ``runs.csv`` (one row per run) and ``results.md`` / ``results.csv`` (one row per
dataset x model) under ``--out`` (default ``$TGATTN_RUNS/planetoid``, else
``~/.cache/tgattn/runs/planetoid``), and ends by naming them.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Dict, List, Optional

from .._cli import out_help, run, runs_dir
from .choices import MODEL_NAMES
from .report import write_csv

DATASETS = ("Cora", "CiteSeer", "PubMed")


def summarize(runs: List[dict]) -> List[dict]:
    """One row per (dataset, model): mean/std test accuracy (%), epochs, ms per epoch, time ratio to GAT."""
    rows = []
    for key in dict.fromkeys((r["dataset"], r["model"]) for r in runs):
        sel = [r for r in runs if (r["dataset"], r["model"]) == key]
        acc = [100 * r["test_acc"] for r in sel]
        rows.append({"dataset": key[0], "model": key[1], "runs": len(sel), "test_acc_mean": statistics.mean(acc),
                     "test_acc_std": statistics.stdev(acc) if len(acc) > 1 else 0.0,
                     "epochs_mean": statistics.mean(r["epochs"] for r in sel),
                     "ms_per_epoch": statistics.mean(r["ms_per_epoch"] for r in sel)})
    for row in rows:
        gat = [r for r in rows if r["dataset"] == row["dataset"] and r["model"] == "gat"]
        row["time_vs_gat"] = row["ms_per_epoch"] / gat[0]["ms_per_epoch"] if gat else float("nan")
    return rows


def markdown(rows: List[dict]) -> str:
    """The summary rows as a Markdown table."""
    lines = ["| dataset | model | test accuracy (%) | runs | epochs (mean) | train ms / epoch | time / GAT's |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['dataset']} | {r['model']} | {r['test_acc_mean']:.1f} ± {r['test_acc_std']:.1f} | "
                     f"{r['runs']} | {r['epochs_mean']:.0f} | {r['ms_per_epoch']:.1f} | {r['time_vs_gat']:.2f} |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    parser = _parser()
    return _check(parser, parser.parse_args(argv))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="python -m tgattn.bench.planetoid", description=__doc__.split("\n")[0])
    parser.add_argument("--dataset", nargs="+", default=["Cora"], help=f"one or more of {', '.join(DATASETS)}")
    parser.add_argument("--model", nargs="+", default=["tgattn"], help=f"one or more of {', '.join(MODEL_NAMES)}")
    parser.add_argument("--seeds", type=int, default=10, help="number of seeds, 0..seeds-1 (default: 10)")
    parser.add_argument("--epochs", type=int, default=1000, help="maximum epochs per run (default: 1000)")
    parser.add_argument("--patience", type=int, default=100, help="early-stopping patience (default: 100)")
    parser.add_argument("--data-root", default=None, help="data folder holding planetoid/<Name>/raw "
                        "(default: $TGATTN_DATA; without either, PyG downloads)")
    parser.add_argument("--out", default=runs_dir("planetoid"), help=out_help("planetoid"))
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--jobs", type=int, default=1, help="runs trained in parallel processes (default: 1)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return parser


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    known = {d.lower(): d for d in DATASETS}
    bad = [d for d in args.dataset if d.lower() not in known]
    if bad:
        parser.error(f"unknown dataset {bad[0]!r}; choose from {', '.join(DATASETS)}")
    args.dataset = [known[d.lower()] for d in args.dataset]
    bad = [m for m in args.model if m not in MODEL_NAMES]
    if bad:
        parser.error(f"unknown model {bad[0]!r}; choose from {', '.join(MODEL_NAMES)}")
    for name in ("seeds", "epochs", "patience", "jobs"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1 (got {getattr(args, name)})")
    return args


_GRAPHS: Dict[str, object] = {}  # per-process cache of prepared graphs


def run_one(dataset: str, model: str, seed: int, *, data_root=None, epochs: int = 1000, patience: int = 100,
            threads: Optional[int] = None) -> dict:
    """Train ``model`` on ``dataset`` with ``seed``; the row that ``runs.csv`` gets."""
    import torch

    from ..datasets import load_planetoid
    from .models import build_model, prepare, train

    if threads:
        torch.set_num_threads(threads)
    if dataset not in _GRAPHS:
        _GRAPHS[dataset] = prepare(load_planetoid(dataset, data_root))
    lr, wd = (0.01, 1e-3) if dataset == "PubMed" else (0.005, 5e-4)
    torch.manual_seed(seed)
    net = build_model(model, _GRAPHS[dataset], dataset)
    result = train(net, _GRAPHS[dataset], epochs=epochs, patience=patience, lr=lr, weight_decay=wd)
    return {"dataset": dataset, "model": model, "seed": seed, **result}


def main(argv=None) -> int:
    parser = _parser()
    return run(parser, _bench, _check(parser, parser.parse_args(argv)))


def _bench(args: argparse.Namespace) -> int:
    from concurrent.futures import ProcessPoolExecutor

    from tqdm import tqdm

    from ..datasets import load_planetoid
    from .models import prepare

    for dataset in args.dataset:  # first: a missing data set is one line (_cli.run) before any work
        _GRAPHS[dataset] = prepare(load_planetoid(dataset, args.data_root))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # Seeds outermost, models innermost: machine load hits all models alike, and an interrupted
    # run leaves (nearly) the same seeds for every (dataset, model) in runs.csv.
    tasks = [(d, m, s) for s in range(args.seeds) for d in args.dataset for m in args.model]
    options = dict(data_root=args.data_root, epochs=args.epochs, patience=args.patience, threads=args.threads)
    runs = []
    with tqdm(total=len(tasks), disable=args.no_progress, unit="run") as bar:
        if args.jobs == 1:
            results = (run_one(*task, **options) for task in tasks)
        else:  # worker processes, each training one run at a time; results come back in task order
            pool = ProcessPoolExecutor(args.jobs)
            futures = [pool.submit(run_one, *task, **options) for task in tasks]
            results = (future.result() for future in futures)
        for result in results:
            runs.append(result)
            write_csv(runs, out / "runs.csv", list(runs[0]))
            bar.set_description(f"{result['dataset']} {result['model']} seed {result['seed']}")
            bar.set_postfix(acc=f"{100 * result['test_acc']:.1f}")
            bar.update()
        if args.jobs > 1:
            pool.shutdown()
    rows = summarize(runs)
    write_csv(rows, out / "results.csv", list(rows[0]))
    (out / "results.md").write_text(markdown(rows))
    sys.stdout.write(markdown(rows))
    print(f"\nwrote {', '.join(str(out / name) for name in ('runs.csv', 'results.csv', 'results.md'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
