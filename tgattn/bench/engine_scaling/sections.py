"""The timed sections of :mod:`tgattn.bench.engine_scaling` (``ratios``, ``scaling``, ``threads``,
``auto``, ``floor``, ``cache``): each builds its calls and times them interleaved
(:func:`tgattn.bench.measure.interleaved`), and returns rows of ``engine_scaling.csv``.
"""
from __future__ import annotations

from typing import List, Sequence

import torch

from ..measure import interleaved
from ..patterns import patterns

RATIO_PATTERNS = ("window64", "random0.01", "topk0.01")


def _case(pattern: str, n: int, heads: int, dim: int, backend: str):
    """``(edges, {mode: fn})`` for one (pattern, n, backend); inputs made once, analysis warm."""
    from ...functional import graph_attention

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


def plan_of(pattern: str, n: int) -> str:
    """The backend ``auto`` runs for ``pattern`` at ``n`` tokens.

    Example:
        >>> plan_of("window64", 1024) in ("dense", "tile", "fused", "csr")
        True
    """
    from ... import engine

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
            row["note"] = f"auto runs {plan_of(row['pattern'], n)}"
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
                row["note"] = f"auto runs {plan_of('window64', n)}"
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
            row["note"] = f"auto runs {plan_of(row['pattern'], n)}"
        rows += part
    return rows


def backward_floor(n: int, heads: int, dim: int, rounds: int) -> List[dict]:
    """Thread CPU time of the fused backward and of its read floors, interleaved, one thread."""
    from ... import engine
    from ...engine import fused
    from ...engine.csr import transpose_pattern

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
    from ...engine import cache_info, fused

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
    from ... import engine
    from ...engine.dispatch import ENGINE_BACKENDS

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
