"""Scaling of graph transformers with the number of nodes of one graph: GPS (MHA, tgattn) vs Exphormer.

One training step (forward + backward) of one layer with no local conv on a single random graph
of n nodes (a ring plus ``n`` random chords, both directions: average degree 4), ``D = 32``,
``H = 4``. GPS attends over all ``n**2`` pairs (PyG: a dense ``[H, n, n]`` score matrix;
tgattn: an ``n**2``-edge set); Exphormer over graph + expander + virtual node edges (``O(n)``).
Each point runs in a fresh process and reports its peak resident set size above the one
before the inputs were built (PyG's MHA runs on SDPA, whose CPU kernel allocates its own memory, unseen by
a tensor-level probe). A model runs at a size only when the time and memory predicted from its
last measured size (``n**2`` growth for GPS, ``n`` for Exphormer) stay under the budgets;
skipped sizes are reported with their prediction.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch
from torch import Tensor

from .. import builders
from ..nn import ExphormerConv, GPSConv, exphormer_edge_kinds
from .measure import best_time

SCALING_MODELS = ("gps_mha", "gps_tgattn", "exphormer")
GROWTH = {"gps_mha": 2, "gps_tgattn": 2, "exphormer": 1}  # memory ~ n ** growth
DIM, HEADS = 32, 4


def ring_with_chords(n: int, seed: int = 0) -> Tensor:
    """A ring of n nodes plus n random chords, both directions: ``[2, ~4n]``."""
    g = torch.Generator().manual_seed(seed)
    i = torch.arange(n)
    chords = torch.stack([i, torch.randint(0, n, (n,), generator=g)])
    ei = torch.cat([torch.stack([i, (i + 1) % n]), chords], 1)
    ei = ei[:, ei[0] != ei[1]]
    return builders.union(ei, ei.flip(0))


def step(model: str, n: int, seed: int = 0) -> Callable[[], Tensor]:
    """A closure running one forward of ``model`` on the graph of n nodes (backward is the caller's)."""
    from torch_geometric.nn import GPSConv as PyGGPSConv

    torch.manual_seed(seed)
    ei = ring_with_chords(n, seed)
    x = torch.randn(n, DIM)
    if model == "gps_mha":
        layer = PyGGPSConv(DIM, None, HEADS)
        return lambda: layer(x, ei)
    if model == "gps_tgattn":
        layer, pairs = GPSConv(DIM, None, HEADS), builders.full(n)
        return lambda: layer(x, ei, attn_edge_index=pairs)
    pairs = builders.exphormer(ei, n, 4, generator=torch.Generator().manual_seed(seed))
    kinds = exphormer_edge_kinds(pairs, ei, n)
    layer, xv = ExphormerConv(DIM, None, HEADS), torch.cat([x, torch.zeros(1, DIM)])
    return lambda: layer(xv, ei, attn_edge_index=pairs, attn_edge_kind=kinds)


def _status_kib(field: str) -> int:
    """A ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``) in KiB."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field + ":"))
    return int(line.split()[1])


def measure_point(model: str, n: int, repeats: int = 3) -> Dict:
    """``ms`` (min over ``repeats`` training steps) and ``peak_mb``: the peak resident set size
    above the one before the inputs were built (so the edge sets count, e.g. the ``n**2``
    pairs of GPS on tgattn). Linux only: the kernel's peak (``VmHWM``) is reset first by
    writing 5 to ``/proc/self/clear_refs``.

    Run it in a fresh process (:func:`measure_scaling` does): it counts memory that kernels
    allocate internally (SDPA's), which a tensor-level probe does not see.
    """
    base = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
    loss = (lambda f: lambda: f().square().mean())(step(model, n))  # noqa: E731
    ms = best_time(loss, True, [], torch.ones(()), repeats=repeats, budget_s=30.0)
    return {"ms": ms, "peak_mb": (_status_kib("VmHWM") - base) / 1024}


def measure_scaling(sizes: List[int], *, budget_mb: float, budget_s: float = 60.0, repeats: int = 2,
                    models=SCALING_MODELS, threads: int = 1, progress: Optional[Callable[[dict], None]] = None) -> List[Dict]:
    """One row per (model, n): ``ms`` per training step, ``peak_mb``, or why the size was skipped.

    Each point runs in its own process. A model skips a size when the time or the memory
    predicted from its last measured size (``n ** 2`` growth for GPS, ``n`` for Exphormer)
    exceeds ``budget_s`` seconds per step or ``budget_mb``.
    """
    import json
    import subprocess
    import sys

    rows, last = [], {}
    for n in sizes:
        for model in models:
            row = {"model": model, "n": n, "ms": None, "peak_mb": None, "note": ""}
            if model in last:
                n0, ms0, mb0 = last[model]
                grow = (n / n0) ** GROWTH[model]
                if ms0 * grow > 1e3 * budget_s or mb0 * grow > budget_mb:
                    row["note"] = (f"skipped: predicted {ms0 * grow / 1e3:,.0f} s / step, {mb0 * grow:,.0f} MB "
                                   f"(budget {budget_s:,.0f} s, {budget_mb:,.0f} MB)")
                    rows.append(row)
                    continue
            code = (f"import json, torch; torch.set_num_threads({threads}); from tgattn.bench.gt_scaling import "
                    f"measure_point; print(json.dumps(measure_point({model!r}, {n}, {repeats})))")
            done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
            if done.returncode != 0:
                row["note"] = f"failed: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}"
            else:
                row.update(json.loads(done.stdout.strip().splitlines()[-1]))
                last[model] = (n, row["ms"], max(row["peak_mb"], 1.0))
            rows.append(row)
            if progress is not None:
                progress(row)
    return rows
