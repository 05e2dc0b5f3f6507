"""``python -m tgattn.bench.distributed``: graph attention on 1, 2, 4 gloo ranks of this machine.

Two tables:

* ``partition.csv`` (one process, no exchange run): the halo that each partitioner leaves on
  Cora and CiteSeer for 2 to 16 parts, and the halo of sequence patterns cut into contiguous
  ranges, next to the rows a ring (full attention) would pass to each rank.
* ``attention.csv`` (one spawned job per world size): per rank, forward+backward of
  :func:`tgattn.distributed.graph_attention` (fp32), split into the time inside the exchange
  and the rest (compute), the halo rows and bytes it moved against the minimum the partition
  allows, and its peak memory (tensors created by the step; process peak RSS).

The ranks share this machine's cores (one thread each), so the numbers show what the exchange
costs, not a speed-up. Examples::

    python -m tgattn.bench.distributed --quick        # small sizes, about two minutes
    python -m tgattn.bench.distributed --out data/distributed
"""
from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List

from .._cli import out_help, run, runs_dir

if TYPE_CHECKING:
    import torch

ATTENTION_FIELDS = ("case", "n", "edges", "heads", "dim", "world", "rank", "queries", "local_edges", "halo_rows",
                    "min_rows", "ring_rows", "bytes_per_step", "total_ms", "exchange_ms", "compute_ms", "peak_mb",
                    "rss_mb")
PARTITION_FIELDS = ("graph", "nodes", "edges", "method", "parts", "halo_rows", "max_rank_halo", "halo_fraction",
                    "ring_rows", "balance")


def causal_window_edges(lo: int, hi: int, w: int) -> torch.Tensor:
    """The edges of ``builders.window(n, w, causal=True)`` into queries ``lo .. hi - 1`` (any
    n >= hi), built from a window over that range and its halo alone (a window is the same band
    everywhere), so that no rank builds the whole edge set.

    Example:
        >>> import torch
        >>> from tgattn import builders
        >>> full = builders.window(30, 3, causal=True)
        >>> torch.equal(causal_window_edges(10, 20, 3), full[:, (full[1] >= 10) & (full[1] < 20)])
        True
    """
    from .. import builders

    start = max(lo - w, 0)
    local = builders.window(hi - start, w, causal=True) + start
    return local[:, local[1] >= lo]


def pattern_edges(pattern: str, n: int) -> torch.Tensor:
    """The whole edge set of a benchmark pattern (random draws seeded with 0)."""
    import torch

    from .. import builders

    gen = torch.Generator().manual_seed(0)
    if pattern == "window64":
        return builders.window(n, 64, causal=True)
    if pattern == "bigbird":
        return builders.bigbird(n, 64, 1, 3, generator=gen, causal=True)
    if pattern == "random16":
        return builders.random(n, 16, generator=gen)
    if pattern == "causal":
        return builders.causal(n)
    raise ValueError(f"unknown pattern {pattern!r}")


