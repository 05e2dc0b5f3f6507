"""The tile kernels' launch options in the GPU suite: the launch-option sweep
(:func:`tgattn.bench.gpu.tune.tune`), run before the attention cases (:func:`tune_sweep`), and
the options each case's ``tc`` rows ran with (:func:`launch_options`).
"""
from __future__ import annotations

from pathlib import Path
from typing import List, Tuple

import torch

from ...engine.triton import tile_config
from . import tune


def launch_options(dtype: torch.dtype, head_dim: int, rows: int, keys: int) -> str:
    """The tile kernels' launch options on this card for such tiles: warps and pipeline stages per
    kernel (tuned, or the target's defaults) and the dk-dv programs per key block.

    Example:
        >>> launch_options(torch.bfloat16, 64, 64, 64)  # no GPU here: sm_90's defaults
        'forward 4w 3s, dq 4w 3s, dkdv 4w 3s (2 programs a key block)'
    """
    config = tile_config.tile_config(dtype, head_dim, rows, keys)
    kernels = ", ".join(f"{k} {getattr(config, k)[0]}w {getattr(config, k)[1]}s" for k in tile_config.KERNELS)
    return f"{kernels} ({config.dkdv_split} programs a key block)"


TUNE_S = 100.0  # of the suite's budget, the most the sweep may take on a GPU (its own --tune may take 4 minutes)
ATTENTION_MIN_S = 200.0  # of the budget, kept for the attention cases whatever the sweep asks
TUNED_TABLE = "tile_configs.csv"  # the sweep's table under --out (the committed one: data/gpu/tile_configs.csv)


def tune_sweep(device: torch.device, clock, out: Path, *, dry_run: bool, reserve: float = 0.0) -> Tuple[List[dict], str]:
    """``(rows, note)``: the tile kernels' launch-option sweep (:func:`tgattn.bench.gpu.tune.tune`:
    ``tile_sweep.csv`` and ``tile_configs.csv`` under ``out``), run before the attention cases
    within :data:`TUNE_S` of the budget (less when the budget left, less ``reserve`` and
    :data:`ATTENTION_MIN_S`, is shorter); then this process's ``tc`` backend takes its launch
    options from the sweep's table (:func:`~tgattn.engine.triton.tile_config.use_table`), so that
    the ``tc`` rows measure the tuned kernels. ``rows`` (the sweep's timings) empty and ``note`` saying why where it did not run or
    failed (the suite goes on, on the launch options it had). A dry run skips it (its own dry run,
    ``--tune --dry-run``, takes minutes under Triton's interpreter).

    Example:
        >>> from tgattn.bench.gpu.suite import Clock
        >>> tune_sweep(torch.device("cpu"), Clock(0.0), Path("."), dry_run=True)[1].startswith("skipped: dry run")
        True
    """
    if dry_run:  # twelve tile launches under the interpreter: minutes of a dry run that CI keeps quick
        return [], "skipped: dry run (python -m tgattn.bench.gpu --tune --dry-run runs the sweep on the CPU)"
    budget = min(TUNE_S, clock.left(reserve + ATTENTION_MIN_S)) if device.type == "cuda" else clock.left(reserve)
    if budget <= 0:
        return [], f"skipped: time budget ({max(clock.left(), 0):.0f} s left of {clock.budget_s:.0f} s)"
    try:
        sweep, table = tune.tune(Path(out), dry_run=dry_run, budget_s=budget)
        tile_config.use_table(str(Path(out) / TUNED_TABLE))
    except Exception as err:  # the sweep failing must not cost the suite its cases
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return [], f"failed: {type(err).__name__}: {' '.join(str(err).split())[:200]}"
    return list(sweep), (f"ran within {budget:.0f} s: {len(sweep)} timings, {len(table)} table rows "
                         f"({Path(out) / TUNED_TABLE}), which tc takes from here on")
