"""Scaling of graph transformers with the number of nodes of one graph: GPS (MHA, tgattn) vs Exphormer.

One training step (forward + backward) of one layer with no local conv on a single random graph
of n nodes (a ring plus ``n`` random chords, both directions: average degree 4), ``D = 32``,
``H = 4``; on a one-graph data set that step is an epoch. Models:

* ``gps_mha``: PyG's ``GPSConv`` (``nn.MultiheadAttention``, no attention dropout). On CPU it
  runs on SDPA's flash kernel, which never stores the ``[H, n, n]`` scores: memory ``O(n)``,
  time ``O(n**2)``.
* ``gps_mha_dropout``: the same with attention dropout 0.5 (PyG's ``examples/graph_gps.py``).
  SDPA's CPU flash kernel takes no dropout, so SDPA falls back to its math kernel, which
  stores the ``[H, n, n]`` scores and probabilities: memory ``O(n**2)``.
* ``gps_tgattn``: :class:`tgattn.nn.GPSConv` over the ``n**2``-edge set of all pairs: ``O(n**2)``.
* ``exphormer``: :class:`tgattn.nn.ExphormerConv` over graph + expander + virtual node edges: ``O(n)``.

Each point runs in a fresh process whose address space is capped (``RLIMIT_AS``) at
``limit_mb`` above its size after the imports: a point that needs more fails its allocation
and is reported as out of memory (measured, under that cap, with the size predicted from the
last point that ran). Peak memory is the peak resident set size above the one before the
inputs were built. A point is skipped (with its prediction) only when the time predicted from
the last measured size exceeds the time budget.
"""
from __future__ import annotations

from pathlib import Path
import time
from typing import Callable, Dict, List, Optional

import torch
from torch import Tensor

from ... import builders
from ...nn import ExphormerConv, GPSConv, exphormer_edge_kinds
from ..measure import failed_allocation, reset_rss_high_water, rss_high_water_mb, rss_mb

SCALING_MODELS = ("gps_mha", "gps_mha_dropout", "gps_tgattn", "exphormer")
TIME_GROWTH = {"gps_mha": 2, "gps_mha_dropout": 2, "gps_tgattn": 2, "exphormer": 1}  # time ~ n ** growth
MEMORY_GROWTH = {"gps_mha": 1, "gps_mha_dropout": 2, "gps_tgattn": 2, "exphormer": 1}  # memory ~ n ** growth
DIM, HEADS, ATTN_DROPOUT = 32, 4, 0.5


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
    if model in ("gps_mha", "gps_mha_dropout"):
        drop = ATTN_DROPOUT if model == "gps_mha_dropout" else 0.0
        layer = PyGGPSConv(DIM, None, HEADS, attn_kwargs={"dropout": drop}).train()
        return lambda: layer(x, ei)
    if model == "gps_tgattn":
        layer, pairs = GPSConv(DIM, None, HEADS), builders.full(n)
        return lambda: layer(x, ei, attn_edge_index=pairs)
    pairs = builders.exphormer(ei, n, 4, generator=torch.Generator().manual_seed(seed))
    kinds = exphormer_edge_kinds(pairs, ei, n)
    layer, xv = ExphormerConv(DIM, None, HEADS), torch.cat([x, torch.zeros(1, DIM)])
    return lambda: layer(xv, ei, attn_edge_index=pairs, attn_edge_kind=kinds)


