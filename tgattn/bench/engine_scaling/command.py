"""``python -m tgattn.bench.engine_scaling``: the engine's backward, scaling in n, threads and memory.

Sections (``--sections``, default all but ``million``):

* ``ratios``: forward and forward+backward at n = 4096 (window 64, random 1 %, top-k 1 %) on the
  fused kernel and on the backend ``auto`` picks; the backward / forward ratio;
* ``scaling``: time per edge and head of a window of 64 from n = 1024 up (``--largest``), forward
  and forward+backward, on ``fused``, ``tile`` and ``auto`` (the fused / tile crossover);
* ``threads``: 2-thread time / 1-thread time at n = 4096 and 16384;
* ``memory``: extra peak memory (resident set) of one forward at n = 32,768 and of a
  forward+backward at n = 131,072, each in a fresh subprocess;
* ``auto``: every backend that runs a (pattern, n) as itself (``dense``, ``tile``, ``fused``,
  ``csr``) and ``auto``, for every pattern of the benchmark at n = 1024, 4096, 16384 (full and
  causal up to 4096), one thread: auto's time / the best backend's time;
* ``floor``: the fused backward (``torch.ops.tgattn_fused.backward``: deltas, key pass, dq
  copy) against its read floor, the rows it moves and nothing else (four rows per edge and head,
  as :class:`tgattn.engine.fused.ReadsOnly`'s backward), read from the caller's ``[N, H, d]``
  layout and from head-major copies (the best case), at n = 4096, one thread;
* ``cache``: the fused kernels' buffer cache on and off (limit 0), interleaved, for every
  sparse pattern of the benchmark at n = 4096, forward and forward+backward, one thread;
* ``million``: window 64 over n = 1,048,576, forward and forward+backward, each in a subprocess
  (time and peak memory of a first call, time of a second one), and one training step of a
  2-layer ``GraphAttention`` model (H = 4, D = 64) at that n.

Times are minima over interleaved rounds (``--rounds``), wall clock (``ms``) and, on one thread,
the thread's CPU time as well (``cpu_ms``: robust to other processes on a loaded machine), with
the part of it spent in the operating system (``sys_ms``: chiefly first touches of freshly
allocated pages) and the minor page faults (``faults``) of that fastest round. ``sys_ms`` comes
from the kernel's tick accounting (a few ms resolution): it matters, and is exact enough, for
calls of 100 ms and more.
Memory is the resident set's high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs``)
minus the resident set before the call: everything the call allocates, kernels' buffers included.
The timed sections' code is :mod:`tgattn.bench.engine_scaling.sections`; the memory probes are here.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import List

from ..._cli import out_help, runs_dir

FIELDS = ("section", "pattern", "n", "edges", "heads", "dim", "backend", "mode", "threads", "ms", "cpu_ms",
          "sys_ms", "faults", "ns_per_edge_head", "peak_gb", "note")
SECTIONS = ("ratios", "scaling", "threads", "memory", "auto", "floor", "cache", "million")


def probe(n: int, mode: str, backend: str, heads: int, dim: int, model: bool = False, warm: bool = False) -> dict:
    """One call in this process: extra peak resident memory (GB) and wall time (s).

    ``model``: a training step of a 2-layer :class:`tgattn.GraphAttention` model (embed dim
    ``heads * dim``) instead of the attention core. ``warm``: then a second call, timed
    (``warm_seconds`` wall, ``warm_cpu`` thread CPU), with the analysis cached.
    """
    import torch

    from ..measure import os_usage, reset_rss_high_water, rss_high_water_mb, rss_mb

    import gc

    from ... import builders
    from ...nn.attention import GraphAttention
    from ...functional import graph_attention

    torch.set_num_threads(int(os.environ.get("TGATTN_BENCH_THREADS", "1")))
    edge_index = builders.window(n, 64)
    g = torch.Generator().manual_seed(0)
    if model:
        layers = torch.nn.ModuleList([GraphAttention(heads * dim, heads) for _ in range(2)])
        x = torch.randn(n, heads * dim, generator=g)
        opt = torch.optim.SGD(layers.parameters(), lr=1e-3)
    else:
        q, k, v = (torch.randn(n, heads, dim, generator=g).requires_grad_(mode == "fwd+bwd") for _ in range(3))
        grad = torch.randn(n, heads, dim, generator=g) if mode == "fwd+bwd" else None
    def call():
        if model:
            opt.zero_grad(set_to_none=True)
            h = x
            for layer in layers:
                h = layer(h, edge_index)
            h.square().mean().backward()
            opt.step()
        elif mode == "fwd+bwd":
            q.grad = k.grad = v.grad = None
            graph_attention(q, k, v, edge_index, backend=backend).backward(grad)
        else:
            with torch.no_grad():
                graph_attention(q, k, v, edge_index, backend=backend)

    gc.collect()
    reset_rss_high_water()
    base = rss_mb()
    t0 = time.perf_counter()
    call()
    seconds = time.perf_counter() - t0
    peak = (rss_high_water_mb() - base) / 2**10
    if not warm:
        return dict(peak_gb=peak, seconds=seconds, edges=edge_index.shape[1])
    gc.collect()
    (s0, f0), t0, c0 = os_usage(), time.perf_counter(), time.thread_time()
    call()  # the analysis is cached now, as in the scaling section's timed rounds
    wall, cpu, (s1, f1) = time.perf_counter() - t0, time.thread_time() - c0, os_usage()
    return dict(peak_gb=peak, seconds=seconds, edges=edge_index.shape[1], warm_seconds=wall, warm_cpu=cpu,
                warm_sys=s1 - s0, warm_faults=f1 - f0)


def _in_subprocess(n: int, mode: str, backend: str, heads: int, dim: int, model: bool = False, warm: bool = False) -> dict:
    cmd = [sys.executable, "-m", "tgattn.bench.engine_scaling", "--probe", str(n), mode, backend,
           "--heads", str(heads), "--dim", str(dim)] + (["--model"] if model else []) + (["--warm"] if warm else [])
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return dict(error=(done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1][:120])
    return json.loads(done.stdout.strip().splitlines()[-1])


def memory(heads: int, dim: int, points=((32768, "fwd"), (131072, "fwd+bwd")), model: bool = False,
           warm: bool = False) -> List[dict]:
    """Each point in a fresh subprocess, on the backend ``auto`` picks.

    ``ms`` and the peak are the first call's (analysis included); with ``warm``, a second call's
    thread CPU time goes to ``cpu_ms`` and ``ns_per_edge_head`` (as in the scaling section).
    """
    from ...engine import empty_cache
    from .sections import plan_of

    rows = []
    for n, mode in points:
        empty_cache()  # this process's cached blocks would count against the probe's memory
        got = _in_subprocess(n, mode, "auto", heads, dim, model, warm)
        row = dict(section="million" if n >= 2**20 else "memory", pattern="window64", n=n, heads=heads, dim=dim,
                   backend="auto", mode=("train step, 2-layer GraphAttention" if model else mode), threads=1)
        if "error" in got:
            row["note"] = f"failed: {got['error']}"
        else:
            row.update(edges=got["edges"], ms=round(got["seconds"] * 1e3, 1), peak_gb=round(got["peak_gb"], 3))
            row["ns_per_edge_head"] = round(got["seconds"] * 1e9 / (got["edges"] * heads), 3)
            row["note"] = f"auto runs {plan_of('window64', n)}"
            if "warm_cpu" in got:
                row["cpu_ms"] = round(got["warm_cpu"] * 1e3, 1)
                row.update(sys_ms=round(got["warm_sys"] * 1e3, 1), faults=got["warm_faults"])
                row["ns_per_edge_head"] = round(got["warm_cpu"] * 1e9 / (got["edges"] * heads), 3)
                row["note"] += f"; first call {row['ms']} ms, second call {got['warm_seconds'] * 1e3:.1f} ms wall"
        rows.append(row)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="python -m tgattn.bench.engine_scaling", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=[s for s in SECTIONS if s != "million"])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timed rounds (minimum kept)")
    parser.add_argument("--largest", type=int, default=262144, help="largest n of the scaling section")
    parser.add_argument("--out", type=Path, default=runs_dir("engine_scaling"), help=out_help("engine_scaling"))
    parser.add_argument("--probe", nargs=3, metavar=("N", "MODE", "BACKEND"), help=argparse.SUPPRESS)
    parser.add_argument("--model", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--warm", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    # imported once the arguments parse: --help and argument errors answer without torch
    import torch

    from .sections import AUTO_SIZES, auto_vs_best, backward_floor, cache_on_off, ratios, scaling, threads
    from ..report import write_csv

    if args.probe:
        n, mode, backend = args.probe
        print(json.dumps(probe(int(n), mode, backend, args.heads, args.dim, args.model, args.warm)))
        return 0
    torch.set_num_threads(1)
    rows: List[dict] = []
    sizes = [n for n in (1024, 4096, 16384, 65536, 262144, 1048576) if n <= args.largest]
    steps = {
        "ratios": lambda: ratios(4096, args.heads, args.dim, args.rounds),
        "scaling": lambda: scaling(sizes, args.heads, args.dim, args.rounds),
        "threads": lambda: threads((4096, 16384), args.heads, args.dim, args.rounds),
        "memory": lambda: memory(args.heads, args.dim),
        "auto": lambda: auto_vs_best([n for n in AUTO_SIZES if n <= args.largest], args.heads, args.dim, args.rounds),
        "floor": lambda: backward_floor(4096, args.heads, args.dim, args.rounds),
        "cache": lambda: cache_on_off(4096, args.heads, args.dim, args.rounds),
        "million": lambda: memory(args.heads, args.dim, ((2**20, "fwd"), (2**20, "fwd+bwd")), warm=True)
        + memory(4, 16, ((2**20, "train"),), model=True),  # D = 64: the model's activations at D = 512 need > 24 GB
    }
    for section in args.sections:
        rows += steps[section]()
        write_csv(rows, args.out / "engine_scaling.csv", FIELDS)
    load = os.getloadavg()[0]
    print(f"torch {torch.__version__}, {platform.machine()}; H={args.heads}, d={args.dim}, fp32; "
          f"load average {load:.1f} on {os.cpu_count()} cores")
    print(summary(rows))
    print(f"wrote {args.out / 'engine_scaling.csv'}")
    return 0


def summary(rows: List[dict]) -> str:
    """The issue's ratios from the rows: backward / forward, flatness, thread scaling."""
    lines = []
    by = {(r["section"], r["pattern"], r["n"], r["backend"], r["mode"], r["threads"]): r for r in rows}
    for r in rows:
        if r["section"] == "ratios" and r["mode"] == "fwd":
            fb = by.get(("ratios", r["pattern"], r["n"], r["backend"], "fwd+bwd", 1))
            if fb and r.get("cpu_ms") and fb.get("cpu_ms"):
                lines.append(f"{r['pattern']:<11} n={r['n']} {r['backend']:<5} fwd {r['cpu_ms']:.1f} ms, "
                             f"fwd+bwd {fb['cpu_ms']:.1f} ms: backward / forward {(fb['cpu_ms'] - r['cpu_ms']) / r['cpu_ms']:.2f}")
    for backend in ("fused", "tile", "auto"):
        for mode in ("fwd", "fwd+bwd"):
            mine = [r for r in rows if r["section"] == "scaling" and r["backend"] == backend and r["mode"] == mode]
            # all of the thread's CPU time, and its time outside the operating system
            for label, per in (("", [r["ns_per_edge_head"] for r in mine]),
                               (" less sys", [(r["cpu_ms"] - r["sys_ms"]) * 1e6 / (r["edges"] * r["heads"]) for r in mine])):
                if per:
                    lines.append(f"window64 {backend:<5} {mode:<7} ns per edge-head{label} {', '.join(f'{x:.1f}' for x in per)}: "
                                 f"max / min {max(per) / min(per):.2f}")
    for r in rows:
        if r["section"] == "threads" and r["threads"] == 2:
            one = by.get(("threads", r["pattern"], r["n"], r["backend"], r["mode"], 1))
            if one:
                lines.append(f"{r['pattern']:<11} n={r['n']} {r['mode']:<7} 2 threads / 1 thread {r['ms'] / one['ms']:.2f}")
    for r in rows:
        if r["section"] == "auto" and r["backend"] == "auto":
            lines.append(f"{r['pattern']:<11} n={r['n']:<6} {r['mode']:<7} {r['note']}")
    floors = {(r["pattern"], r["n"], r["note"]): r["cpu_ms"] for r in rows if r["section"] == "floor"}
    for (pattern, n, note), ms in floors.items():
        if note != "fused backward":
            lines.append(f"{pattern:<11} n={n} fused backward / {note} {floors[(pattern, n, 'fused backward')] / ms:.2f}")
    on = {(r["pattern"], r["mode"]): r for r in rows if r["section"] == "cache" and r["note"] == "cache on"}
    for r in rows:
        if r["section"] == "cache" and r["note"] == "cache off":
            lines.append(f"{r['pattern']:<11} n={r['n']} {r['mode']:<7} cache on / off "
                         f"{on[(r['pattern'], r['mode'])]['cpu_ms'] / r['cpu_ms']:.2f}")
    for r in rows:
        if r["section"] in ("memory", "million"):
            lines.append(f"window64 n={r['n']} {r['mode']}: extra peak {r.get('peak_gb')} GB, {r.get('ms')} ms {r.get('note') or ''}")
    return "\n".join(lines)
