"""Tunes the ``tc`` backend's tile kernels on the card: ``python -m tgattn.bench.gpu --tune``.

For bfloat16 and float16 at head dims 64 and 128, on a long structured set (a sliding window of
256 keys either side at n = 65,536, 8 heads), each tile shape of
:data:`~tgattn.engine.triton.tile_config.SHAPES` gets its own tile plan, and each tile kernel
(forward, dq, dk-dv) runs at every launch option (warps x pipeline stages) that
``data/gpu/tune_candidates.csv`` (:func:`clean_candidates`: every candidate compiled for sm_80 /
sm_90 by ``python -m tgattn.bench.gpu_compiled --tune-candidates``, per Triton release) says compiles for this card's
target without spills and within its shared memory, timed with CUDA events (the minimum of
``repeats`` after a warm-up); a shape at which one kernel has no such option is left out (one plan
serves the three; by the committed table: sm_80 keeps only 64 x 64, sm_90 all three shapes at
d = 64 and 64 x 64 at d = 128). Per dtype and head dim the shape whose forward + dq + dk-dv time
(each kernel at its fastest options) is least wins, and its three kernels make rows of the table
(:data:`~tgattn.engine.triton.tile_config.TABLE_FIELDS`, the card named), which the ``tc`` backend
reads (shape and options) when committed as ``data/gpu/tile_configs.csv`` or put in force
(:func:`~tgattn.engine.triton.tile_config.use_table`); every time lands in ``tile_sweep.csv``.

Every candidate is compiled before the timing, in a pool of processes (one per CPU core), into
Triton's cache (:func:`precompile`), so the timed launches load their kernels from it. A budget
(240 s by default) holds the compiles and the timing: what it cannot hold is skipped with a note.

Predicted, not measured (no GPU has run it): of the 192 candidates (per kernel, dtype and head dim:
64 x 64 tiles on 4 / 8 warps, 128 x 64 and 128 x 128 on 8, at 2-5 stages), the committed table
leaves 126 that an H100 / H200 (sm_90) times (74 on sm_80), each launched 6 times (a warm-up and 5
repeats): 756 launches, which the cost model (:func:`~tgattn.engine.triton.tile_cost.predict`, the
measured efficiencies; the long case at 0.65-0.73 ms forward and 2.2-2.4 ms for dq + dk-dv at
d = 64, twice that at d = 128) puts at 0.9 s of kernels in all. The compiles dominate: 126 of 1-3 s
each on one core of this project's CPU machine, ~30 s over 16 cores with the workers' start; with
the analysis of the 33-million-edge window, three plans and the inputs, about a minute of the 4.

``--dry-run`` runs the same code on the CPU through Triton's interpreter at a tiny size: tiles a
quarter of each candidate shape (16-32 rows and keys; its table rows name the shape they stand in
for), the first clean option of each kernel, one repeat, no compile (the interpreter ignores launch
options).
"""
from __future__ import annotations

import csv
import itertools
import os
import time
from concurrent.futures import ProcessPoolExecutor, wait
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ...engine.triton.aot import triton_version
from ...engine.triton.tile_config import KERNELS, SHAPES, TABLE, TUNED_DIMS, TUNED_DTYPES, Candidate, candidates

CANDIDATES = TABLE.parent / "tune_candidates.csv"  # the candidates compiled for sm_80 / sm_90 (committed)
N, HEADS, RADIUS = 65536, 8, 256  # the long case
DRY_N, DRY_RADIUS, DRY_SCALE = 80, 8, 4  # the dry run: tiles of shape / DRY_SCALE
SWEEP_FIELDS = ("card", "dtype", "head_dim", "block_m", "block_n", "kernel", "num_warps", "num_stages", "ms", "note")


def target_name(arch: int) -> str:
    """The compiled target a card of compute capability ``arch`` runs: ``sm_90`` from 90 up, else ``sm_80``."""
    return "sm_90" if arch >= 90 else "sm_80"


def _release(version: str) -> Tuple[int, ...]:
    return tuple(int("".join(ch for ch in part if ch.isdigit()) or 0) for part in version.split(".")[:3])


def candidate_rows(path: Path = CANDIDATES, version: Optional[str] = None) -> Tuple[str, List[dict]]:
    """``(version, rows)``: the rows of the candidates table at ``path`` that Triton ``version``
    (default: the installed one) compiled; where the table has none of that version, those of its
    newest (the card's own compiler's spill report then backs the sweep: :func:`precompile`).
    Registers and spills differ between Triton releases (3.7 and 3.9: a few registers, and which
    candidates spill), so the table keeps each release's rows.

    Example:
        >>> candidate_rows(version="3.7.1")[0], len(candidate_rows(version="3.7.1")[1])
        ('3.7.1', 384)
    """
    with open(path) as f:
        rows = list(csv.DictReader(f))
    versions = sorted({r["triton"] for r in rows}, key=_release)
    if not versions:
        raise ValueError(f"{path} holds no compiled candidates")
    version = version or triton_version()
    chosen = version if version in versions else versions[-1]
    return chosen, [r for r in rows if r["triton"] == chosen]


