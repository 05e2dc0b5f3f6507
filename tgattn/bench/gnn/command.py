"""PyG workloads side by side: ``python -m tgattn.bench.gnn``.

One training step (forward, backward, Adam) and one evaluation forward of the GAT paper's
two-layer network (:class:`tgattn.bench.models.Net`, dropout 0.6) with ``GATConv``,
``TransformerConv`` and tgattn's ``GraphAttentionConv`` (default and ``shared_projection``),
on the workloads PyG users run every day:

* ``molecules``: batches of 128 molecule-sized graphs (18-30 nodes, rings with chords), a
  new ``edge_index`` every step (each model gets its own copy, so that no model reuses an
  analysis another one made);
* ``molecules_edges``: the same batches with 4 features per bond, through two layers built as
  molecule models build them (:class:`~tgattn.bench.gnn.workloads.EdgeNet`:
  ``TransformerConv(64, 16, 4, True, True, 0.0, 4)`` then the heads averaged, ``beta=True``,
  edge features in keys and values; ``GraphAttentionConv`` with the same arguments and
  ``TransformerConv``'s weights; ``GATConv`` with ``edge_dim=4``);
* ``cora`` / ``citeseer``: the Planetoid graphs, full batch, self-loops as in GAT;
* ``random100k``: a random graph with 100,000 nodes and average degree 10.

Candidates run interleaved, one step each per round, and the minimum over rounds is kept,
so that the ratios come from one run on a shared machine. ``tgattn_engine`` rows (training
steps on molecules, Cora and CiteSeer) time the attention calls of the ``tgattn`` model's step
alone: the engine's share of that step, a floor for it. ``overhead`` rows give the extra time
of an attention call on a never-seen edge set against the same call on a cached one.

The workloads themselves are in :mod:`tgattn.bench.gnn.workloads`, imported once the arguments
are parsed (``--help`` needs no torch).

Example:
    python -m tgattn.bench.gnn --threads 1 2 --out runs/gnn
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import List

from ..._cli import out_help, positive_int, run, runs_dir
from ..choices import CONVS
from ..report import figure, write_csv

WORKLOADS = ("molecules", "molecules_edges", "cora", "citeseer", "random100k")
PLANETOID = {"cora": "Cora", "citeseer": "CiteSeer"}  # the workloads that read a data set
FIELDS = ("workload", "mode", "threads", "model", "nodes", "edges", "ms", "vs_gat", "vs_transformer")


def _ratios(rows: List[dict]) -> None:
    for row in rows:
        same = {r["model"]: r["ms"] for r in rows if (r["workload"], r["mode"], r["threads"]) == (row["workload"], row["mode"], row["threads"])}
        row["vs_gat"] = row["ms"] / same["gat"] if "gat" in same else None
        row["vs_transformer"] = row["ms"] / same["transformer"] if "transformer" in same else None


def summary(rows: List[dict]) -> str:
    """A markdown table: ms per step and the ratios to GATConv and TransformerConv."""
    lines = ["| workload | mode | threads | model | ms | vs GATConv | vs TransformerConv |", "|---|---|---|---|---|---|---|"]
    fmt = lambda v: "" if v is None else f"{v:.2f}x"  # noqa: E731
    for r in rows:
        if r["workload"] == "overhead":
            lines.append(f"| overhead | new edge set | {r['threads']} | tgattn | {r['ms']:.3f} (cached {r['cached_ms']:.3f}) "
                         f"| +{100 * r['extra']:.0f} % | |")
            continue
        lines.append(f"| {r['workload']} | {r['mode']} | {r['threads']} | {r['model']} | {r['ms']:.2f} "
                     f"| {fmt(r['vs_gat'])} | {fmt(r['vs_transformer'])} |")
    return "\n".join(lines)


def plot(rows: List[dict], path: Path) -> None:
    """Bars of each model's time relative to GATConv, one group per (workload, mode, threads)."""
    groups = sorted({(r["workload"], r["mode"], r["threads"]) for r in rows if r["workload"] != "overhead"})
    models = sorted({r["model"] for r in rows if r["workload"] != "overhead"})
    with figure(path, figsize=(max(6, 1.4 * len(groups)), 3.5), dpi=120) as (fig, ax):
        width = 0.8 / max(len(models), 1)
        for i, m in enumerate(models):
            values = [next((r["vs_gat"] for r in rows if (r["workload"], r["mode"], r["threads"], r["model"]) == (*g, m)), 0)
                      for g in groups]
            ax.bar([x + i * width for x in range(len(groups))], values, width, label=m)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([x + width * (len(models) - 1) / 2 for x in range(len(groups))])
        ax.set_xticklabels([f"{w}\n{m}, {t} thr" for w, m, t in groups], fontsize=8)
        ax.set_ylabel("time / GATConv time")
        ax.legend(fontsize=8)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="python -m tgattn.bench.gnn", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--models", nargs="+", default=list(CONVS), choices=CONVS)
    parser.add_argument("--threads", nargs="+", type=positive_int, default=[1, 2])
    parser.add_argument("--rounds", type=positive_int, default=15, help="timed rounds per candidate (default: 15)")
    parser.add_argument("--data", default=None, help="Planetoid folder (default: TGATTN_DATA, else a download)")
    parser.add_argument("--out", type=Path, default=runs_dir("gnn"), help=out_help("gnn"))
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        parser.error(f"--out: cannot create the folder {str(args.out)!r} ({err.strerror or err})")
    return run(parser, _bench, args)


def _bench(args) -> int:
    import torch
    from tqdm import tqdm

    from ...datasets import load_planetoid
    from .workloads import graph_workload, molecules, molecules_edges, new_edge_set_overhead
    from ..models import prepare

    # the data sets first, so that a missing one is one line (_cli.run) before any work
    graphs = {w: prepare(load_planetoid(PLANETOID[w], args.data)) for w in args.workloads if w in PLANETOID}
    rounds = {w: min(args.rounds, 5) if w == "random100k" else args.rounds for w in args.workloads}  # 100k: ~1 s a step
    per_thread = sum((1 if w.startswith("molecules") else 2) * (rounds[w] + 1) for w in args.workloads)
    progress = tqdm(total=per_thread * len(args.threads), disable=args.no_progress, desc="gnn bench")
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        found = []
        for workload in args.workloads:
            if workload == "molecules":
                found += molecules(args.models, args.rounds, progress)
            elif workload == "molecules_edges":
                found += molecules_edges(args.models, args.rounds, progress)
            else:
                found += graph_workload(workload, args.models, graphs.get(workload), rounds[workload], progress)
        found.append(new_edge_set_overhead())
        for row in found:
            row["threads"] = threads
        rows += found
    progress.close()
    _ratios([r for r in rows if r["workload"] != "overhead"])
    write_csv(rows, args.out / "gnn.csv", [*FIELDS, "cached_ms", "extra"])
    (args.out / "gnn.md").write_text(summary(rows) + "\n")
    print(summary(rows))
    written = [args.out / "gnn.csv", args.out / "gnn.md"]
    try:
        plot(rows, args.out / "gnn.png")
        written.append(args.out / "gnn.png")
    except ImportError:
        print('(no plot: pip install "tgattn[plot]")')
    print(f"\nwrote {', '.join(map(str, written))}")
    return 0
