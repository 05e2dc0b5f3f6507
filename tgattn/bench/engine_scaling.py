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
from typing import List, Sequence

import torch

from .._cli import out_help, runs_dir
from .measure import interleaved, os_usage, reset_rss_high_water, rss_high_water_mb, rss_mb
from .patterns import patterns
from .report import write_csv

FIELDS = ("section", "pattern", "n", "edges", "heads", "dim", "backend", "mode", "threads", "ms", "cpu_ms",
          "sys_ms", "faults", "ns_per_edge_head", "peak_gb", "note")
SECTIONS = ("ratios", "scaling", "threads", "memory", "auto", "floor", "cache", "million")
RATIO_PATTERNS = ("window64", "random0.01", "topk0.01")


def _case(pattern: str, n: int, heads: int, dim: int, backend: str):
    """``(edges, {mode: fn})`` for one (pattern, n, backend); inputs made once, analysis warm."""
    from ..functional import graph_attention

    edge_index = patterns()[pattern].make(n)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, heads, dim, generator=g).requires_grad_() for _ in range(3))
    grad = torch.randn(n, heads, dim, generator=g)

    def fwd():
        with torch.no_grad():
            graph_attention(q, k, v, edge_index, backend=backend)

    def fwd_bwd():
        for t in (q, k, v):
            t.grad = None
        graph_attention(q, k, v, edge_index, backend=backend).backward(grad)

    return edge_index.shape[1], {"fwd": fwd, "fwd+bwd": fwd_bwd}


def _plan(pattern: str, n: int) -> str:
    from .. import engine

    ei = patterns()[pattern].make(n)
    return engine.plan(engine.structure_of(ei, n, n))


def _timed_rows(section, cases, rounds, heads, dim, threads=None, slow_s=float("inf")):
    """Rows of interleaved timings of ``cases`` (``(pattern, n, backend, threads) -> (edges, {mode: fn})``)."""
    rows = []
    fns = {key + (mode,): (lambda r, fn=fn: fn()) for key, (_, modes) in cases.items() for mode, fn in modes.items()}
    wall, cpu, system = interleaved(fns, rounds, threads, slow_s)
    for key in fns:
        pattern, n, backend, t, mode = key
        edges = cases[key[:-1]][0]
        # Per edge and head from the thread's CPU time on one thread (robust to a loaded
        # machine), from wall time on more.
        basis = cpu[key] if t == 1 else wall[key]
        rows.append(dict(section=section, pattern=pattern, n=n, edges=edges, heads=heads, dim=dim, backend=backend,
                         mode=mode, threads=t, ms=round(wall[key] * 1e3, 3),
                         cpu_ms=round(cpu[key] * 1e3, 3) if t == 1 else None,
                         sys_ms=round(system[key][0] * 1e3, 3) if t == 1 else None,
                         faults=system[key][1] if t == 1 else None,
                         ns_per_edge_head=round(basis * 1e9 / (edges * heads), 3)))
    return rows


def ratios(n: int, heads: int, dim: int, rounds: int) -> List[dict]:
    """Forward and forward+backward on ``fused`` and ``auto``, one thread."""
    cases = {}
    for pattern in RATIO_PATTERNS:
        for backend in ("fused", "auto"):
            cases[(pattern, n, backend, 1)] = _case(pattern, n, heads, dim, backend)
    rows = _timed_rows("ratios", cases, rounds, heads, dim, {k + (m,): 1 for k in cases for m in ("fwd", "fwd+bwd")})
    for row in rows:
        if row["backend"] == "auto":
            row["note"] = f"auto runs {_plan(row['pattern'], n)}"
    return rows


