"""``python -m tgattn.bench``: tgattn's attention engine against its peers, side by side.

Examples::

    python -m tgattn.bench --quick                 # about a minute: n = 128, 256, no FlexAttention
    python -m tgattn.bench                         # the full sweep (tens of minutes on 2 cores)
    python -m tgattn.bench --patterns window64 --sizes 4096
    python -m tgattn.bench --device cuda           # GPU peers, window 16k-1M, random / top-k 1 %, GNN steps

Writes ``<out>/attention[_quick].csv`` and ``.png`` (``--out`` defaults to a folder outside the
checkout: ``$TGATTN_RUNS/bench``, else ``~/.cache/tgattn/runs/bench``) and prints the ratio table
(peer time / tgattn time: above 1 = tgattn faster) and the targets; a single timed repeat
(``--quick`` or ``--repeats 1``) prints the measured values without judging them.
"""
from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from .._cli import device_name, missing_plot_extra, out_help, positive_int, run, runs_dir
from .peers import CPU_PEERS, GPU_PEERS, PEERS

if TYPE_CHECKING:
    import torch

GPU_PATTERNS = ("window64", "random0.01", "topk0.01")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="python -m tgattn.bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes and few patterns (about a minute)")
    parser.add_argument("--patterns", nargs="+", help="pattern names (default: all; see --list)")
    parser.add_argument("--sizes", nargs="+", type=positive_int, help="sequence lengths (default: per pattern)")
    parser.add_argument("--peers", nargs="+", default=None, choices=PEERS, help="implementations to compare")
    parser.add_argument("--no-flex", action="store_true", help="skip compiled FlexAttention (its compile takes minutes)")
    parser.add_argument("--threads", type=positive_int, default=2, help="torch threads (default: 2)")
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed runs per measurement, minimum kept (default: 3; --quick: 1)")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory probe")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--out", type=Path, default=runs_dir("bench"), help=out_help("bench"))
    parser.add_argument("--name", default=None, help="output file stem (default: attention, attention_quick)")
    parser.add_argument("--list", action="store_true", help="list the patterns and exit")
    parser.add_argument("--device", type=device_name, default="cpu",
                        help="cpu (default) or cuda (cuda:N): GPU peers, sizes and GNN steps")
    parser.add_argument("--no-gnn", action="store_true", help="on CUDA: skip the GNN training steps")
    parser.add_argument("--data", default=None, help="data folder for Cora (default: TGATTN_DATA or a download)")
    args = parser.parse_args(argv)
    # imported once the arguments parse: --help and argument errors answer without torch
    from .gpu.command import check_device
    from .patterns import patterns

    try:
        device = check_device(args.device)
    except ValueError as err:
        parser.error(str(err))
    cuda = device.type == "cuda"

    available = patterns()
    if args.list:
        print("\n".join(available))
        return 0
    default = list(GPU_PATTERNS) if cuda else ["causal", "window64", "random0.05"] if args.quick else list(available)
    names = args.patterns or default
    unknown = [n for n in names if n not in available]
    if unknown:
        parser.error(f"unknown pattern(s) {unknown}; choose from {list(available)}")
    if missing_plot_extra():  # the plot comes after the whole sweep: say so before it
        parser.error(missing_plot_extra())
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        parser.error(f"--out: cannot create the folder {str(args.out)!r} ({err.strerror or err})")
    return run(parser, lambda args: _bench(args, device, names), args)


def _bench(args: argparse.Namespace, device: torch.device, names) -> int:
    import torch

    from ..datasets import load_planetoid
    from .attention import sizes_for, sweep
    from .gpu.command import GNN_FIELDS, gnn_steps, gpu_targets
    from .patterns import patterns
    from .report import plot, ratio_table, targets, write_csv

    cuda, available = device.type == "cuda", patterns()
    # the data set first: a missing one is one line (_cli.run) before any work
    cora = load_planetoid("Cora", args.data) if cuda and not args.no_gnn else None
    peers = list(args.peers or (GPU_PEERS if cuda else CPU_PEERS))
    if args.no_flex or (args.quick and not args.peers and not cuda):
        peers = [p for p in peers if p not in ("flex", "flex_csr")]
    sizes = sizes_for(names, args.quick, device=str(device))
    if args.sizes:
        sizes = {name: args.sizes for name in names}
    torch.set_num_threads(args.threads)
    repeats = 1 if args.quick else args.repeats
    rows = sweep(
        {n: available[n] for n in names},
        sizes,
        peers,
        repeats=repeats,
        memory=not args.no_memory,
        progress=not args.no_progress,
        device=str(device),
    )
    stem = args.name or ("attention_quick" if args.quick else "attention") + ("_cuda" if cuda else "")
    write_csv(rows, args.out / f"{stem}.csv")
    where = torch.cuda.get_device_name(device) if cuda else platform.processor() or platform.machine()
    plot(rows, args.out / f"{stem}.png", device=where)
    print(f"torch {torch.__version__}, {args.threads} threads, {where}; "
          f"H=8, d=64, fp32; ratio = peer time / tgattn time (> 1: tgattn faster)")
    print(ratio_table(rows, peers))
    print()
    if cuda:
        gnn = [] if args.no_gnn else gnn_steps(device, cora=cora)
        if gnn:
            write_csv(gnn, args.out / f"{stem}_gnn.csv", fields=GNN_FIELDS)
            print("\n".join(f"{r['workload']:<10} {r['model']:<12} {r.get('ms') or float('nan'):>9.2f} ms  {r.get('note', '')}"
                            for r in gnn))
        print(gpu_targets(rows, gnn, verdicts=repeats > 1))
    else:
        print(targets(rows, verdicts=repeats > 1))
    written = [args.out / f"{stem}.csv", args.out / f"{stem}.png", *([args.out / f"{stem}_gnn.csv"] if cuda and gnn else [])]
    print(f"\nwrote {', '.join(map(str, written))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
