"""Tunes the ``tc`` backend's tile kernels on the card: ``python -m tgattn.bench.gpu --tune``.

For bfloat16 and float16 at head dims 64 and 128, on a long structured set (a sliding window of
256 keys either side at n = 65,536, 8 heads: 1.6 million tiles a launch), each tile kernel
(forward, dq, dk-dv) runs at every launch option of :func:`candidates` (warps x pipeline
stages around :func:`~tgattn.engine.triton.tile_config.default_config`), timed with CUDA events
(the minimum of ``repeats``). An option whose compiled kernel spills on this card is dropped.
The fastest of each kernel makes a row of the table
(:data:`~tgattn.engine.triton.tile_config.TABLE_FIELDS`, the card named), which the ``tc``
backend reads when it is committed as ``data/gpu/tile_configs.csv``; every time lands in
``tile_sweep.csv``. A budget (240 s by default) skips, with a note, what it cannot hold.

Tile rows and keys stay those of :func:`~tgattn.engine.triton.tile_plan.choose_blocks` (64 x 64):
the plan, not a launch option, fixes them. ``--dry-run`` runs the same code on the CPU through
Triton's interpreter at a tiny size (one repeat, options ignored by the interpreter).
"""
from __future__ import annotations

import csv
import itertools
import time
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import torch

DIMS = (64, 128)
DTYPES = (torch.bfloat16, torch.float16)
N, HEADS, RADIUS = 65536, 8, 256  # the long case
DRY_N, DRY_RADIUS = 80, 8
SWEEP_FIELDS = ("card", "dtype", "head_dim", "kernel", "num_warps", "num_stages", "ms", "note")


def candidates(default: Tuple[int, int]) -> List[Tuple[int, int]]:
    """The options tried for a kernel whose default is ``default = (warps, stages)``: 4 and 8 warps
    at 2-5 stages around it (the default first).

    Example:
        >>> candidates((4, 3))
        [(4, 3), (4, 2), (4, 4), (4, 5), (8, 2), (8, 3), (8, 4)]
    """
    warps, stages = default
    tried = [(w, s) for w, s in itertools.product((4, 8), (2, 3, 4, 5)) if abs(s - stages) <= 1 or w == warps]
    return [default] + [o for o in tried if o != default]


def _problem(dtype, d, dry_run: bool, device):
    """The case's inputs, tile plan and the call's launches (forward, dq, dk-dv) at the default options."""
    from tgattn import builders, engine
    from tgattn.engine.triton.tc import plan_for_inputs, tile_kernels_module

    n, radius = (DRY_N, DRY_RADIUS) if dry_run else (N, RADIUS)
    s = engine.analyse(builders.window(n, radius).to(device), n, n)
    plan, rest = plan_for_inputs(s, dtype, d, blocks=(16, 16) if dry_run else None, min_fill=0.0)
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v, grad_out = (torch.randn(n, HEADS, d, generator=g).to(device, dtype) for _ in range(4))
    tk = tile_kernels_module()
    forward, (out, lse) = tk.forward_launch(q, k, v, plan, d ** -0.5)
    forward()
    delta_launch, delta = tk.delta_launch(grad_out, out)
    delta_launch()
    (dq, dkdv), _ = tk.backward_launches(q, k, v, grad_out, lse, delta, plan, d ** -0.5)
    return {"forward": forward, "dq": dq, "dkdv": dkdv}


def _timer(device) -> Callable[[Callable[[], None], int], float]:
    def best_ms(fn, repeats: int) -> float:
        times = []
        for _ in range(repeats):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return min(times)
    return best_ms


def _spills(launch, warps: int, stages: int) -> int:
    """Bytes the compiled kernel spills on this card (0 under the interpreter)."""
    kernel = launch.kernel[launch.grid](*launch.args, **{**launch.meta, "num_warps": warps, "num_stages": stages})
    return int(getattr(kernel, "n_spills", 0) or 0)


def tune(out: Path, *, dry_run: bool = False, budget_s: float = 240.0, repeats: int = 5) -> Tuple[List[dict], List[dict]]:
    """Runs the sweep, writes ``tile_sweep.csv`` and ``tile_configs.csv`` under ``out``: ``(sweep, table)``."""
    from tgattn.engine.triton.tile_config import TABLE_FIELDS, current_device, default_config

    device = torch.device("cpu" if dry_run else "cuda")
    card, arch = ("cpu (dry run)", 90) if dry_run else current_device()
    best_ms, start = _timer(device), time.perf_counter()
    sweep, table = [], []
    for dtype, d in itertools.product(DTYPES, DIMS):
        name = str(dtype).replace("torch.", "")
        launches = _problem(dtype, d, dry_run, device)
        defaults = default_config(arch, d)
        chosen: Dict[str, Tuple[float, Tuple[int, int]]] = {}
        for kernel, launch in launches.items():
            options = candidates(getattr(defaults, kernel))
            for warps, stages in options[:1] if dry_run else options:
                row = dict(card=card, dtype=name, head_dim=d, kernel=kernel, num_warps=warps, num_stages=stages,
                           ms="", note="")
                if time.perf_counter() - start > budget_s:
                    row["note"] = f"skipped: the budget of {budget_s:g} s was spent"
                elif _spills(launch, warps, stages):
                    row["note"] = "spills on this card"
                else:
                    meta = {**launch.meta, "num_warps": warps, "num_stages": stages}
                    ms = best_ms(lambda: launch.kernel[launch.grid](*launch.args, **meta), 1 if dry_run else repeats)
                    row["ms"] = round(ms, 4)
                    if kernel not in chosen or ms < chosen[kernel][0]:
                        chosen[kernel] = (ms, (warps, stages))
                sweep.append(row)
        for kernel in ("forward", "dq", "dkdv"):
            warps, stages = chosen.get(kernel, (0.0, getattr(defaults, kernel)))[1]
            table.append(dict(card=card, dtype=name, head_dim=d, block_m=launches[kernel].meta["BLOCK_M"],
                              block_n=launches[kernel].meta["BLOCK_N"], kernel=kernel, num_warps=warps,
                              num_stages=stages))
    out.mkdir(parents=True, exist_ok=True)
    for path, fields, rows in ((out / "tile_sweep.csv", SWEEP_FIELDS, sweep), (out / "tile_configs.csv", TABLE_FIELDS, table)):
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            writer.writerows(rows)
    return sweep, table
