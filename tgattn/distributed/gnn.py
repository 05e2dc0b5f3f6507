"""DDP training of a graph attention network on a partitioned graph (Planetoid, Cora by default).

Full-graph training, split by nodes: each rank owns one part of a METIS partition (or the
fallback, see :func:`~tgattn.distributed.partition.partition_graph`), its nodes' features and
labels, and their incoming edges; every attention layer exchanges the halo of keys and values.
The network is the GAT paper's (two layers, 8 heads x 8 channels, ELU, dropout 0.6; the
``tgattn`` model of :mod:`tgattn.bench.planetoid`) with the self-loops added to the graph
before partitioning. DDP averages the gradients over a second process group, so the halo
exchange and the all-reduce never share a communicator.

    python -m tgattn.distributed.gnn --nproc 2 --epochs 200
    torchrun --nproc-per-node 4 -m tgattn.distributed.gnn --partition metis

Writes ``<out>/gnn_<dataset>_<world>.json``: the test accuracy at the best validation
accuracy, time per epoch, and per rank the nodes, halo rows and bytes exchanged; prints the
accuracy and the file's path. The arguments are checked and the data set is loaded before any
process starts: a bad value, a missing data set or an ``--out`` folder that cannot be written
ends on one line (exit status 2). A rank
that is gone or stopped ends the job within ``--timeout`` seconds, on one line naming it
(``train_rank on 2 ranks ended: rank 1 was killed by SIGKILL``). torch and PyG are imported
after the arguments are parsed: ``--help`` and argument errors answer at once.
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Dict, Tuple

from .._cli import (check_writable, int_in, non_negative_float, out_help, positive_float, positive_int, run, runs_dir,
                   seed_int)
from .launch import MAX_RANKS, PEER_TIMEOUT_S, TIMEOUT_HELP

if TYPE_CHECKING:  # torch and PyG come with the first call, not with the command line's parser
    from torch import Tensor, nn

    from ..bench.models import Net
    from .partition import Partition
    from .plan import HaloPlan


def graph_with_loops(data) -> Tensor:
    """``data.edge_index`` with one self-loop per node (the attention layers add none)."""
    from torch_geometric.utils import add_self_loops, remove_self_loops

    return add_self_loops(remove_self_loops(data.edge_index)[0], num_nodes=data.num_nodes)[0]


def distributed_net(in_channels: int, num_classes: int, *, dropout: float = 0.6) -> Net:
    """The GAT-protocol :class:`~tgattn.bench.models.Net` built from distributed convs."""
    from ..bench.models import Net
    from .nn import DistributedGraphAttentionConv

    def conv(i, o, heads, concat):
        return DistributedGraphAttentionConv(i, o, heads, concat=concat, dropout=dropout, root_weight=False)

    return Net(conv, in_channels, num_classes, dropout=dropout)


def shard(data, partition: Partition, rank: int, *, group=None) -> Tuple[HaloPlan, Dict[str, Tensor]]:
    """This rank's plan (collective) and its rows of the prepared features, labels and masks."""
    from ..bench.models import prepare
    from .plan import make_plan

    plan = make_plan(partition.local_edges(graph_with_loops(data), rank), partition, group=group)
    nodes = plan.nodes
    x = prepare(data).x.to_dense()[nodes].to_sparse_csr()  # row-normalized bag of words, ~1 % non-zero
    rows = {"x": x, "y": data.y[nodes]}
    rows.update({name: getattr(data, f"{name}_mask")[nodes] for name in ("train", "val", "test")})
    return plan, rows


def loss_share(logits: Tensor, rows: Dict[str, Tensor], split: str, total: int) -> Tensor:
    """This rank's share of the mean cross-entropy over the ``split`` nodes of all ranks."""
    import torch.nn.functional as F

    mask = rows[split]
    return F.cross_entropy(logits[mask], rows["y"][mask], reduction="sum") / total


def _counts(net: nn.Module, rows, plan) -> Tensor:
    """Correct predictions and sizes of train / val / test, and the validation loss sum."""
    import torch
    import torch.nn.functional as F

    net.eval()
    with torch.no_grad():
        logits = net(rows["x"], plan)
    pred = logits.argmax(-1)
    out = []
    for split in ("train", "val", "test"):
        mask = rows[split]
        out += [float((pred[mask] == rows["y"][mask]).sum()), float(mask.sum())]
    out.append(float(F.cross_entropy(logits[rows["val"]], rows["y"][rows["val"]], reduction="sum")))
    return torch.tensor(out, dtype=torch.float64)