def cases(quick: bool, big: int) -> Dict[str, dict]:
    """name -> ``{"pattern", "n", "heads", "dim"}`` (plain values: they travel to the ranks)."""
    small = 2048 if quick else 16384
    specs = {f"{p}_{small}": dict(pattern=p, n=small, heads=8, dim=64) for p in ("window64", "bigbird", "random16")}
    specs[f"causal_{small // 4}"] = dict(pattern="causal", n=small // 4, heads=8, dim=64)
    if not quick:
        specs["window64_131072"] = dict(pattern="window64", n=131072, heads=8, dim=64)
    if big:
        specs[f"window64_{big}_h2d32"] = dict(pattern="window64", n=big, heads=2, dim=32)
    return specs


def _local_edges(spec: dict, part, rank: int) -> torch.Tensor:
    import torch

    if spec["pattern"] != "window64":
        return part.local_edges(pattern_edges(spec["pattern"], spec["n"]), rank)
    nodes = part.nodes(rank)
    return causal_window_edges(int(nodes[0]), int(nodes[-1]) + 1, 64) if len(nodes) else torch.zeros(2, 0, dtype=torch.long)


def _measure(name: str, spec: dict, rank: int, world: int, repeats: int) -> dict:
    import torch

    from ..distributed import ExchangeStats, contiguous, graph_attention, halo_rows, make_plan
    from .measure import _LiveBytes

    import torch.distributed as dist

    n, heads, dim = spec["n"], spec["heads"], spec["dim"]
    part = contiguous(n, world)
    plan = make_plan(_local_edges(spec, part, rank), part)
    plan.stats = ExchangeStats()
    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(plan.num_queries, heads, dim, generator=g).requires_grad_() for _ in range(3))
    grad = torch.randn(plan.num_queries, heads, dim, generator=g)
    best, best_exchange, step_bytes = float("inf"), 0.0, 0
    for _ in range(repeats + 1):  # the first run is a warm-up (engine analysis, first-touch pages)
        for t in (q, k, v):
            t.grad = None
        dist.barrier()
        before = (plan.stats.seconds, plan.stats.bytes_sent)
        start = time.perf_counter()
        graph_attention(q, k, v, plan).backward(grad)
        elapsed = time.perf_counter() - start
        step_bytes = plan.stats.bytes_sent - before[1]
        if elapsed < best:
            best, best_exchange = elapsed, plan.stats.seconds - before[0]
    dist.barrier()
    with _LiveBytes() as probe:
        graph_attention(q, k, v, plan).backward(grad)
    edges = torch.tensor([plan.edge_index.shape[1]])
    dist.all_reduce(edges)
    # a window's minimum is known without the whole edge set: w rows from the previous range
    minimum = min(64, int(plan.nodes[0])) if spec["pattern"] == "window64" and len(plan.nodes) else \
        halo_rows(pattern_edges(spec["pattern"], n), part)[rank]
    return {"case": name, "n": n, "edges": int(edges), "heads": heads, "dim": dim, "world": world, "rank": rank,
            "queries": plan.num_queries, "local_edges": plan.edge_index.shape[1], "halo_rows": plan.halo_rows,
            "min_rows": minimum, "ring_rows": n - plan.num_queries, "bytes_per_step": step_bytes,
            "total_ms": 1e3 * best, "exchange_ms": 1e3 * best_exchange, "compute_ms": 1e3 * (best - best_exchange),
            "peak_mb": probe.peak / 2**20, "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _job(rank: int, world: int, specs: Dict[str, dict], repeats: int) -> List[dict]:
    return [_measure(name, spec, rank, world, repeats) for name, spec in specs.items()]


def partition_rows(data_root, graphs=("Cora", "CiteSeer"), parts=(2, 4, 8, 16), n: int = 16384) -> List[dict]:
    """The halo of every partitioner on each graph, and of sequence patterns cut into ranges."""
    from ..distributed import contiguous
    from ..distributed.partition import partition_graph
    from ..datasets import load_planetoid

    loaded = {name: load_planetoid(name, data_root) for name in graphs}  # all before any work: a missing one fails first
    rows = []
    for name, data in loaded.items():
        ei, num = data.edge_index, data.num_nodes
        for p in parts:
            for method in ("metis", "louvain", "bandwidth", "contiguous"):
                part = partition_graph(ei, num, p, method=method)
                rows.append(_partition_row(name, ei, part, num))
    sequences = {name: pattern_edges(name, n) for name in ("window64", "bigbird", "random16")}
    for name, ei in sequences.items():
        for p in parts:
            rows.append(_partition_row(f"{name}_{n}", ei, contiguous(n, p), n))
    return rows


def _partition_row(graph: str, edge_index, part, num: int) -> dict:
    from ..distributed import make_plans

    halo = [p.halo_rows for p in make_plans(edge_index, part)]
    sizes = part.sizes()
    return {"graph": graph, "nodes": num, "edges": edge_index.shape[1], "method": part.method,
            "parts": part.world_size, "halo_rows": sum(halo), "max_rank_halo": max(halo),
            "halo_fraction": sum(halo) / (num * (part.world_size - 1)), "ring_rows": num * (part.world_size - 1),
            "balance": max(sizes) * part.world_size / num}


def summary(rows: List[dict]) -> str:
    """One line per (case, world): slowest rank's time split, halo and bytes summed over ranks."""
    head = (f"{'case':<26} {'P':>2} {'total ms':>9} {'exch ms':>8} {'comp ms':>8} {'halo rows':>10} {'minimum':>8} "
            f"{'ring rows':>10} {'MB/step':>8} {'peak MB/rank':>12}")
    lines = [head, "-" * len(head)]
    for key in dict.fromkeys((r["case"], r["world"]) for r in rows):
        sel = [r for r in rows if (r["case"], r["world"]) == key]
        slow = max(sel, key=lambda r: r["total_ms"])
        lines.append(f"{key[0]:<26} {key[1]:>2} {slow['total_ms']:>9.1f} {slow['exchange_ms']:>8.1f} "
                     f"{slow['compute_ms']:>8.1f} {sum(r['halo_rows'] for r in sel):>10} "
                     f"{sum(r['min_rows'] for r in sel):>8} {sum(r['ring_rows'] for r in sel):>10} "
                     f"{sum(r['bytes_per_step'] for r in sel) / 2**20:>8.2f} {max(r['peak_mb'] for r in sel):>12.1f}")
    return "\n".join(lines)


def plot(rows: List[dict], path: Path) -> None:
    """Per case and world size: bytes moved per step (halo, and a ring's for the same ranks),
    the slowest rank's time split, and the peak tensor memory per rank."""
    from .report import figure

    keys = list(dict.fromkeys((r["case"], r["world"]) for r in rows))
    labels = [f"{c} P={w}" for c, w in keys]
    sel = [[r for r in rows if (r["case"], r["world"]) == k] for k in keys]
    y = range(len(keys))
    row_bytes = [2 * s[0]["heads"] * s[0]["dim"] * 4 for s in sel]  # keys + values, fp32
    with figure(path, 1, 3, figsize=(15, 0.32 * len(keys) + 1.5), sharey=True) as (_, axes):
        halo = [sum(r["bytes_per_step"] for r in s) / 2**20 for s in sel]
        ring = [2 * sum(r["ring_rows"] for r in s) * b / 2**20 for s, b in zip(sel, row_bytes)]  # forward + backward
        axes[0].barh([i + 0.2 for i in y], ring, height=0.4, color="0.75", label="ring (full attention)")
        axes[0].barh([i - 0.2 for i in y], halo, height=0.4, label="halo")
        axes[0].set(xscale="symlog", xlabel="MB moved per forward+backward (all ranks)")
        axes[0].legend(fontsize=8)
        slow = [max(s, key=lambda r: r["total_ms"]) for s in sel]
        axes[1].barh(y, [r["compute_ms"] for r in slow], label="compute")
        axes[1].barh(y, [r["exchange_ms"] for r in slow], left=[r["compute_ms"] for r in slow], label="exchange (incl. waiting)")
        axes[1].set(xscale="log", xlabel="ms, slowest rank (shared 2-core machine)",
                    xlim=(min(r["compute_ms"] for r in slow) / 2, None))
        axes[1].legend(fontsize=8)
        axes[2].barh(y, [max(r["peak_mb"] for r in s) for s in sel])
        axes[2].set(xscale="log", xlabel="peak tensor MB per rank (forward+backward)")
        axes[0].set_yticks(list(y), labels, fontsize=7)
        axes[0].invert_yaxis()
        for ax in axes:
            ax.grid(alpha=0.3, axis="x")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="python -m tgattn.bench.distributed", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", nargs="+", type=int, default=[1, 2, 4], help="ranks per run (default: 1 2 4)")
    parser.add_argument("--quick", action="store_true", help="small sizes only (n = 2048)")
    parser.add_argument("--big", type=int, default=1 << 20, help="n of the large window run (0: skip; default: 2^20)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per case, minimum kept (default: 3)")
    parser.add_argument("--data", default=None, help="data folder for Cora / CiteSeer (default: $TGATTN_DATA)")
    parser.add_argument("--no-partitions", action="store_true", help="skip partition.csv")
    parser.add_argument("--out", type=Path, default=runs_dir("distributed"), help=out_help("distributed"))
    args = parser.parse_args(argv)
    return run(parser, _bench, args)


def _bench(args) -> int:
    import torch

    from ..distributed import spawn
    from .report import write_csv

    if not args.no_partitions:  # first: it reads Cora and CiteSeer, so a missing data set is one line before any run
        rows = partition_rows(args.data, parts=(2, 4) if args.quick else (2, 4, 8, 16))
        write_csv(rows, args.out / "partition.csv", PARTITION_FIELDS)
    specs = cases(args.quick, 0 if args.quick else args.big)
    rows = []
    for world in args.worlds:
        for ranks in spawn(_job, world, specs, args.repeats, timeout_s=3600):
            rows += ranks
        write_csv(rows, args.out / "attention.csv", ATTENTION_FIELDS)  # after each world: partial results survive
    plot(rows, args.out / "attention.png")
    print(f"torch {torch.__version__}, fp32, 1 thread per rank, gloo on 127.0.0.1")
    print(summary(rows))
    written = [*([] if args.no_partitions else [args.out / "partition.csv"]), args.out / "attention.csv", args.out / "attention.png"]
    print(f"\nwrote {', '.join(map(str, written))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
