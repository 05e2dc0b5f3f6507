"""PyG's own ``examples/gat.py`` loop with GATConv, TransformerConv and tgattn side by side.

Each epoch is what PyG's example times (its ``train()`` then ``test()``): a training step
(forward, cross-entropy on the training nodes, backward, Adam with lr 0.005 and weight decay
5e-4) and an evaluation forward with the train / validation / test accuracies, on a Planetoid
graph with PyG's ``NormalizeFeatures`` (dense, row-normalised features). The network is the
example's, the GAT paper's (:class:`tgattn.bench.models.Net`: dropout 0.6, 8 heads x 8 channels,
ELU, one output head), around each conv of :data:`tgattn.bench.models.MODELS`. The models live in
one process and take one epoch each in turn, the order rotating every epoch, so that the load of
a shared machine falls on all of them alike; each model's median epoch time (the example's
statistic) and its ratio to GATConv's are reported.

    python -m tgattn.bench.gat_example --dataset Cora CiteSeer --threads 2

Writes ``gat_example.csv`` (a row per data set and model) under ``--out`` and prints the table.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List

from .._cli import out_help, positive_int, run, runs_dir
from .choices import CONVS, NODE_SETS

FIELDS = ("dataset", "threads", "model", "epochs", "median_ms", "vs_gat", "vs_transformer", "test_acc")


def example_epochs(nets: Dict[str, object], data, epochs: int, *, progress=None) -> Dict[str, dict]:
    """Train each net of ``nets`` for ``epochs`` epochs as PyG's ``examples/gat.py`` does, in turn.

    Returns per name ``{"seconds": [one per epoch], "test_acc": the last epoch's}``; the epoch
    time covers the training step and the evaluation, as the example's does.
    """
    import torch
    import torch.nn.functional as F

    optimizers = {name: torch.optim.Adam(net.parameters(), lr=0.005, weight_decay=5e-4) for name, net in nets.items()}
    result = {name: {"seconds": [], "test_acc": None} for name in nets}
    names = list(nets)
    for epoch in range(epochs):
        for name in names[epoch % len(names):] + names[:epoch % len(names)]:  # rotated: none always first
            net, optimizer = nets[name], optimizers[name]
            start = time.perf_counter()
            net.train()  # the example's train()
            optimizer.zero_grad()
            out = net(data.x, data.edge_index)
            F.cross_entropy(out[data.train_mask], data.y[data.train_mask]).backward()
            optimizer.step()
            net.eval()  # the example's test()
            with torch.no_grad():
                pred = net(data.x, data.edge_index).argmax(dim=-1)
            accs = [int((pred[mask] == data.y[mask]).sum()) / int(mask.sum())
                    for mask in (data.train_mask, data.val_mask, data.test_mask)]
            result[name]["seconds"].append(time.perf_counter() - start)
            result[name]["test_acc"] = accs[2]
        if progress is not None:
            progress.update()
    return result


def rows_of(dataset: str, threads: int, result: Dict[str, dict]) -> List[dict]:
    """One row per model: the median epoch in ms and its ratios to GATConv's and TransformerConv's."""
    median = {name: 1000 * statistics.median(r["seconds"]) for name, r in result.items()}
    return [{"dataset": dataset, "threads": threads, "model": name, "epochs": len(r["seconds"]),
             "median_ms": median[name], "vs_gat": median[name] / median["gat"] if "gat" in median else None,
             "vs_transformer": median[name] / median["transformer"] if "transformer" in median else None,
             "test_acc": r["test_acc"]} for name, r in result.items()]


def table(rows: List[dict]) -> str:
    """The rows as a Markdown table."""
    fmt = lambda v: "" if v is None else f"{v:.2f}x"  # noqa: E731
    lines = ["| data set | threads | model | median epoch (ms) | vs GATConv | vs TransformerConv | test acc. (last epoch) |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['dataset']} | {r['threads']} | {r['model']} | {r['median_ms']:.1f} | {fmt(r['vs_gat'])} "
              f"| {fmt(r['vs_transformer'])} | {100 * r['test_acc']:.1f} % |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="python -m tgattn.bench.gat_example",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", nargs="+", default=["Cora"], choices=NODE_SETS)
    parser.add_argument("--models", nargs="+", default=["gat", "transformer", "tgattn"], choices=CONVS)
    parser.add_argument("--epochs", type=positive_int, default=200, help="epochs per model (default: 200, the example's)")
    parser.add_argument("--threads", type=positive_int, default=2, help="torch threads (default: 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data", default=None, help="Planetoid folder (default: TGATTN_DATA, else a download)")
    parser.add_argument("--out", type=Path, default=runs_dir("gat_example"), help=out_help("gat_example"))
    parser.add_argument("--no-progress", action="store_true")
    return run(parser, _bench, parser.parse_args(argv))


def _bench(args) -> int:
    import torch
    import torch_geometric.transforms as T
    from tqdm import tqdm

    from ..datasets import load_planetoid
    from .models import MODELS, Net
    from .report import write_csv

    graphs = {name: T.NormalizeFeatures()(load_planetoid(name, args.data)[0]) for name in args.dataset}
    torch.set_num_threads(args.threads)
    rows = []
    with tqdm(total=args.epochs * len(graphs), disable=args.no_progress, desc="epochs") as progress:
        for name, data in graphs.items():
            nets = {}
            for model in args.models:
                torch.manual_seed(args.seed)
                nets[model] = Net(MODELS[model], data.num_features, int(data.y.max()) + 1)
            rows += rows_of(name, args.threads, example_epochs(nets, data, args.epochs, progress=progress))
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(rows, args.out / "gat_example.csv", FIELDS)
    print(table(rows))
    print(f"\nwrote {args.out / 'gat_example.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