def _status_kib(field: str) -> int:
    """A ``/proc/self/status`` memory field (``VmSize``) in KiB."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field + ":"))
    return int(line.split()[1])


def measure_point(model: str, n: int, repeats: int = 3, *, budget_s: float = 30.0,
                  limit_mb: Optional[float] = None) -> Dict:
    """``ms`` (min over up to ``repeats`` training steps, fewer where one more would end past
    ``budget_s``; the first step counts) and ``peak_mb``: the peak resident set size above the one before the
    inputs were built (so the edge sets count, e.g. the ``n**2`` pairs of GPS on tgattn).
    Linux only: the kernel's peak (``VmHWM``) is reset first by writing 5 to
    ``/proc/self/clear_refs``.

    ``limit_mb`` caps this process's address space (``RLIMIT_AS``) at its current size plus
    ``limit_mb`` for good; an allocation beyond it fails, and the row has ``ms = peak_mb = None``
    and ``oom`` = the error. Run it in a fresh process (:func:`measure_scaling` does).
    """
    import resource

    if limit_mb is not None:
        cap = 1024 * _status_kib("VmSize") + int(limit_mb * 2 ** 20)
        resource.setrlimit(resource.RLIMIT_AS, (cap, resource.getrlimit(resource.RLIMIT_AS)[1]))
    base = rss_mb()
    reset_rss_high_water()
    times, start = [], time.perf_counter()
    try:
        f = step(model, n)
        while len(times) < max(repeats, 1) and (not times or time.perf_counter() - start + times[-1] < budget_s):
            t0 = time.perf_counter()
            f().square().mean().backward()
            times.append(time.perf_counter() - t0)
    except (MemoryError, RuntimeError) as err:  # torch reports a failed allocation as a RuntimeError
        asked = failed_allocation(err)
        if asked is None:
            raise
        return {"ms": None, "peak_mb": None,
                "oom": f"an allocation of {asked / 2 ** 20:,.0f} MB failed" if asked else str(err)[:120]}
    return {"ms": 1e3 * min(times), "peak_mb": rss_high_water_mb() - base, "steps": len(times)}


def measure_scaling(sizes: List[int], *, limit_mb: float, budget_s: float = 60.0, repeats: int = 2,
                    models=SCALING_MODELS, threads: int = 1, progress: Optional[Callable[[dict], None]] = None) -> List[Dict]:
    """One row per (model, n): ``ms`` per training step, ``peak_mb``, and a note (out of memory, skipped).

    Each point runs in its own process under an address-space cap of ``limit_mb`` above its size
    after the imports (:func:`measure_point`): running out of it is measured, not predicted. A
    model skips a size only when the time predicted from its last measured size
    (:data:`TIME_GROWTH`) exceeds ``budget_s`` seconds per step and the memory predicted from
    it (:data:`MEMORY_GROWTH`) fits under the cap (a point that does not fit runs: its
    allocation fails at once); the notes give both predictions.
    """
    import json
    import subprocess
    import sys

    rows, last = [], {}
    for n in sizes:
        for model in models:
            row = {"model": model, "n": n, "ms": None, "peak_mb": None, "predicted_ms": None, "predicted_mb": None,
                   "note": ""}
            predicted = ""
            if model in last:
                n0, ms0, mb0 = last[model]
                ms, mb = ms0 * (n / n0) ** TIME_GROWTH[model], mb0 * (n / n0) ** MEMORY_GROWTH[model]
                row.update(predicted_ms=ms, predicted_mb=mb)
                predicted = f"predicted {ms / 1e3:,.1f} s / step, {mb:,.0f} MB from n = {n0}"
                if ms > 1e3 * budget_s and mb <= limit_mb:  # a point predicted not to fit still runs: it fails fast
                    row["note"] = f"skipped: {predicted} (time budget {budget_s:,.0f} s / step)"
                    rows.append(row)
                    continue
            code = (f"import json, torch; torch.set_num_threads({threads}); from tgattn.bench.graph_transformers.scaling import "
                    f"measure_point; print(json.dumps(measure_point({model!r}, {n}, {repeats}, budget_s={budget_s}, "
                    f"limit_mb={limit_mb})))")
            try:
                done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                      timeout=budget_s * (repeats + 1) + 300)
            except subprocess.TimeoutExpired:
                done = None
            result = json.loads(done.stdout.strip().splitlines()[-1]) if done and done.returncode == 0 else None
            if done is None:
                row["note"] = f"timed out ({predicted or 'first size'})"
            elif result is None and done.returncode < 0:
                row["note"] = f"killed by signal {-done.returncode} ({predicted or 'first size'})"
            elif result is None:
                error = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode
                row["note"] = f"failed: {error}"
            elif result.get("oom"):
                row["note"] = (f"out of memory under a {limit_mb:,.0f} MB address-space cap (RLIMIT_AS): "
                               f"{result['oom']}; {predicted or 'first size'}")
            else:
                row.update(ms=result["ms"], peak_mb=result["peak_mb"])
                if result["steps"] == 1:
                    row["note"] = "one step (the time budget allowed no more)"
                last[model] = (n, row["ms"], max(row["peak_mb"], 1.0))
            rows.append(row)
            if progress is not None:
                progress(row)
    return rows
