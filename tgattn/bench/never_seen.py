"""``python -m tgattn.bench.never_seen``: an attention call on a never-seen edge set against the
same call on a prepared one and on a cached one, and where the never-seen call's extra time goes.

Mini-batch GNNs and learned selections make a new ``edge_index`` every step, so every step
pays the checks and the analysis (:func:`tgattn.engine.structure_of`) that a prepared edge set
(:func:`tgattn.prepare`) pays once, where it is made; a cached tensor pays a comparison of
contents instead (:func:`~tgattn.engine.analysis.same_edges`), a prepared set nothing.
Cases (``--cases``), each one :func:`~tgattn.functional.graph_attention` forward without
gradient, backend ``auto``:

* ``molecules``: a batch of 128 molecule-sized graphs as :mod:`tgattn.bench.gnn` makes them
  (:func:`tgattn.bench.models.molecule_batches`: rings with random chords, both directions, some
  chords repeating a ring edge), H = 8, d = 8;
* ``molecules_distinct``: the same batch without its repeated edges, in PyG's coalesced order
  (sorted by source), as a batch of real molecules comes: a set without repeated edges is
  also checked for tiles and dense kinds, which a set with repeats skips;
* ``indexer_topk``: :func:`tgattn.builders.indexer_topk` (DeepSeek's lightning indexer, causal)
  over random indexer inputs, ``--n`` = 16,384 tokens, ``--k`` = 256 keys per query, H = 8,
  d = 64: every row has k keys, scattered.

Each round calls, per case, the never-seen call (a fresh copy of the edges, made outside the
timing), the call on the prepared set and the cached call, in turn (interleaved); times are the
thread's CPU time, one thread, minimum over ``--rounds``. The target: never-seen / prepared <= 1.05.
``--parts`` adds, per case, the parts of the never-seen call timed alone the same way: the
validation (``validate``: ``check_edge_index``; the node ids only where the extension's sort does
not check them), the sort, repeat check and row pointer (one call of the extension), the row spans
and kind (``classify``), the plan (tile bound included), the call on an analysed structure
(``run``: the kernel and its checks), and the cached call's comparison (``same_edges``).
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path
from typing import TYPE_CHECKING, List, Optional, Tuple

from .._cli import out_help, positive_int, runs_dir

if TYPE_CHECKING:
    import torch

CASES = ("molecules", "molecules_distinct", "indexer_topk")
FIELDS = ("case", "nodes", "edges", "heads", "dim", "backend", "part", "cpu_ms", "rounds", "note")
TARGET = 1.05


def molecule_edges(distinct: bool = False) -> Tuple[int, torch.Tensor]:
    """``(nodes, edge_index)`` of the first batch :mod:`tgattn.bench.gnn` trains on; ``distinct``:
    without repeated edges, sorted by (source, target) as PyG's ``coalesce`` leaves them."""
    import torch

    from .models import molecule_batches

    x, edge_index, _ = next(molecule_batches(1))
    n = x.shape[0]
    if distinct:
        key = torch.unique(edge_index[0] * n + edge_index[1])  # sorted by source, then target
        edge_index = torch.stack([key // n, key % n])
    return n, edge_index


def indexer_edges(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """The causal lightning-indexer selection of ``k`` keys per query over random inputs (4
    indexer heads of 32 features)."""
    import torch

    from .. import builders

    g = torch.Generator().manual_seed(seed)
    q_index, k_index = torch.randn(n, 4, 32, generator=g), torch.randn(n, 32, generator=g)
    return builders.indexer_topk(q_index, k_index, torch.rand(n, 4, generator=g), k)


def _inputs(n: int, heads: int, dim: int):
    import torch

    g = torch.Generator().manual_seed(1)
    return tuple(torch.randn(n, heads, dim, generator=g) for _ in range(3))


def _parts(n: int, edge_index: torch.Tensor, q, k, v, with_parts: bool):
    """The timed calls of one case: never-seen and cached calls, and (``with_parts``) the steps of
    the never-seen call alone."""
    import torch

    from .. import engine
    from ..edgeset import prepare
    from ..engine import analysis, dispatch
    from ..engine.validate import check_edge_index, check_ranges
    from ..functional import graph_attention

    def call(ei):
        with torch.no_grad():
            graph_attention(q, k, v, ei)

    call(edge_index)  # cached from here on
    prepared = prepare(edge_index, n, n)
    parts = {"never-seen": (edge_index.clone, call), "prepared": (lambda: prepared, call),
             "cached": (lambda: edge_index, call)}
    if not with_parts:
        return parts
    s = engine.structure_of(edge_index, n, n)
    sorted_src, sorted_dst = s.src, s.dst
    spans = analysis._sorted_edges(edge_index, n, n)[5]  # what the extension's sort found besides the order

    def fresh():  # a structure as analyse makes it before the classification, and uncached
        t = analysis.Structure(n, n, s.num_edges, s.perm, sorted_src, sorted_dst, s.rowptr, s.duplicates)
        if spans is not None:
            t.extras["row_spans"] = spans[0]
        return t

    def classify(t):
        analysis._classify(t, None if spans is None else spans[1])

    def classified():
        t = fresh()
        classify(t)
        return t

    def validate(ei):  # as structure_of does it: the extension's sort checks the node ids where it runs
        checked = check_edge_index(ei, n, n, ranges=False)
        if not analysis.counting_sort(checked, n, n):
            check_ranges(checked, n, n)

    def run(_):
        with torch.no_grad():
            dispatch.run(q, k, v, s, None, q.shape[-1] ** -0.5, 0.0, False)

    parts.update({
        "validate": (lambda: edge_index, validate),
        "sort": (lambda: edge_index, lambda ei: analysis._sorted_edges(ei, n, n)),
        "classify": (fresh, classify),
        "plan": (classified, dispatch.plan),
        "analysis": (edge_index.clone, lambda ei: engine.structure_of(ei, n, n)),
        "run": (lambda: None, run),
        "same_edges": (lambda: None, lambda _: analysis.same_edges(edge_index, s)),
    })
    return parts


def measure(case: str, rounds: int, with_parts: bool, n_tokens: int = 16384, k_top: int = 256) -> List[dict]:
    """Rows ``(case, part, cpu_ms)`` of one case, one thread."""
    from .. import engine
    from .measure import interleaved

    if case == "indexer_topk":
        n, edge_index, heads, dim = n_tokens, indexer_edges(n_tokens, k_top), 8, 64
    else:
        (n, edge_index), heads, dim = molecule_edges(case == "molecules_distinct"), 8, 8
    q, k, v = _inputs(n, heads, dim)
    parts = _parts(n, edge_index, q, k, v, with_parts)
    # each part's setup (fresh edges, a fresh structure) runs outside the timing
    _, best, _ = interleaved({name: fn for name, (_, fn) in parts.items()}, rounds, dict.fromkeys(parts, 1),
                             setup={name: setup for name, (setup, _) in parts.items()})
    s = engine.structure_of(edge_index, n, n)
    backend = engine.plan(s)
    base = dict(case=case, nodes=n, edges=edge_index.shape[1], heads=heads, dim=dim, backend=backend, rounds=rounds)
    note = f"k = {k_top}" if case == "indexer_topk" else ("repeated edges" if s.duplicates else "distinct edges")
    return [dict(base, part=part, cpu_ms=round(seconds * 1e3, 4), note=note) for part, seconds in best.items()]


def summary(rows: List[dict], verdicts: bool = True) -> str:
    """Never-seen / prepared per case against the target (and never-seen / cached), then the parts of each case."""
    from .report import SINGLE_REPEAT_NOTE, verdict

    lines = [] if verdicts else [SINGLE_REPEAT_NOTE]
    for case in dict.fromkeys(r["case"] for r in rows):
        mine = {r["part"]: r for r in rows if r["case"] == case}
        new, prepared, cached = (mine[p]["cpu_ms"] for p in ("never-seen", "prepared", "cached"))
        head = mine["cached"]
        ratio = new / prepared
        lines.append(f"{case} (N = {head['nodes']}, E = {head['edges']}, H = {head['heads']}, d = {head['dim']}, "
                     f"{head['note']}, runs {head['backend']}): never-seen {new:.3f} ms / prepared {prepared:.3f} ms "
                     f"= {ratio:.2f}x (<= {TARGET:.2f}) {verdict(ratio, lambda x: x <= TARGET, verdicts)}; "
                     f"cached {cached:.3f} ms ({new / cached:.2f}x)".rstrip())
        extra = [p for p in mine if p not in ("never-seen", "prepared", "cached")]
        if extra:
            lines.append("  " + ", ".join(f"{p} {mine[p]['cpu_ms']:.3f}" for p in extra) + " ms")
            lines.append(f"  never-seen - cached {new - cached:.3f} ms; analysis (structure_of, never-seen) - same_edges "
                         f"{mine['analysis']['cpu_ms'] - mine['same_edges']['cpu_ms']:.3f} ms")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="python -m tgattn.bench.never_seen", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    parser.add_argument("--rounds", type=positive_int, default=200,
                        help="interleaved timed rounds, minimum kept (default: 200; indexer_topk: at most 5)")
    parser.add_argument("--n", type=positive_int, default=16384, help="indexer_topk: tokens (default: 16384)")
    parser.add_argument("--k", type=positive_int, default=256, help="indexer_topk: keys per query (default: 256)")
    parser.add_argument("--parts", action="store_true", help="time the parts of each never-seen call as well")
    parser.add_argument("--out", type=Path, default=runs_dir("never_seen"), help=out_help("never_seen"))
    args = parser.parse_args(argv)
    # imported once the arguments parse: --help and argument errors answer without torch
    import torch

    from .report import write_csv

    rows: List[dict] = []
    rounds = {}
    for case in args.cases:
        rounds[case] = min(args.rounds, 5) if case == "indexer_topk" else args.rounds
        rows += measure(case, rounds[case], args.parts, args.n, args.k)
        write_csv(rows, args.out / "never_seen.csv", FIELDS)
    print(f"torch {torch.__version__}, {platform.machine()}, one thread, thread CPU time; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(summary(rows, verdicts=min(rounds.values()) > 1))
    print(f"wrote {args.out / 'never_seen.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