def scaling(sizes: Sequence[int], heads: int, dim: int, rounds: int, backends=("fused", "tile", "auto")) -> List[dict]:
    """Window 64, one thread: time per edge and head at each n (sizes measured one at a time)."""
    rows = []
    for n in sizes:
        cases = {("window64", n, b, 1): _case("window64", n, heads, dim, b) for b in backends}
        part = _timed_rows("scaling", cases, max(1, rounds if n <= 65536 else rounds // 2), heads, dim,
                           {k + (m,): 1 for k in cases for m in ("fwd", "fwd+bwd")})
        for row in part:
            if row["backend"] == "auto":
                row["note"] = f"auto runs {_plan('window64', n)}"
        rows += part
        del cases
    return rows


def threads(sizes: Sequence[int], heads: int, dim: int, rounds: int) -> List[dict]:
    """1 and 2 threads, interleaved, on the backend ``auto`` picks (wall time)."""
    rows = []
    for n in sizes:
        cases, counts = {}, {}
        made = {pattern: _case(pattern, n, heads, dim, "auto") for pattern in RATIO_PATTERNS}
        # Every 1-thread call of a round, then every 2-thread one: the thread count changes twice
        # a round, not at every call (a pool resized before each call cost the 2-thread calls up
        # to 0.15x of the 1-thread time, measured on top-k 1 %).
        for t in (1, 2):
            for pattern, case in made.items():
                cases[(pattern, n, "auto", t)] = case
                counts.update({(pattern, n, "auto", t, m): t for m in ("fwd", "fwd+bwd")})
        part = _timed_rows("threads", cases, rounds, heads, dim, counts)
        for row in part:
            row["cpu_ms"] = row["sys_ms"] = row["faults"] = None
            row["note"] = f"auto runs {_plan(row['pattern'], n)}"
        rows += part
    return rows


def backward_floor(n: int, heads: int, dim: int, rounds: int) -> List[dict]:
    """Thread CPU time of the fused backward and of its read floors, interleaved, one thread."""
    from .. import engine
    from ..engine import fused
    from ..engine.csr import transpose_pattern

    if not fused.available():
        return []
    ops, rows = torch.ops.tgattn_fused, []
    for pattern in RATIO_PATTERNS:
        edge_index = patterns()[pattern].make(n)
        s = engine.structure_of(edge_index, n, n)
        g = torch.Generator().manual_seed(0)
        q, k, v, go = (torch.randn(n, heads, dim, generator=g) for _ in range(4))
        packed = [t.transpose(0, 1).contiguous().transpose(0, 1) for t in (q, k, v, go)]  # head-major
        out, lse, _ = ops.forward(q, k, v, s.rowptr, s.src, None, dim**-0.5, 0.0, 0, False)
        colptr, row_t, perm_t = fused.backward_pattern(s, False)
        key_ptr, key_rows, _ = transpose_pattern(s)

        def reads(q, k, v, go):
            ops.gather_rows(v, k, s.rowptr, s.src)  # by query
            ops.gather_rows(q, go, key_ptr, key_rows)  # by key

        fns = {"fused backward": lambda r: ops.backward(go, q, k, v, out, lse, None, None, None, s.rowptr, colptr, row_t,
                                                        perm_t, dim**-0.5, 0.0, 0, False),
               "floor caller layout": lambda r: reads(q, k, v, go), "floor head-major": lambda r: reads(*packed)}
        _, cpu, _ = interleaved(fns, rounds, {key: 1 for key in fns})
        for name, seconds in cpu.items():
            rows.append(dict(section="floor", pattern=pattern, n=n, edges=s.num_edges, heads=heads, dim=dim,
                             backend="fused", mode="bwd", threads=1, cpu_ms=round(seconds * 1e3, 3),
                             ns_per_edge_head=round(seconds * 1e9 / (s.num_edges * heads), 3), note=name))
    return rows


CACHE_PATTERNS = ("window64", "bigbird", "dilated32x2", "random0.01", "random0.05", "topk0.01", "topk0.05")


def cache_on_off(n: int, heads: int, dim: int, rounds: int) -> List[dict]:
    """Thread CPU time of ``auto`` (the fused kernel here) with the buffer cache on and off,
    interleaved: each timed call follows an untimed one that fills (on) or drains (off) the cache."""
    from ..engine import cache_info, fused

    if not fused.available():
        return []
    limit, rows = cache_info()["limit"], []

    def fill(state, fn):  # untimed: the cache as the timed call finds it
        torch.ops.tgattn_fused.cache_limit(limit if state == "on" else 0)
        fn()

    for pattern in CACHE_PATTERNS:
        edges, modes = _case(pattern, n, heads, dim, "auto")
        keys = [(mode, state) for mode in modes for state in ("on", "off")]
        try:
            _, cpu, _ = interleaved({key: lambda r, fn=modes[key[0]]: fn() for key in keys}, rounds,
                                    dict.fromkeys(keys, 1),
                                    setup={key: lambda key=key: fill(key[1], modes[key[0]]) for key in keys})
        finally:
            torch.ops.tgattn_fused.cache_limit(limit)
        for (mode, state), seconds in cpu.items():
            rows.append(dict(section="cache", pattern=pattern, n=n, edges=edges, heads=heads, dim=dim,
                             backend="auto", mode=mode, threads=1, cpu_ms=round(seconds * 1e3, 3),
                             ns_per_edge_head=round(seconds * 1e9 / (edges * heads), 3), note=f"cache {state}"))
    return rows


AUTO_SIZES = (1024, 4096, 16384)


def auto_vs_best(sizes: Sequence[int], heads: int, dim: int, rounds: int, slow_s: float = 3.0) -> List[dict]:
    """Each (pattern, n): every backend that runs it as itself, and ``auto``, interleaved, one thread.

    A backend whose first call takes more than ``slow_s`` seconds is timed once (it is not the
    best one); full and causal sets stop at n = 4096 (their dense SDPA calls alone take seconds
    beyond). Rows of ``auto`` note the backend it runs, the best backend and auto / best.
    """
    from .. import engine
    from ..engine.dispatch import ENGINE_BACKENDS

    rows = []
    for name, pattern in patterns().items():
        for n in sizes:
            if name in ("full", "causal") and n > 4096:
                continue
            s = engine.structure_of(pattern.make(n), n, n)
            backends = [b for b in ENGINE_BACKENDS if b != "triton" and engine.plan(s, b) == b] + ["auto"]  # CPU
            cases = {(name, n, b, 1): _case(name, n, heads, dim, b) for b in backends}
            part = _timed_rows("auto", cases, rounds, heads, dim, {k + (m,): 1 for k in cases for m in ("fwd", "fwd+bwd")},
                               slow_s)
            for mode in ("fwd", "fwd+bwd"):
                mine = {r["backend"]: r for r in part if r["mode"] == mode}
                best = min((b for b in mine if b != "auto"), key=lambda b: mine[b]["cpu_ms"])
                mine["auto"]["note"] = (f"auto runs {engine.plan(s)}; best {best}; auto / best "
                                        f"{mine['auto']['cpu_ms'] / mine[best]['cpu_ms']:.2f}")
            rows += part
            del cases
    return rows


def probe(n: int, mode: str, backend: str, heads: int, dim: int, model: bool = False, warm: bool = False) -> dict:
    """One call in this process: extra peak resident memory (GB) and wall time (s).

    ``model``: a training step of a 2-layer :class:`tgattn.GraphAttention` model (embed dim
    ``heads * dim``) instead of the attention core. ``warm``: then a second call, timed
    (``warm_seconds`` wall, ``warm_cpu`` thread CPU), with the analysis cached.
    """
    import gc

    from .. import builders
    from ..nn.attention import GraphAttention
    from ..functional import graph_attention

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
    from ..engine import empty_cache

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
            row["note"] = f"auto runs {_plan('window64', n)}"
            if "warm_cpu" in got:
                row["cpu_ms"] = round(got["warm_cpu"] * 1e3, 1)
                row.update(sys_ms=round(got["warm_sys"] * 1e3, 1), faults=got["warm_faults"])
                row["ns_per_edge_head"] = round(got["warm_cpu"] * 1e9 / (got["edges"] * heads), 3)
                row["note"] += f"; first call {row['ms']} ms, second call {got['warm_seconds'] * 1e3:.1f} ms wall"
        rows.append(row)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tgattn.bench.engine_scaling", description=__doc__,
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


if __name__ == "__main__":
    sys.exit(main())
