"""The GPU benchmark: ``python -m tgattn.bench.gpu`` (``python -m tgattn.bench --device cuda`` runs
the same sweep and GNN steps, without the packed sets and the varlen peer).

The attention sweep itself is :func:`tgattn.bench.attention.sweep` with ``device="cuda"`` (peers
from :data:`tgattn.bench.peers.GPU_PEERS`). This module adds

* :func:`gnn_steps`: one training step (forward, backward, Adam) of the GAT paper's two-layer
  network with ``GATConv``, ``TransformerConv`` and tgattn's ``GraphAttentionConv``, on Cora and
  on molecule-sized batches that bring a new edge set every step;
* :mod:`tgattn.bench.gpu.packed`: packed sequences (block-diagonal causal and
  full sets of document lengths) and FlashAttention's variable-length kernel
  (``torch.nn.attention.varlen``) against tgattn, both in bfloat16 (the kernel runs half
  precision only), on the packed sets and on sliding windows;
* :func:`gpu_targets`: the issue's GPU targets, each with the ratio this run measured ("Flex":
  the faster of the ``flex`` and ``flex_csr`` peers);
* :func:`main`: all of it, CSV files and a plot named by the device. ``--dry-run`` runs the
  same code on the CPU at a tiny size (what CI checks): every GPU peer is built or says why
  it cannot run here. ``--dtype`` (float32 by default; the issue's GPU targets are stated in
  bfloat16) is the dtype of every peer's q, k, v in the sweep, recorded in the CSV's ``dtype``
  column; ``--patterns`` picks among :data:`PATTERNS` (all by default).

Example::

    python -m tgattn.bench.gpu                           # on a CUDA machine
    python -m tgattn.bench.gpu --dry-run --out /tmp/gpu  # anywhere, in seconds
    python -m tgattn.bench.gpu --dtype bfloat16 --patterns window64 random0.01  # the targets' dtype

The GPU suite, ``--suite``: the first thing to run whenever a GPU is at hand (issues 50 and 56's
targets and issue 49's GPU case, in bfloat16, within ``--budget-s``, 450 s by default: 8 minutes
on an H100 or H200 with the start). First the tile kernels' launch-option sweep
(``tgattn.bench.gpu.tune``, within 100 s, its table then taken by ``tc``
for the rest of the run; ``--no-tune`` and a dry run skip it), then
every case of :mod:`tgattn.bench.gpu.cases` (sliding windows 64 and 256, packed documents,
block-local, BigBird at 16k-128k tokens; causal at 16k-64k, without an edge list past 16k;
random and top-k 1 % at 16k and 64k; indexer top-k on grouped-query heads; GNN-sized sets),
forward and forward + backward: the share of edges on tensor cores (the ``tc`` backend's plan;
a band's from its rows' key ranges), the ``tc`` path's time beside the cost model's prediction
and roofline (``tile_cost.predict``), and its ratio to every peer of
:mod:`tgattn.bench.gpu.peers` (compiled FlexAttention with its own ``mask_mod`` and with the edge
set's BlockMask, each with and without its mask creation; the same on Flex's CuTe /
FlashAttention-4 backend, block-sparse and on all pairs, where this torch has it; SDPA with a
boolean mask; dense SDPA without one; the gather path), then the molecule training step against
GATConv, with a new edge set each step and with CUDA graphs over a fixed batch
(:mod:`tgattn.bench.gpu.steps`). It writes ``suite_attention.csv``, ``suite_cases.csv`` (after
every case), ``suite_steps.csv`` and ``suite.png`` under ``--out`` and prints the summary and the
targets; what did not run says why in its row. A time guard skips, with a note, what the budget
left cannot hold. ``--dry-run`` runs it on the CPU (tgattn's Triton paths through Triton's
interpreter), ``--cases`` picks cases, ``--flex-static`` compiles Flex per size.

The recipe on the device machine (the ``run`` verb; ``data/gpu/README.md`` says more). Nothing
needs to travel: the machine's image has torch, triton, torch_geometric, networkx, scipy, tqdm
and matplotlib (no carry, no wheels). One call, ``timeout_s`` 540, kind left out::

    set -o pipefail; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/suite.log;
    PYTHONUNBUFFERED=1 TGATTN_NO_FUSED=1 python3 -m tgattn.bench.gpu --suite --no-progress --out $OUT 2>&1 | tee -a $OUT/suite.log

The four files, the log and the sweep's two tables come back under the reply's ``files_at``;
commit them to ``data/gpu`` named by the card (``h200_suite/``). That leaves about 4 of the session's 15 minutes on the warm
machine for a rerun of some cases: ``--cases ... --budget-s 180`` with ``timeout_s`` 240. Flex's
FA4 backend needs ``flash-attn-4`` and its CuTe libraries, which the image lacks and one call
cannot carry (92 MB): ``data/gpu/README.md`` says how they travel in two calls.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path
from typing import List, Optional

import torch

from .cases import SIZES as SUITE_SIZES
from .packed import PACKED_LENGTHS, packed_patterns, varlen_rows, varlen_table
from .steps import train_steps
from ..report import FIELDS, SINGLE_REPEAT_NOTE, _index, _ratio, verdict

GNN_MODELS = ("gat", "transformer", "tgattn")
GNN_FIELDS = ("workload", "model", "nodes", "edges", "ms", "note")
DRY_RUN_N = 128  # every pattern's size in a dry run (documents of 16-64 tokens)
CSV_FIELDS = FIELDS + ("device", "dtype")
PATTERNS = ("window64", "random0.01", "topk0.01", "packed_causal", "packed_full")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SUITE_CASES = tuple(SUITE_SIZES)
BUDGET_S = 450.0  # the suite's default budget: done within 8 minutes of an H100 or H200 with the start and the plot
STEPS_RESERVE_S = 100.0  # of the budget, kept for the molecule steps after the attention cases


def check_device(device: str) -> torch.device:
    """The ``torch.device`` for ``device``; a ``ValueError`` naming the reason when it cannot run.

    Example:
        >>> check_device("cpu")
        device(type='cpu')
    """
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"--device {device}: torch.cuda.is_available() is False (torch {torch.__version__}); "
            "run on a machine with a CUDA GPU and a CUDA build of torch"
        )
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu or cuda (got {device!r})")
    return dev


def gnn_steps(device, *, cora=None, repeats: int = 20, workloads=("cora", "molecules"), graphs: int = 128) -> List[dict]:
    """One training step per (workload, model): Cora (GAT protocol) and batches of ``graphs``
    molecules, the models interleaved step by step (:func:`~tgattn.bench.gpu.steps.train_steps`).

    Molecule batches bring a new edge set every step (each is analysed on its first and only
    use); Cora's edge set is analysed once. The ``cora`` workload needs ``cora``, the data set
    as :func:`tgattn.datasets.load_planetoid` returns it, loaded by the caller before any work
    (so that a missing data set fails first).
    """
    from ..models import MODELS, Net, build_model, molecule_batches, prepare

    rows = []
    if "cora" in workloads:
        if cora is None:
            raise ValueError("the cora workload needs cora=load_planetoid('Cora')")
        data = prepare(cora).to(device)
        nets = {model: build_model(model, data, "Cora").to(device) for model in GNN_MODELS}
        ms = train_steps(nets, [(data.x, data.edge_index, data.y, data.train_mask)] * (repeats + 1), device, repeats)
        rows += [dict(workload="cora", model=model, nodes=data.num_nodes, edges=data.num_edges, ms=ms[model])
                 for model in GNN_MODELS]
    if "molecules" in workloads:
        nets = {model: Net(MODELS[model], 64, 16, hidden=16, heads=4).to(device) for model in GNN_MODELS}
        batches = [(x.to(device), ei.to(device), y.to(device), slice(None)) for x, ei, y in molecule_batches(repeats + 1, graphs=graphs)]
        ms = train_steps(nets, batches, device, repeats)
        rows += [dict(workload="molecules", model=model, nodes=batches[0][0].shape[0], edges=batches[0][1].shape[1],
                      ms=ms[model]) for model in GNN_MODELS]
    return rows


def gpu_targets(rows: List[dict], gnn: Optional[List[dict]] = None, window: str = "window64", *, verdicts: bool = True) -> str:
    """The issue's GPU targets, each with its measured ratio (``n/a`` when not in this run).

    ``verdicts=False`` (a single timed repeat) prints the ratios without ``met`` / ``NOT met``.
    """
    idx = _index(rows)
    out = [] if verdicts else [SINGLE_REPEAT_NOTE]

    def line(text, value, ok):
        shown = "n/a" if value is None else f"{value:.2f}x"
        out.append(f"{text:<62} {shown:>12}  {verdict(value, ok, verdicts)}".rstrip())

    def flex(pattern, n, mode):  # the faster FlexAttention variant (pattern mask_mod or CSR BlockMask)
        ratios = [r for r in (_ratio(idx, pattern, n, mode, p) for p in ("flex", "flex_csr")) if r is not None]
        return min(ratios) if ratios else None

    for n in sorted({r["n"] for r in rows if r["pattern"] == window and r["n"] <= 131072}):
        line(f"{window} n={n} fwd+bwd: SDPA masked / tgattn >= 5", _ratio(idx, window, n, "fwd+bwd", "sdpa_mask"), lambda r: r >= 5)
        line(f"{window} n={n} fwd+bwd: Flex / tgattn >= 1", flex(window, n, "fwd+bwd"), lambda r: r >= 1)
    for pattern in sorted({r["pattern"] for r in rows if r["pattern"].startswith(("random", "topk"))}):
        for n in sorted({r["n"] for r in rows if r["pattern"] == pattern}):
            for mode in ("fwd", "fwd+bwd"):
                line(f"{pattern} n={n} {mode}: SDPA masked / tgattn >= 10", _ratio(idx, pattern, n, mode, "sdpa_mask"), lambda r: r >= 10)
                line(f"{pattern} n={n} {mode}: Flex / tgattn >= 2", flex(pattern, n, mode), lambda r: r >= 2)
    for workload in sorted({r["workload"] for r in gnn or ()}):
        step = {r["model"]: r.get("ms") for r in gnn if r["workload"] == workload}
        ratio = step["tgattn"] / step["gat"] if step.get("tgattn") and step.get("gat") else None
        line(f"GNN {workload} train step: tgattn / GATConv <= 1", ratio, lambda r: r <= 1)
    big = idx.get((window, 1 << 20, "fwd+bwd", "tgattn"))
    if big and big["ms"]:
        peak = f", peak extra {big['peak_mb']:.0f} MB" if big["peak_mb"] else ""
        out.append(f"{window} n=1048576 fwd+bwd completes: {big['ms'] / 1e3:.2f} s{peak}")
    return "\n".join(out)


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's for a dry run."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {platform.processor() or platform.machine()} (dry run)"


def main(argv=None) -> int:
    from ..._cli import missing_plot_extra, out_help, positive_float, positive_int, run, runs_dir

    start = time.perf_counter()

    parser = argparse.ArgumentParser(allow_abbrev=False, prog="python -m tgattn.bench.gpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="the same code on the CPU at a tiny size (seconds)")
    parser.add_argument("--out", type=Path, default=runs_dir("gpu"), help=out_help("gpu"))
    parser.add_argument("--no-flex", action="store_true", help="skip compiled FlexAttention (off in a dry run)")
    parser.add_argument("--no-gnn", action="store_true", help="skip the GNN training steps")
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed runs per measurement (minimum is kept)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                        help="dtype of q, k, v in the sweep, every peer alike (default: float32; --suite: bfloat16)")
    parser.add_argument("--patterns", nargs="+", choices=PATTERNS, default=list(PATTERNS), metavar="PATTERN",
                        help=f"patterns to run, among {', '.join(PATTERNS)} (default: all)")
    parser.add_argument("--data", default=None, help="data folder for Cora (default: TGATTN_DATA or a download)")
    parser.add_argument("--tune", action="store_true",
                        help="sweep the tc tile kernels' tile shapes, warps and stages on this card instead (tgattn.bench.gpu.tune)")
    suite = parser.add_argument_group("the GPU suite (--suite)")
    suite.add_argument("--suite", action="store_true", help="run the suite instead of the sweep (see the recipe above)")
    suite.add_argument("--cases", nargs="+", choices=SUITE_CASES, default=list(SUITE_CASES), metavar="CASE",
                       help=f"cases to run, among {', '.join(SUITE_CASES)} (default: all)".replace("%", "%%"))
    suite.add_argument("--budget-s", type=positive_float, default=BUDGET_S,
                       help=f"seconds the suite may take, from the command's start (default: {BUDGET_S:g})")
    suite.add_argument("--flex-static", action="store_true",
                       help="compile FlexAttention for each size (default: once per mask_mod, dynamic shapes)")
    suite.add_argument("--no-tune", action="store_true",
                       help="skip the tile kernels' launch-option sweep (tgattn.bench.gpu.tune; the suite runs it first)")
    args = parser.parse_args(argv)
    if (args.suite or args.tune) and args.dry_run and "triton" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # tgattn's Triton paths run on the CPU through the interpreter
    try:
        device = check_device("cpu" if args.dry_run else "cuda")
    except ValueError as err:
        parser.error(f"{err} (or pass --dry-run)")
    if missing_plot_extra():
        parser.error(missing_plot_extra())
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        parser.error(f"--out: cannot create the folder {str(args.out)!r} ({err.strerror or err})")
    args.start = start
    return run(parser, lambda args: (_tune if args.tune else _suite if args.suite else _bench)(args, device), args)


def _tune(args, device) -> int:
    from .tune import tune

    sweep, table = tune(args.out, dry_run=args.dry_run, budget_s=min(args.budget_s, 240.0))
    print(f"{len(sweep)} timings, {len(table)} table rows: {args.out / 'tile_sweep.csv'}, {args.out / 'tile_configs.csv'}")
    return 0


def _bench(args: argparse.Namespace, device: torch.device) -> int:
    from ...datasets import load_planetoid
    from ..attention import sizes_for, sweep
    from ..patterns import patterns
    from ..peers import GPU_PEERS
    from ..report import plot, ratio_table, write_csv

    workloads = ("molecules",) if args.dry_run else ("cora", "molecules")
    # the data set first: a missing one is one line (_cli.run) before any work
    cora = load_planetoid("Cora", args.data) if "cora" in workloads and not args.no_gnn else None
    where = device_name(device)

    wanted = [n for n in PATTERNS if n in args.patterns]  # in PATTERNS' order, each once
    names = [n for n in wanted if not n.startswith("packed_")]
    packed = packed_patterns((16, 64) if args.dry_run else PACKED_LENGTHS)
    chosen = {n: patterns()[n] if n in names else packed[n] for n in wanted}
    sizes = {n: [DRY_RUN_N] for n in chosen} if args.dry_run else {**sizes_for(names, False, device="cuda"),
                                                              **{n: [16384, 65536] for n in wanted if n in packed}}
    peers = [p for p in GPU_PEERS if not ((args.no_flex or args.dry_run) and p in ("flex", "flex_csr"))]
    repeats = 1 if args.dry_run else args.repeats
    dtype = args.dtype or "float32"
    rows = sweep(chosen, sizes, peers, repeats=repeats, progress=not args.no_progress, device=str(device),
                 dtype=DTYPES[dtype])
    bf16 = varlen_rows(chosen, sizes, device, repeats=repeats)
    for row in rows:
        row["device"], row["dtype"] = where, dtype
    for row in bf16:
        row["device"], row["dtype"] = where, "bfloat16"  # the varlen kernel runs half precision only
    write_csv(rows + bf16, args.out / "gpu_attention.csv", fields=CSV_FIELDS)
    plot(rows + bf16, args.out / "gpu_attention.png", device=where, dtype=dtype)
    print(f"torch {torch.__version__}, {where}; H=8, d=64, {dtype} (bf16 where named); "
          "ratio = peer time / tgattn time")
    print(ratio_table(rows, peers))
    print()
    print(varlen_table(bf16))
    print()
    gnn = []
    if not args.no_gnn:
        gnn = gnn_steps(device, cora=cora, repeats=1 if args.dry_run else 20, workloads=workloads,
                        graphs=4 if args.dry_run else 128)
        for row in gnn:
            row["device"] = where
        write_csv(gnn, args.out / "gpu_gnn.csv", fields=GNN_FIELDS + ("device",))
    if args.dry_run:
        print("dry run: the target lines below show the report works, not GPU numbers")
    print(gpu_targets(rows, gnn, verdicts=repeats > 1))
    print(f"\nwrote {args.out / 'gpu_attention.csv'}, {args.out / 'gpu_attention.png'}" + (f", {args.out / 'gpu_gnn.csv'}" if gnn else ""))
    return 0


def _suite(args: argparse.Namespace, device: torch.device) -> int:
    """The GPU suite (``--suite``): attention cases, then the molecule steps, CSVs and a plot."""
    from .cases import suite_cases
    from .peers import FLEX_PEERS, SUITE_PEERS
    from .steps import STEP_FIELDS, molecule_steps
    from .launch import tune_sweep
    from .suite import Clock, attention_suite
    from .summary import ATTENTION_FIELDS, CASE_FIELDS, plot_rows, steps_table, suite_targets, summary
    from ..report import plot, write_csv

    clock, where, dtype = Clock(args.budget_s, start=args.start), device_name(device), args.dtype or "bfloat16"
    peers = [p for p in SUITE_PEERS if not (args.no_flex and p in FLEX_PEERS)]
    repeats = 0 if args.dry_run else args.repeats
    written = [args.out / "suite_attention.csv", args.out / "suite_cases.csv"]
    reserve = 0.0 if args.no_gnn else STEPS_RESERVE_S
    tuned, tune_note = ([], "not run: --no-tune") if args.no_tune else tune_sweep(
        device, clock, args.out, dry_run=args.dry_run, reserve=reserve)  # first: the tc rows then run tuned kernels
    print(f"launch-option sweep: {tune_note}", flush=True)

    def write_tables(rows: List[dict], cases: List[dict]) -> None:  # after every case: a crash keeps what ran
        write_csv(rows, written[0], ATTENTION_FIELDS)
        write_csv(cases, written[1], CASE_FIELDS)

    rows, cases = attention_suite(suite_cases(args.cases, dry_run=args.dry_run), peers, device=device, dtype=DTYPES[dtype],
                                  device_name=where, repeats=repeats, clock=clock,
                                  reserve=reserve, static_flex=args.flex_static,
                                  progress=not args.no_progress, on_case=write_tables)
    write_tables(rows, cases)
    drawn = plot_rows(rows, cases)
    if drawn:  # none where the budget skipped every case
        written.append(args.out / "suite.png")
        plot(drawn, written[-1], device=where, dtype=dtype)
    steps = [] if args.no_gnn else molecule_steps(device, clock, graphs=4 if args.dry_run else 128,
                                                  rounds=1 if args.dry_run else 20)
    for row in steps:
        row["device"] = where
    if steps:
        written.append(args.out / "suite_steps.csv")
        write_csv(steps, written[-1], STEP_FIELDS)
    print(f"torch {torch.__version__}, {where}; {dtype}; {time.perf_counter() - args.start:.0f} s of a {args.budget_s:g} s "
          "budget; ratio = peer time / tc time (> 1: the tensor-core path is faster), +mask: each side's setup for a "
          "new edge set added")
    print(summary(cases))
    if steps:
        print()
        print(steps_table(steps))
    print()
    if args.dry_run:
        print("dry run: the target lines below show the report works, not GPU numbers")
    print(suite_targets(cases, steps, verdicts=repeats > 1))
    print(f"\nwrote {', '.join(map(str, written))}")
    return 0