def train_rank(rank: int, world: int, args, data) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from .partition import partition_graph
    from .plan import ExchangeStats

    torch.set_num_threads(args.threads)
    partition = partition_graph(data.edge_index, data.num_nodes, world, method=args.partition)
    halo_group = dist.new_group()
    plan, rows = shard(data, partition, rank, group=halo_group)
    plan.stats = ExchangeStats()
    torch.manual_seed(args.seed)
    net = distributed_net(data.num_features, int(data.y.max()) + 1)
    ddp = DistributedDataParallel(net)  # broadcasts rank 0's weights, averages gradients
    opt = torch.optim.Adam(net.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    total = int(data.train_mask.sum())
    best, train_time = None, 0.0
    for epoch in range(1, args.epochs + 1):
        start = time.perf_counter()
        ddp.train()
        opt.zero_grad()
        (loss_share(ddp(rows["x"], plan), rows, "train", total) * world).backward()  # DDP averages
        opt.step()
        train_time += time.perf_counter() - start
        counts = _counts(net, rows, plan)
        dist.all_reduce(counts)
        acc = {s: float(counts[2 * i] / counts[2 * i + 1]) for i, s in enumerate(("train", "val", "test"))}
        val_loss = float(counts[6] / counts[3])
        if best is None or (acc["val"], -val_loss) > (best["val_acc"], -best["val_loss"]):
            best = {"epoch": epoch, "val_acc": acc["val"], "val_loss": val_loss, "test_acc": acc["test"]}
    mine = {"rank": rank, "nodes": plan.num_queries, "edges": plan.edge_index.shape[1], "halo_rows": plan.halo_rows,
            "exchange_bytes_sent": plan.stats.bytes_sent, "exchange_seconds": plan.stats.seconds,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    ranks = [None] * world
    dist.all_gather_object(ranks, mine)
    if rank == 0:
        summary = {"dataset": args.dataset, "world": world, "partition": partition.method, "epochs": args.epochs,
                   **best, "ms_per_epoch": 1000 * train_time / args.epochs, "ranks": ranks}
        path = Path(args.out) / f"gnn_{args.dataset.lower()}_{world}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(summary, indent=1))
        print(f"{args.dataset} on {world} rank{'s' * (world > 1)}: test accuracy {best['test_acc']:.3f} at epoch {best['epoch']} "
              f"(best validation accuracy {best['val_acc']:.3f}), {summary['ms_per_epoch']:.1f} ms per epoch")
        print(f"wrote {path}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="python -m tgattn.distributed.gnn", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int_in(1, MAX_RANKS), default=1,
                        help=f"local processes when not under torchrun, at most {MAX_RANKS} (default: 1)")
    parser.add_argument("--dataset", default="Cora", help="Planetoid data set (default: Cora)")
    parser.add_argument("--partition", default="auto", help="auto, metis, louvain, bandwidth or contiguous (default: auto)")
    parser.add_argument("--epochs", type=positive_int, default=200, help="training epochs (default: 200)")
    parser.add_argument("--lr", type=positive_float, default=0.005, help="Adam learning rate (default: 0.005)")
    parser.add_argument("--weight-decay", type=non_negative_float, default=5e-4, help="(default: 5e-4)")
    parser.add_argument("--seed", type=seed_int, default=0)
    parser.add_argument("--threads", type=positive_int, default=1, help="torch threads per rank (default: 1)")
    parser.add_argument("--timeout", type=positive_float, default=PEER_TIMEOUT_S, help=TIMEOUT_HELP)
    parser.add_argument("--data", default=None, help="data folder (default: $TGATTN_DATA)")
    parser.add_argument("--out", default=runs_dir("distributed"), help=out_help("distributed"))
    args = parser.parse_args(argv)
    return run(parser, _load_and_launch, args)


def _load_and_launch(args) -> int:
    from ..datasets import load_planetoid
    from .launch import launch
    from .partition import METHODS

    if args.partition not in METHODS:
        raise ValueError(f"--partition must be one of {', '.join(METHODS)} (got {args.partition!r})")
    data = load_planetoid(args.dataset, args.data)[0]  # here, so that a missing data set is one line
    check_writable(args.out)  # before any rank starts: the file is written after training
    launch(train_rank, args.nproc, args, data, threads=args.threads, peer_timeout_s=args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
