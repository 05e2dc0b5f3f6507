"""The tile kernels' launch options in the GPU suite: the launch-option sweep, run before the
attention cases where the checkout has it (:func:`tune_sweep`), and the options each case's
``tc`` rows ran with (:func:`launch_options`). Both modules come from branch tc-kernels
(``tgattn.bench.gpu_tune``, ``tgattn.engine.triton.tile_config``); a checkout without them runs
the suite on the kernels' default options and says so.
"""
from __future__ import annotations

import importlib
import importlib.util
from dataclasses import fields
from typing import List, Tuple

import torch

LAUNCH_MODULE = "tgattn.engine.triton.tile_config"  # the tile kernels' launch options per card (branch tc-kernels)


def launch_options(dtype: torch.dtype, head_dim: int, rows: int, keys: int) -> str:
    """The tile kernels' launch options on this card for such tiles (``"forward 4w 3s, ..."``:
    warps and pipeline stages per kernel, tuned or default), ``""`` where the checkout has no table.

    Example:
        >>> isinstance(launch_options(torch.bfloat16, 64, 64, 64), str)
        True
    """
    if importlib.util.find_spec(LAUNCH_MODULE) is None:
        return ""
    config = importlib.import_module(LAUNCH_MODULE).tile_config(dtype, head_dim, rows, keys)
    return ", ".join(f"{f.name} {getattr(config, f.name)[0]}w {getattr(config, f.name)[1]}s" for f in fields(config))


TUNE_MODULE = "tgattn.bench.gpu_tune"  # the launch-option sweep (branch tc-kernels), run first where it exists
TUNE_S = 100.0  # of the suite's budget, the most the sweep may take on a GPU (its own --tune may take 4 minutes)
ATTENTION_MIN_S = 200.0  # of the budget, kept for the attention cases whatever the sweep asks


def tune_sweep(device: torch.device, clock, out, *, dry_run: bool, reserve: float = 0.0) -> Tuple[List[dict], str]:
    """``(rows, note)``: the tile kernels' launch-option sweep of :mod:`tgattn.bench.gpu_tune`, run
    before the attention cases so that the ``tc`` rows measure the tuned kernels, within
    :data:`TUNE_S` of the budget (less when the budget left, less ``reserve`` and
    :data:`ATTENTION_MIN_S`, is shorter); ``rows`` empty and ``note`` saying why where it did not
    run or failed (the suite goes on).

    The contract with that module: ``tune(device, *, budget_s, out, dry_run) -> list of dicts``
    (one per configuration measured; it writes its own table under ``out``). A checkout without the
    module runs the suite on the default launch options.

    Example:
        >>> import importlib.util
        >>> from tgattn.bench.gpu_suite import Clock
        >>> rows, note = tune_sweep(torch.device("cpu"), Clock(0.0), None, dry_run=True)
        >>> rows, note.startswith("skipped") or importlib.util.find_spec(TUNE_MODULE) is None
        ([], True)
    """
    if importlib.util.find_spec(TUNE_MODULE) is None:
        return [], f"not run: no {TUNE_MODULE} in this checkout (the tile kernels' default launch options)"
    budget = min(TUNE_S, clock.left(reserve + ATTENTION_MIN_S)) if device.type == "cuda" else clock.left(reserve)
    if budget <= 0:
        return [], f"skipped: time budget ({max(clock.left(), 0):.0f} s left of {clock.budget_s:.0f} s)"
    try:
        rows = list(importlib.import_module(TUNE_MODULE).tune(device, budget_s=budget, out=out, dry_run=dry_run))
    except Exception as err:  # the sweep failing must not cost the suite its cases
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return [], f"failed: {type(err).__name__}: {str(err)[:200]}"
    return rows, f"ran within {budget:.0f} s"