def clean_candidates(arch: int, path: Path = CANDIDATES, version: Optional[str] = None) -> List[Candidate]:
    """The candidates (:func:`~tgattn.engine.triton.tile_config.candidates`, in its order) that the
    table at ``path`` says compile for ``arch``'s target without spills and within its shared memory,
    under Triton ``version`` (:func:`candidate_rows`).

    Example:
        >>> clean = clean_candidates(90)
        >>> 0 < len(clean) < len(candidates()), clean[0].block_m, clean[0].num_warps
        (True, 64, 4)
    """
    fit = {(r["kernel"], r["dtype"], int(r["head_dim"]), int(r["block_m"]), int(r["block_n"]), int(r["num_warps"]),
            int(r["num_stages"])) for r in candidate_rows(path, version)[1]
           if r["target"] == target_name(arch) and int(r["spill_stores"]) == int(r["spill_loads"]) == 0
           and int(r["shared"]) <= int(r["smem_limit"])}
    return [c for c in candidates() if (c.kernel, c.dtype, c.head_dim, c.block_m, c.block_n, c.num_warps,
                                        c.num_stages) in fit]


def _launches(dtype, d, shape, inputs, s):
    """The case's launches at tile shape ``shape`` (forward, delta, dq, dk-dv) and default options; the
    backward's log-sum-exp and delta are the forward's and delta launch's outputs."""
    from ...engine.triton.tc import plan_for_inputs, tile_kernels_module

    q, k, v, grad_out = inputs
    plan, _ = plan_for_inputs(s, dtype, d, blocks=shape, min_fill=0.0)
    tk = tile_kernels_module()
    forward, (out, lse) = tk.forward_launch(q, k, v, plan, d ** -0.5)
    delta_launch, delta = tk.delta_launch(grad_out, out)
    (dq, dkdv), _ = tk.backward_launches(q, k, v, grad_out, lse, delta, plan, d ** -0.5)
    return {"forward": forward, "delta": delta_launch, "dq": dq, "dkdv": dkdv}


def _proxy(arg):
    """What the compiler sees of a launch argument, without its data: a one-element CPU tensor of the
    same dtype and 16-byte alignment (Triton specialises pointers on it), else the value."""
    if not isinstance(arg, torch.Tensor):
        return arg
    aligned = arg.device.type == "meta" or arg.data_ptr() % 16 == 0
    return torch.empty(2, dtype=arg.dtype)[0 if aligned else 1:]


def _compile(kernel: str, args: tuple, meta: dict, arch: int, cache_dir: str) -> Tuple[int, float]:
    """Compiles a tile kernel for ``arch`` into ``cache_dir`` (a pool worker): ``(spilled bytes, seconds)``."""
    from ...engine.triton import aot, tile_kernels

    start = time.perf_counter()
    target = next(t for t in aot.TARGETS if t.name == target_name(arch))
    launch = tile_kernels.Launch(getattr(tile_kernels, kernel), (1,), args, meta)
    res, _ = aot.compile_launch(launch, target, cache_dir)
    return res.spill_stores + res.spill_loads, time.perf_counter() - start


def precompile(jobs: List[Tuple[object, Dict]], arch: int, workers: int = 0,
               timeout_s: Optional[float] = None) -> List[Optional[Tuple[int, float]]]:
    """Compiles each ``(launch, options)`` of ``jobs`` for ``arch`` into this process's Triton cache, in
    ``workers`` processes (default: one per CPU core), as its launch would (same binding: the same
    cache key): ``[(spilled bytes, seconds)]``, ``None`` for a job not done within ``timeout_s`` (its
    launch compiles when it first runs). The launches' tensors stay here (:func:`_proxy`)."""
    import multiprocessing

    from triton import knobs

    pool = ProcessPoolExecutor(workers or os.cpu_count(), mp_context=multiprocessing.get_context("spawn"))
    futures = [pool.submit(_compile, launch.kernel.__name__, tuple(_proxy(a) for a in launch.args),
                           {**launch.meta, **options}, arch, knobs.cache.dir) for launch, options in jobs]
    wait(futures, timeout=timeout_s)
    pool.shutdown(wait=False, cancel_futures=True)  # a compile under way finishes into the cache
    return [f.result() if f.done() and not f.cancelled() else None for f in futures]


def _timer(device) -> Callable[[Callable[[], None], int], float]:
    def best_ms(fn, repeats: int) -> float:
        if device.type == "cuda":
            fn()  # warm-up: the kernel loaded from the cache
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


def _options(clean: List[Candidate], dtype: str, d: int, shape, kernel: str) -> List[Tuple[int, int]]:
    return [(c.num_warps, c.num_stages) for c in clean
            if (c.kernel, c.dtype, c.head_dim, (c.block_m, c.block_n)) == (kernel, dtype, d, shape)]


