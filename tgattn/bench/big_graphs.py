"""``python -m tgattn.bench.big_graphs``: attention GNNs on graphs of up to ogbn-products' size,
full batch and in NeighborLoader mini-batches, with tgattn's ``GraphAttentionConv``, PyG's
``GATConv`` and ``TransformerConv``.

The graph (:func:`power_law_graph`, seeded, drawn with a torch generator) is shaped like
ogbn-products (2,449,029 nodes, 61,859,140 edges, 100 features, 47 classes; Hu et al., "Open
Graph Benchmark", 2020): 25.26 directed edges per node, a power-law degree distribution, labels
from a planted partition that the edges follow, features with a weak signal of the label.

* ``full``: one process per (size, conv), started fresh under a memory cap (``--cap-gb``, the
  kernel's ``RLIMIT_DATA``: an allocation over it fails at once, torch's "you tried to allocate N
  bytes" or a ``MemoryError``, instead of waking the out-of-memory killer). The child builds the
  graph, then trains the two-layer network of :mod:`tgattn.bench.planetoid` (H = 4 heads of
  C = 16 channels, then 47 classes, dropout 0.6 on the features, none on the attention weights,
  so tgattn runs its fused kernel; Adam) full batch for ``--steps`` steps and reports its
  resident-set peak over the steps
  (``VmHWM``, reset once the inputs are built), the inputs' resident set, the step time (thread CPU
  time, one thread, minimum over the steps after the first) and the loss of each step; or the
  allocation that failed and its size. A conv that failed at one size is not run at larger ones;
  the sweep stops at the first size whose inputs do not fit.
* ``minibatch``: one capped process at ``--minibatch-nodes``, PyG's ``NeighborLoader`` (2 hops,
  fan-out ``--fanout`` 15 10, ``--batch-size`` 1024 seeds; it needs ``torch-sparse`` or ``pyg-lib``:
  ``pip install "tgattn[sampling]"``), or ``--sampler own``: :func:`fanout_batch`, a seeded
  sampler written here that draws the same kind of batch from a CSC copy of the graph. Every batch
  trains the convs in turn (interleaved, the order rotating), each one step on the batch's
  seed nodes; train steps per second are batches / summed thread CPU time of the steps (the
  sampling, the same for all, left out and reported apart), and the loss of the first and last
  tenth of the batches shows the run learns.

Writes ``full.csv``, ``full.md`` (the table and the targets) and ``full.png``, and
``minibatch.csv`` / ``minibatch.md``, under ``--out``.

Targets (issue 34): tgattn trains at the largest size whose inputs fit, where both peers run out;
at the largest size both peers fit, tgattn's step memory (peak - inputs) <= 0.5x each peer's and
its step time <= 1.0x GATConv's; mini-batch steps per second >= 1.0x GATConv's.

Example:
    python -m tgattn.bench.big_graphs --cap-gb 12 --out data/big_graphs
    python -m tgattn.bench.big_graphs --parts minibatch --cap-gb 12 --batches 60
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, List, Optional, Sequence, Tuple

from .._cli import out_help, positive_float, positive_int, run, runs_dir, seed_int

if TYPE_CHECKING:
    import torch

PRODUCTS_NODES, PRODUCTS_EDGES = 2_449_029, 61_859_140  # ogbn-products (Hu et al. 2020)
EDGES_PER_NODE = PRODUCTS_EDGES / PRODUCTS_NODES  # 25.26
FEATURES, CLASSES, HEADS, CHANNELS = 100, 47, 4, 16
EXPONENT = 2.5  # P(degree >= k) ~ k^-(EXPONENT - 1)
HOMOPHILY = 0.7  # share of the edges drawn inside the source's class
SIGNAL = 0.5  # class-centroid scale in the features (noise: standard normal)
CONVS = ("tgattn", "gat", "transformer")
SHARED = "tgattn_shared"  # on request: GraphAttentionConv with one projection for queries, keys and values
SIZES = tuple(round(PRODUCTS_NODES / 2**k) for k in range(6, -1, -1))  # 38k ... 2.45M nodes
FULL_FIELDS = ("nodes", "edges", "conv", "status", "phase", "inputs_mb", "peak_mb", "step_mb", "tried_mb", "ms",
               "wall_ms", "steps", "loss_first", "loss_last", "cap_gb", "note")
MINI_FIELDS = ("nodes", "edges", "conv", "sampler", "batches", "batch_size", "fanout", "steps_per_s", "vs_gat",
               "median_ms", "sample_ms", "batch_nodes", "batch_edges", "loss_first", "loss_last", "cap_gb")
_CHUNK = 1 << 23  # edges drawn per chunk (bounds the generator's temporaries)


def power_law_graph(nodes: int, seed: int = 0, edges_per_node: float = EDGES_PER_NODE
                    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x, edge_index, y)``: a seeded power-law graph with a planted partition (Chung-Lu).

    Each node gets a class (uniform among 47) and a weight ``w >= 1`` drawn from a Pareto law with
    tail exponent 2.5 (``P(w >= k) = k^-1.5``, mean 3), cut at ``sqrt(E) / 3``.
    ``E = round(nodes * 25.26)`` edges are drawn: the source in proportion to ``w`` among all
    nodes, the target in proportion to ``w`` inside the source's class (70 % of the edges) or
    among all nodes (30 %); so in- and out-degrees both follow the power law (at 2,449,029 nodes:
    in-degree median 14, 99th percentile 181, largest 17,439). Self-loops and repeated edges are
    dropped (1.6 % of the draws at 2,449,029 nodes, 10 % at 38,266: hubs meet more often in a
    small graph), and the edges come coalesced (sorted by source, then target) as PyG's
    data sets hold them, with node ids in random order. Features: a class centroid (standard
    normal, times 0.5) plus standard normal noise, 100 per node, float32.

    Example:
        >>> x, edge_index, y = power_law_graph(1000)
        >>> x.shape, y.shape, int(y.max()) < 47, 10_000 < edge_index.shape[1] <= 25_260
        (torch.Size([1000, 100]), torch.Size([1000]), True, True)
        >>> bool((edge_index[0] != edge_index[1]).all())
        True
    """
    import torch

    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < CLASSES:
        raise ValueError(f"nodes must be an int >= {CLASSES} (one per class at least; got {nodes!r})")
    g = torch.Generator().manual_seed(seed)
    draws = round(nodes * edges_per_node)
    alpha = EXPONENT - 1
    w = torch.rand(nodes, generator=g, dtype=torch.float64).clamp_min(1e-12).pow(-1 / alpha)  # Pareto, w >= 1
    w.clamp_(max=math.sqrt(draws) / 3)
    y = torch.randint(0, CLASSES, (nodes,), generator=g)
    order = torch.argsort(y, stable=True)  # nodes grouped by class
    cum = torch.cumsum(w[order], 0)
    ends = torch.searchsorted(y[order], torch.arange(1, CLASSES + 1), right=False) - 1  # last position of each class
    upper = cum[ends]  # cumulative weight at each class's end
    lower = torch.cat([cum.new_zeros(1), upper[:-1]])
    total = float(cum[-1])
    keys = []
    for start in range(0, draws, _CHUNK):
        n = min(_CHUNK, draws - start)
        src_pos = torch.searchsorted(cum, torch.rand(n, generator=g, dtype=torch.float64) * total).clamp_(max=nodes - 1)
        src = order[src_pos]
        c = y[src]
        inside = torch.rand(n, generator=g) < HOMOPHILY
        lo = torch.where(inside, lower[c], 0.0)
        hi = torch.where(inside, upper[c], total)
        u = lo + torch.rand(n, generator=g, dtype=torch.float64) * (hi - lo)
        dst = order[torch.searchsorted(cum, u).clamp_(max=nodes - 1)]
        del src_pos, c, inside, lo, hi, u
        keep = src != dst
        keys.append(src[keep] * nodes + dst[keep])
        del src, dst, keep
    relabel = torch.randperm(nodes, generator=g)  # node ids in random order, the edges' keys too
    key = torch.cat(keys)
    del keys
    key = relabel[key // nodes] * nodes + relabel[key % nodes]
    key = torch.unique(key)  # sorted: coalesced by (source, target)
    edge_index = torch.stack([key // nodes, key % nodes])
    del key
    new_y = torch.empty_like(y)
    new_y[relabel] = y
    centroids = torch.randn(CLASSES, FEATURES, generator=g) * SIGNAL
    x = centroids[new_y] + torch.randn(nodes, FEATURES, generator=g)
    return x, edge_index, new_y


def expected_edges(nodes: int) -> int:
    """The edges drawn for ``nodes`` (before self-loops and repeats are dropped)."""
    return round(nodes * EDGES_PER_NODE)


def _conv(name: str):
    def make(i: int, o: int, heads: int, concat: bool) -> torch.nn.Module:
        from torch_geometric.nn import GATConv, TransformerConv
        from tgattn import GraphAttentionConv

        if name in ("tgattn", SHARED):
            return GraphAttentionConv(i, o, heads, concat=concat, add_self_loops=True, root_weight=False,
                                      shared_projection=name == SHARED)
        return {"gat": GATConv, "transformer": TransformerConv}[name](i, o, heads=heads, concat=concat)
    return make


def network(conv: str) -> torch.nn.Module:
    """The two-layer network of ``conv`` (:class:`tgattn.bench.models.Net`): H = 4 heads of 16
    channels, ELU, then one head of 47 classes; dropout 0.6 on the features of both layers, none
    on the attention weights. ``tgattn``: ``GraphAttentionConv`` over the edges and self-loops
    without a root weight, as ``gat`` (``GATConv``, self-loops its default) attends;
    ``transformer``: ``TransformerConv`` with its defaults (root weight, no self-loops);
    ``tgattn_shared``: ``tgattn`` with one projection for queries, keys and values (GAT's single
    ``W``: a third of the projections' node memory).

    Example:
        >>> network("tgattn").conv1
        GraphAttentionConv(100, 16, heads=4)
    """
    from .models import Net

    if conv not in (*CONVS, SHARED):
        raise ValueError(f"unknown conv {conv!r}; choose from {[*CONVS, SHARED]}")
    return Net(_conv(conv), FEATURES, CLASSES, hidden=CHANNELS, heads=HEADS)


def _train_step(net, opt, x, edge_index, y, rows=None) -> float:
    import torch.nn.functional as F

    opt.zero_grad()
    out = net(x, edge_index)
    loss = F.cross_entropy(out if rows is None else out[:rows], y if rows is None else y[:rows])
    loss.backward()
    opt.step()
    return loss.item()


def full_point(conv: str, nodes: int, steps: int, seed: int = 0) -> dict:
    """One full-batch point, run in this process (the child of :func:`run_capped`): the graph,
    then ``steps`` training steps of ``conv``'s network on one thread; a failed allocation is
    reported, not raised.

    Example:
        >>> row = full_point("tgattn", 500, steps=2)
        >>> row["status"], row["steps"], row["peak_mb"] >= row["inputs_mb"]
        ('ok', 2, True)
    """
    import torch

    from .measure import failed_allocation, release_free_memory, reset_rss_high_water, rss_high_water_mb, rss_mb

    torch.set_num_threads(1)
    row = dict(conv=conv, nodes=nodes, edges=expected_edges(nodes), phase="inputs", steps=0)
    torch.manual_seed(seed)
    net = network(conv).train()
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    with torch.no_grad():  # imports and extension loads before the baseline
        net(torch.zeros(2, FEATURES), torch.tensor([[0], [1]]))
    try:
        x, edge_index, y = power_law_graph(nodes, seed)
        row["edges"] = edge_index.shape[1]
        release_free_memory()  # the generator's freed temporaries out of the resident set
        row["inputs_mb"] = round(rss_mb(), 1)
        reset_rss_high_water()
        row["phase"] = "step"
        torch.manual_seed(seed)
        losses, cpu, wall = [], [], []
        for step in range(steps):
            w0, c0 = time.perf_counter(), time.thread_time()
            losses.append(_train_step(net, opt, x, edge_index, y))
            cpu.append(time.thread_time() - c0)
            wall.append(time.perf_counter() - w0)
            row["steps"] = step + 1
            print(f"  {conv} N = {nodes:,}: step {step + 1} loss {losses[-1]:.4f}, {cpu[-1]:.2f} s", file=sys.stderr, flush=True)
        timed = slice(1, None) if steps > 1 else slice(None)  # the first step pays the one-off work
        row.update(status="ok", ms=round(1e3 * min(cpu[timed]), 1), wall_ms=round(1e3 * min(wall[timed]), 1),
                   loss_first=round(losses[0], 4), loss_last=round(losses[-1], 4))
    except (MemoryError, RuntimeError) as err:
        tried = failed_allocation(err)
        if tried is None:
            raise
        row.update(status="out of memory", tried_mb=round(tried / 2**20, 1) if tried else None,
                   note=" ".join(str(err).split())[:160] or type(err).__name__)
    row["peak_mb"] = round(rss_high_water_mb(), 1)
    if "inputs_mb" in row:
        row["step_mb"] = round(row["peak_mb"] - row["inputs_mb"], 1)
    return row


def fanout_batch(colptr: torch.Tensor, row: torch.Tensor, seeds: torch.Tensor, fanout: Sequence[int],
                 g: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(node_ids, edge_index)`` of one mini-batch: ``seeds`` first, then the sampled neighbours.

    Hop by hop, each frontier node keeps all of its in-neighbours when it has at most
    ``fanout[hop]`` of them, else ``fanout[hop]`` draws among them (with replacement, repeats
    dropped); ``colptr`` / ``row`` are the graph's CSC (the sources of node ``v``'s incoming edges
    are ``row[colptr[v]:colptr[v + 1]]``). ``edge_index`` holds the sampled edges in batch-local
    ids, source to target, as ``NeighborLoader`` gives them.

    Example:
        >>> import torch
        >>> colptr, row = torch.tensor([0, 2, 3, 4, 4]), torch.tensor([1, 2, 3, 0])  # 1->0, 2->0, 3->1, 0->2
        >>> nodes, edge_index = fanout_batch(colptr, row, torch.tensor([0]), [2, 1], torch.Generator().manual_seed(0))
        >>> nodes.tolist(), edge_index.tolist()
        ([0, 1, 2, 3], [[1, 2, 3, 0], [0, 0, 1, 2]])
    """
    import torch

    local = torch.full((colptr.shape[0] - 1,), -1, dtype=torch.long)  # global id -> batch id
    local[seeds] = torch.arange(len(seeds))
    nodes, frontier, srcs, dsts = [seeds], seeds, [], []
    for k in fanout:
        start = colptr[frontier]
        deg = colptr[frontier + 1] - start
        take = deg.clamp(max=k)
        owner = torch.repeat_interleave(torch.arange(len(frontier)), take)
        offset = torch.arange(len(owner)) - (torch.cumsum(take, 0) - take)[owner]
        drawn = (torch.rand(len(owner), generator=g) * deg[owner]).long()
        edge = start[owner] + torch.where(deg[owner] <= k, offset, drawn)
        pair = torch.unique(edge * len(frontier) + owner)  # repeats of a drawn edge dropped
        edge, owner = pair // len(frontier), pair % len(frontier)
        src = row[edge]
        found = torch.unique(src)
        fresh = found[local[found] < 0]
        local[fresh] = torch.arange(len(fresh)) + sum(len(t) for t in nodes)
        srcs.append(local[src])
        dsts.append(local[frontier[owner]])
        frontier = fresh
        nodes.append(fresh)
    return torch.cat(nodes), torch.stack([torch.cat(srcs), torch.cat(dsts)])


def _batches(x, edge_index, y, sampler: str, batch_size: int, fanout: Sequence[int], count: int, seed: int):
    """``count`` mini-batches ``(x, edge_index, y, seeds, seconds)`` (the ``seeds`` seed nodes first), from ``NeighborLoader`` or
    :func:`fanout_batch`; ``seconds``: the time the batch took to draw."""
    import torch

    nodes = y.shape[0]
    if sampler == "pyg":
        from torch_geometric.data import Data
        from torch_geometric.loader import NeighborLoader

        torch.manual_seed(seed)
        loader = NeighborLoader(Data(x=x, edge_index=edge_index, y=y), num_neighbors=list(fanout),
                                batch_size=batch_size, shuffle=True)
        it = iter(loader)
        for _ in range(count):
            t0 = time.perf_counter()
            batch = next(it)
            yield batch.x, batch.edge_index, batch.y, batch.batch_size, time.perf_counter() - t0
        return
    g = torch.Generator().manual_seed(seed)
    perm = torch.argsort(edge_index[1], stable=True)
    colptr = torch.zeros(nodes + 1, dtype=torch.long)
    colptr[1:] = torch.cumsum(torch.bincount(edge_index[1], minlength=nodes), 0)
    row = edge_index[0][perm]
    del perm
    order = torch.randperm(nodes, generator=g)
    for b in range(count):
        t0 = time.perf_counter()
        seeds = order[(b * batch_size) % nodes:][:batch_size]
        ids, local = fanout_batch(colptr, row, seeds, fanout, g)
        yield x[ids], local, y[ids], len(seeds), time.perf_counter() - t0


def minibatch_point(nodes: int, batches: int, batch_size: int, fanout: Sequence[int], sampler: str,
                    seed: int = 0, convs: Sequence[str] = CONVS, progress: bool = True) -> List[dict]:
    """Mini-batch training of ``convs`` on one graph, interleaved, one thread: a row per conv
    (``batches`` timed batches after one that warms up).

    Example:
        >>> rows = minibatch_point(2000, 4, 64, [5, 3], "own", progress=False)
        >>> [r["conv"] for r in rows], rows[0]["batches"]
        (['tgattn', 'gat', 'transformer'], 4)
    """
    import torch

    if sampler not in ("pyg", "own"):
        raise ValueError(f"sampler must be 'pyg' or 'own' (got {sampler!r})")
    torch.set_num_threads(1)
    x, edge_index, y = power_law_graph(nodes, seed)
    nets, opts = {}, {}
    for conv in convs:
        torch.manual_seed(seed)
        nets[conv] = network(conv).train()
        opts[conv] = torch.optim.Adam(nets[conv].parameters(), lr=0.01)
    cpu = {c: [] for c in convs}
    losses = {c: [] for c in convs}
    sample, sizes = [], []
    drawn = _batches(x, edge_index, y, sampler, batch_size, fanout, batches + 1, seed)
    for b, (bx, bei, by, seeded, seconds) in enumerate(drawn, start=-1):  # batch -1 warms up, untimed
        for conv in convs[b % len(convs):] + convs[:b % len(convs)]:  # the order rotates
            ei = bei.clone()  # a tensor no conv has seen: no analysis is shared between convs
            c0 = time.thread_time()
            loss = _train_step(nets[conv], opts[conv], bx, ei, by, rows=seeded)
            if b >= 0:
                cpu[conv].append(time.thread_time() - c0)
                losses[conv].append(loss)
        if b < 0:
            continue
        sample.append(seconds)
        sizes.append((bx.shape[0], bei.shape[1]))
        if progress:
            print(f"  batch {b + 1}/{batches}: {bx.shape[0]:,} nodes, {bei.shape[1]:,} edges; "
                  + ", ".join(f"{c} {1e3 * cpu[c][-1]:.0f} ms" for c in convs), file=sys.stderr, flush=True)
    tenth = max(1, batches // 10)
    rows = []
    for conv in convs:
        rows.append(dict(nodes=nodes, edges=edge_index.shape[1], conv=conv, sampler=sampler, batches=batches,
                         batch_size=batch_size, fanout=" ".join(map(str, fanout)),
                         steps_per_s=round(len(cpu[conv]) / sum(cpu[conv]), 3),
                         median_ms=round(1e3 * sorted(cpu[conv])[len(cpu[conv]) // 2], 2),
                         sample_ms=round(1e3 * sum(sample) / len(sample), 2),
                         batch_nodes=round(sum(s[0] for s in sizes) / len(sizes)),
                         batch_edges=round(sum(s[1] for s in sizes) / len(sizes)),
                         loss_first=round(sum(losses[conv][:tenth]) / tenth, 4),
                         loss_last=round(sum(losses[conv][-tenth:]) / tenth, 4)))
    if "gat" in convs:
        for r in rows:
            r["vs_gat"] = round(r["steps_per_s"] / rows[list(convs).index("gat")]["steps_per_s"], 3)
    return rows


def available_gb() -> float:
    """``MemAvailable`` of the machine in GB (Linux)."""
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) / 2**20 for line in f if line.startswith("MemAvailable:"))


def total_gb() -> float:
    """``MemTotal`` of the machine in GB (Linux)."""
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) / 2**20 for line in f if line.startswith("MemTotal:"))


def run_capped(call: str, args: dict, cap_gb: float, wait_s: float = 600) -> object:
    """``call(**args)`` (a function of this module) in a fresh Python process under a ``cap_gb``
    data-segment cap; returns its JSON result, or raises ``ChildProcessError`` with the child's
    exit status and last line of error output where it ended without one. It starts only once the machine has ``cap_gb``
    available (waiting up to ``wait_s`` seconds), so that the child can never push other work out."""
    from .measure import memory_capped

    waited = 0.0
    while available_gb() < cap_gb:
        if waited >= wait_s:
            raise OSError(f"the machine has {available_gb():.1f} GB available, under the --cap-gb of {cap_gb} GB, "
                          f"after {wait_s:.0f} s of waiting; lower --cap-gb or free memory")
        print(f"  waiting: {available_gb():.1f} GB available < cap {cap_gb} GB", file=sys.stderr, flush=True)
        time.sleep(30)
        waited += 30
    code = (f"import json, sys; from tgattn.bench import big_graphs as b; "
            f"print('RESULT ' + json.dumps(b.{call}(**json.loads(sys.argv[1]))))")
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
    child = subprocess.Popen([sys.executable, "-c", code, json.dumps(args)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env=env, text=True, preexec_fn=memory_capped(int(cap_gb * 2**30)))
    last = ""
    for line in child.stderr:  # the child's progress, passed on; its last line kept for a crash report
        sys.stderr.write(line)
        last = line.strip() or last
    found = [line[7:] for line in child.stdout.read().splitlines() if line.startswith("RESULT ")]
    if child.wait() or not found:
        raise ChildProcessError(f"exit status {child.returncode}: {last[:200]}")
    return json.loads(found[-1])


def full_sweep(sizes: Sequence[int], convs: Sequence[str], steps: int, cap_gb: float, seed: int, out: Path) -> List[dict]:
    """:func:`full_point` for each size (ascending) and conv, each in a fresh capped process."""
    from .report import write_csv

    rows: List[dict] = []
    failed = set()
    for nodes in sorted(sizes):
        fitted = False
        for conv in convs:
            if conv in failed:
                built = [r["edges"] for r in rows if r["nodes"] == nodes and r.get("phase") == "step"]
                rows.append(dict(conv=conv, nodes=nodes, edges=built[0] if built else expected_edges(nodes),
                                 status="not run", note="out of memory at a smaller size", cap_gb=cap_gb))
                write_csv(rows, out / "full.csv", FULL_FIELDS)
                continue
            t0 = time.perf_counter()
            try:
                row = run_capped("full_point", dict(conv=conv, nodes=nodes, steps=steps, seed=seed), cap_gb)
            except ChildProcessError as err:  # killed or crashed: no report of its own
                row = dict(conv=conv, nodes=nodes, edges=expected_edges(nodes), status="crashed", note=str(err))
            row["cap_gb"] = cap_gb
            rows.append(row)
            fitted |= row.get("phase") == "step"
            if row["status"] != "ok":
                failed.add(conv)
            detail = (f"{row['ms'] / 1e3:.2f} s/step, peak {row['peak_mb']:,.0f} MB (step {row['step_mb']:,.0f} MB), "
                      f"loss {row['loss_first']} -> {row['loss_last']}" if row["status"] == "ok" else
                      f"{row['status']} in {row.get('phase')}, tried {row.get('tried_mb')} MB, peak {row.get('peak_mb')} MB")
            print(f"N = {nodes:,}, E = {row['edges']:,}, {conv}: {detail} [{time.perf_counter() - t0:.0f} s]", flush=True)
            write_csv(rows, out / "full.csv", FULL_FIELDS)
        if not fitted:
            print(f"N = {nodes:,}: the inputs do not fit under the cap; larger sizes are not run", flush=True)
            break
    return rows


def full_summary(rows: List[dict]) -> str:
    """The full-batch table, and its targets where tgattn and both peers ran."""
    from .report import verdict

    lines = ["| nodes | edges | conv | status | peak MB | step MB | s / step | loss first -> last |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ok = r["status"] == "ok"
        tried = f" (tried {float(r['tried_mb']):,.0f} MB)" if r.get("tried_mb") not in (None, "") else ""
        lines.append(f"| {int(r['nodes']):,} | {int(r['edges']):,} | {r['conv']} | {r['status']}{tried} "
                     f"| {_num(r.get('peak_mb'))} | {_num(r.get('step_mb'))} | {_num(r.get('ms'), 1e-3, '.2f')} "
                     f"| {_losses(r) if ok else ''} |")
    by = {(int(r["nodes"]), r["conv"]): r for r in rows}
    sizes = sorted({int(r["nodes"]) for r in rows})
    fits = [n for n in sizes if any(r.get("phase") == "step" for r in rows if int(r["nodes"]) == n)]
    ok = lambda n, c: by.get((n, c), {}).get("status") == "ok"  # noqa: E731
    if not set(CONVS) <= {r["conv"] for r in rows}:  # the targets compare all three
        return "\n".join(lines)
    if fits:
        n = fits[-1]
        met = ok(n, "tgattn") and not ok(n, "gat") and not ok(n, "transformer")
        lines.append(f"\nLargest size whose inputs fit: N = {n:,}: tgattn {by.get((n, 'tgattn'), {}).get('status')}, "
                     f"GATConv {by.get((n, 'gat'), {}).get('status')}, TransformerConv "
                     f"{by.get((n, 'transformer'), {}).get('status')}: {'met' if met else 'NOT met'}"
                     + (f" ({SHARED}: {by[(n, SHARED)]['status']})" if (n, SHARED) in by else ""))
    trained = [n for n in sizes if ok(n, "tgattn")]
    if trained:
        n = trained[-1]
        first_out = {peer: next((m for m in sizes if by.get((m, peer), {}).get("status") == "out of memory"), None)
                     for peer in ("gat", "transformer")}
        lines.append(f"Largest size tgattn trains: N = {n:,}, E = {int(by[(n, 'tgattn')]['edges']):,}; GATConv out of "
                     f"memory from N = {_size(first_out['gat'])}, TransformerConv from N = {_size(first_out['transformer'])}")
    both = [n for n in sizes if ok(n, "gat") and ok(n, "transformer") and ok(n, "tgattn")]
    if both:
        n = both[-1]
        mine = by[(n, "tgattn")]
        for peer, name in (("gat", "GATConv"), ("transformer", "TransformerConv")):
            m = float(mine["step_mb"]) / float(by[(n, peer)]["step_mb"])
            total = float(mine["peak_mb"]) / float(by[(n, peer)]["peak_mb"])
            lines.append(f"Largest size both peers fit, N = {n:,}: step memory tgattn / {name} = {m:.2f}x (<= 0.5) "
                         f"{verdict(m, lambda v: v <= 0.5)} (whole process peak {total:.2f}x)")
        t = float(mine["ms"]) / float(by[(n, "gat")]["ms"])
        lines.append(f"Step time tgattn / GATConv at N = {n:,}: {t:.2f}x (<= 1.0) {verdict(t, lambda v: v <= 1.0)}")
    return "\n".join(lines)


def _size(n: Optional[int]) -> str:
    return "-" if n is None else f"{n:,}"


def _losses(r: dict) -> str:
    return f"{r['loss_first']} -> {r['loss_last']}"


def _num(value, scale: float = 1.0, fmt: str = ",.0f") -> str:
    return "" if value in (None, "") else format(float(value) * scale, fmt)


def mini_summary(rows: List[dict]) -> str:
    """The mini-batch table and its target."""
    from .report import verdict

    r0 = rows[0]
    lines = [f"N = {int(r0['nodes']):,}, E = {int(r0['edges']):,}, {r0['sampler']} sampler, fan-out {r0['fanout']}, "
             f"batch {r0['batch_size']}, {r0['batches']} batches (mean {int(r0['batch_nodes']):,} nodes, "
             f"{int(r0['batch_edges']):,} edges; sampling {float(r0['sample_ms']):.0f} ms a batch, left out)",
             "| conv | steps / s | vs GATConv | median ms | loss first -> last tenth |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['conv']} | {float(r['steps_per_s']):.2f} | {_num(r.get('vs_gat'), 1, '.2f')} "
                     f"| {float(r['median_ms']):.1f} | {r['loss_first']} -> {r['loss_last']} |")
    mine = next((r for r in rows if r["conv"] == "tgattn"), None)
    if mine and mine.get("vs_gat") not in (None, ""):
        v = float(mine["vs_gat"])
        lines.append(f"\nMini-batch steps per second tgattn / GATConv = {v:.2f}x (>= 1.0) {verdict(v, lambda x: x >= 1.0)}")
    return "\n".join(lines)


def plot(rows: List[dict], path: Path, cap_gb: float) -> None:
    """Peak memory and step time against edges, one line per conv; a cross where a conv ran out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem, sec) = plt.subplots(1, 2, figsize=(10, 4))
    names = {"tgattn": "tgattn GraphAttentionConv", "gat": "GATConv", "transformer": "TransformerConv",
             SHARED: "tgattn, shared projection"}
    for i, conv in enumerate(c for c in names if any(r["conv"] == c for r in rows)):
        color = f"C{i}"
        good = [r for r in rows if r["conv"] == conv and r["status"] == "ok"]
        bad = [r for r in rows if r["conv"] == conv and r["status"] in ("out of memory", "crashed")]
        mem.plot([int(r["edges"]) for r in good], [float(r["peak_mb"]) / 1024 for r in good], "o-", color=color,
                 label=names[conv])
        sec.plot([int(r["edges"]) for r in good], [float(r["ms"]) / 1e3 for r in good], "o-", color=color, label=names[conv])
        mem.plot([int(r["edges"]) for r in bad], [cap_gb] * len(bad), "x", color=color, markersize=10,
                 label=f"{names[conv]}: out of memory" if bad else None)
    mem.axhline(cap_gb, color="black", linewidth=0.8, linestyle="--")
    mem.set(xscale="log", yscale="log", xlabel="edges", ylabel="peak resident set (GB)",
            title=f"full-batch train step, cap {cap_gb:g} GB")
    sec.set(xlabel="edges", ylabel="s per step (1 thread, CPU time)", title="step time")
    if any(r["status"] == "ok" for r in rows):
        sec.set(xscale="log", yscale="log")
    mem.legend(fontsize=7)
    sec.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="python -m tgattn.bench.big_graphs", description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", nargs="+", default=["full", "minibatch"], choices=["full", "minibatch"])
    parser.add_argument("--nodes", nargs="+", type=positive_int, default=list(SIZES),
                        help="full-batch graph sizes (default: ogbn-products' 2,449,029 nodes / 64, / 32, ..., / 1)")
    parser.add_argument("--convs", nargs="+", default=list(CONVS), choices=[*CONVS, SHARED],
                        help=f"default: {' '.join(CONVS)}; {SHARED}: tgattn with one projection for q, k, v")
    parser.add_argument("--steps", type=positive_int, default=3, help="full-batch training steps per point (default: 3)")
    parser.add_argument("--cap-gb", type=positive_float, default=None,
                        help="memory cap of each child process in GB (RLIMIT_DATA; default: the machine's total memory)")
    parser.add_argument("--minibatch-nodes", type=positive_int, default=PRODUCTS_NODES,
                        help="graph size of the mini-batch run (default: 2,449,029)")
    parser.add_argument("--batches", type=positive_int, default=60, help="mini-batches, each trains every conv (default: 60)")
    parser.add_argument("--batch-size", type=positive_int, default=1024)
    parser.add_argument("--fanout", nargs="+", type=positive_int, default=[15, 10])
    parser.add_argument("--sampler", choices=["pyg", "own"], default=None,
                        help="NeighborLoader (pyg; needs torch-sparse or pyg-lib) or fanout_batch (own); "
                             "default: pyg where it can sample, else own")
    parser.add_argument("--seed", type=seed_int, default=0)
    parser.add_argument("--out", type=Path, default=runs_dir("big_graphs"), help=out_help("big_graphs"))
    args = parser.parse_args(argv)
    if min(args.nodes) < CLASSES or args.minibatch_nodes < CLASSES:
        smallest = min(args.nodes + [args.minibatch_nodes])
        parser.error(f"--nodes / --minibatch-nodes: at least {CLASSES}, one node per class (got {smallest})")
    if args.cap_gb is None:
        args.cap_gb = round(total_gb(), 1)
    import torch_geometric.typing as pyg_typing

    can_sample = pyg_typing.WITH_PYG_LIB or pyg_typing.WITH_TORCH_SPARSE
    if args.sampler is None:
        args.sampler = "pyg" if can_sample else "own"
    elif args.sampler == "pyg" and not can_sample and "minibatch" in args.parts:
        parser.error('--sampler pyg: NeighborLoader needs torch-sparse or pyg-lib (pip install "tgattn[sampling]"); '
                     "--sampler own draws the same kind of batch without them")
    return run(parser, _bench, args)


def _bench(args) -> int:
    import torch

    from .report import write_csv

    args.out.mkdir(parents=True, exist_ok=True)
    print(f"torch {torch.__version__}, {platform.machine()}, one thread; cap {args.cap_gb} GB per child "
          f"(RLIMIT_DATA); {available_gb():.1f} of {total_gb():.1f} GB available; load average {os.getloadavg()[0]:.1f}",
          flush=True)
    written = []
    if "full" in args.parts:
        start = time.perf_counter()
        rows = full_sweep(args.nodes, args.convs, args.steps, args.cap_gb, args.seed, args.out)
        written += _summary(args.out / "full", full_summary(rows), start)
        try:
            plot(rows, args.out / "full.png", args.cap_gb)
            written.append(args.out / "full.png")
        except ImportError:
            print('(no plot: pip install "tgattn[plot]")')
    if "minibatch" in args.parts:
        start = time.perf_counter()
        print(f"mini-batches: N = {args.minibatch_nodes:,}, {args.sampler} sampler", flush=True)
        try:
            rows = run_capped("minibatch_point", dict(nodes=args.minibatch_nodes, batches=args.batches,
                                                      batch_size=args.batch_size, fanout=args.fanout,
                                                      sampler=args.sampler, seed=args.seed, convs=args.convs), args.cap_gb)
        except ChildProcessError as err:
            raise OSError(f"the mini-batch run ended without a report under the {args.cap_gb} GB cap ({err})") from None
        for r in rows:
            r["cap_gb"] = args.cap_gb
        write_csv(rows, args.out / "minibatch.csv", MINI_FIELDS)
        written += _summary(args.out / "minibatch", mini_summary(rows), start)
    print(f"wrote {', '.join(map(str, written))}")
    return 0


def _summary(stem: Path, text: str, start: float) -> List[Path]:
    """Print ``text`` with the part's wall time and write it to ``stem.md``; the files written."""
    text += f"\n\ntotal {time.perf_counter() - start:.0f} s\n"
    print(text)
    stem.with_suffix(".md").write_text(text)
    return [stem.with_suffix(".csv"), stem.with_suffix(".md")]


if __name__ == "__main__":
    sys.exit(main())