def _precompile_cases(cases, clean: List[Candidate], s, n: int, arch: int, timeout_s: float) -> Dict[tuple, int]:
    """Every clean candidate of the shapes the sweep runs into Triton's cache (:func:`precompile`), from
    launches on inputs without data: ``{(dtype, d, shape, kernel, (warps, stages)): spilled bytes}``."""
    jobs, keys = [], []
    for dtype, d, name in cases:
        meta_inputs = [torch.empty(n, HEADS, d, dtype=dtype, device="meta") for _ in range(4)]
        for shape in SHAPES:
            if not all(_options(clean, name, d, shape, kernel) for kernel in KERNELS):
                continue
            launches = _launches(dtype, d, shape, meta_inputs, s)
            for kernel in KERNELS:
                for options in _options(clean, name, d, shape, kernel):
                    jobs.append((launches[kernel], dict(num_warps=options[0], num_stages=options[1])))
                    keys.append((name, d, shape, kernel, options))
    return {key: result[0] for key, result in zip(keys, precompile(jobs, arch, timeout_s=timeout_s)) if result}


def tune(out: Path, *, dry_run: bool = False, budget_s: float = 240.0, repeats: int = 5) -> Tuple[List[dict], List[dict]]:
    """Runs the sweep, writes ``tile_sweep.csv`` and ``tile_configs.csv`` under ``out``: ``(sweep, table)``.
    A dtype and head dim without one shape timed at every kernel (the budget spent) gets no table row."""
    from ... import builders, engine
    from ...engine.triton.tile_config import TABLE_FIELDS, current_device

    device = torch.device("cpu" if dry_run else "cuda")
    card, arch = ("cpu (dry run)", 90) if dry_run else current_device()
    clean = clean_candidates(arch)
    best_ms, start = _timer(device), time.perf_counter()
    n, radius = (DRY_N, DRY_RADIUS) if dry_run else (N, RADIUS)
    s = engine.analyse(builders.window(n, radius).to(device), n, n)
    g = torch.Generator(device="cpu").manual_seed(0)
    cases = [(dtype, d, str(dtype).replace("torch.", "")) for dtype, d in
             itertools.product((getattr(torch, t) for t in TUNED_DTYPES), TUNED_DIMS)]
    shape_of = {shape: (shape[0] // DRY_SCALE, shape[1] // DRY_SCALE) if dry_run else shape for shape in SHAPES}
    spilled = {} if dry_run else _precompile_cases(cases, clean, s, n, arch, budget_s - (time.perf_counter() - start))
    sweep, table = [], []
    for dtype, d, name in cases:
        inputs = [torch.randn(n, HEADS, d, generator=g).to(device, dtype) for _ in range(4)]
        totals: Dict[tuple, float] = {}
        chosen: Dict[tuple, Dict[str, Tuple[float, Tuple[int, int]]]] = {}
        for shape in SHAPES:
            missing = [kernel for kernel in KERNELS if not _options(clean, name, d, shape, kernel)]
            sweep += [dict(card=card, dtype=name, head_dim=d, block_m=shape[0], block_n=shape[1], kernel=kernel,
                           num_warps="", num_stages="", ms="",
                           note=f"no candidate compiles for {target_name(arch)} without spills within its shared memory")
                      for kernel in missing]
            if missing:  # one plan serves the three kernels: a shape runs with all of them or not at all
                continue
            launches = _launches(dtype, d, shape_of[shape], inputs, s)
            for kernel in KERNELS:
                options = _options(clean, name, d, shape, kernel)
                for warps, stages in options[:1] if dry_run else options:
                    row = dict(card=card, dtype=name, head_dim=d, block_m=shape[0], block_n=shape[1], kernel=kernel,
                               num_warps=warps, num_stages=stages, ms="", note="")
                    if time.perf_counter() - start > budget_s:
                        row["note"] = f"skipped: the budget of {budget_s:g} s was spent"
                    elif spilled.get((name, d, shape, kernel, (warps, stages))):
                        row["note"] = "spills on this card"
                    else:
                        launch = launches[kernel]
                        meta = {**launch.meta, "num_warps": warps, "num_stages": stages}
                        row["ms"] = round(best_ms(lambda: launch.kernel[launch.grid](*launch.args, **meta),
                                                  1 if dry_run else repeats), 4)
                        best = chosen.setdefault(shape, {}).get(kernel)
                        if best is None or row["ms"] < best[0]:
                            chosen[shape][kernel] = (row["ms"], (warps, stages))
                    sweep.append(row)
                if kernel == "forward":  # the backward's log-sum-exp and delta, from the forward just timed
                    launches["delta"]()
            if set(chosen.get(shape, {})) == set(KERNELS):
                totals[shape] = sum(ms for ms, _ in chosen[shape].values())
        if totals:
            shape = min(totals, key=totals.get)
            table += [dict(card=card, dtype=name, head_dim=d, block_m=shape[0], block_n=shape[1], kernel=kernel,
                           num_warps=chosen[shape][kernel][1][0], num_stages=chosen[shape][kernel][1][1])
                      for kernel in KERNELS]
    out.mkdir(parents=True, exist_ok=True)
    for path, fields, rows in ((out / "tile_sweep.csv", SWEEP_FIELDS, sweep), (out / "tile_configs.csv", TABLE_FIELDS, table)):
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            writer.writerows(rows)
    return sweep, table
