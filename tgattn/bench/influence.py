"""``python -m tgattn.bench.influence``: time attention rollout and attention flow on window patterns.

For each n and window radius w, a stack of L layers with random attention on
``window(n, w)`` is analysed: sparse rollout of all rows and of one row; the same rollout
with dense ``[n, n]`` matrices, side by side for the ratio (timed once, and checked equal);
the attention flow into the middle token (its cone size, number of max-flows, time); and
the top 8 of that flow with cut bounds (:func:`tgattn.analysis.flow.top_flow`). Flow for
every output is ``n`` such computations: the table states that estimate, it does not run it.
"""
from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING, Callable, Iterator, List

if TYPE_CHECKING:
    import torch


TOP = 8  # influencers ranked by top_flow


def _best(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def random_layers(n: int, w: int, layers: int, heads: int, seed: int = 0) -> List:
    """``layers`` x ``(window(n, w), softmax of random scores [E, heads])``."""
    import torch

    from .. import builders
    from ..functional import edge_softmax

    g = torch.Generator().manual_seed(seed)
    edge_index = builders.window(n, w)
    return [(edge_index, edge_softmax(torch.randn(edge_index.shape[1], heads, generator=g), edge_index[1], n))
            for _ in range(layers)]


def dense_rollout(stack, n: int) -> torch.Tensor:
    """The textbook rollout with dense matrices, for the side-by-side ratio."""
    import torch

    result = torch.eye(n, dtype=torch.float64)
    for edge_index, alpha in stack:
        a = torch.zeros(n, n, dtype=torch.float64)
        a[edge_index[1], edge_index[0]] = alpha.double().mean(1)
        a = 0.5 * a + 0.5 * torch.eye(n, dtype=torch.float64)
        result = (a / a.sum(1, keepdim=True)) @ result
    return result


def run(sizes, windows, layers: int, heads: int, repeats: int, max_flow_edges: int) -> Iterator[str]:
    """Measure; yield the table as markdown lines, one row per (n, w) as soon as it is measured."""
    from unittest import mock

    import torch

    from ..analysis import attention_flow, attention_rollout
    from ..analysis.flow import flow_cone, top_flow
    from ..analysis.maxflow import Network
    from ..analysis.weights import layer_csr

    yield from [
        f"L = {layers} layers, H = {heads} heads, float64 rollout, torch threads = {torch.get_num_threads()}",
        "",
        "| n | w | rollout, all rows (sparse) | nnz | rollout, all rows (dense) | dense / sparse | rollout, one row | "
        "flow cone V / E | max-flows | flow into one token | flow, all n tokens (estimate) | "
        f"top-{TOP} flow (max-flows) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n in sizes:
        for w in windows:
            stack = random_layers(n, w, layers, heads)
            full = attention_rollout(stack)
            sparse = _best(lambda: attention_rollout(stack), repeats)
            start = time.perf_counter()
            reference = dense_rollout(stack, n)  # timed once: seconds at n = 4096
            dense = time.perf_counter() - start
            if not torch.allclose(full.to_dense(), reference, atol=1e-10, rtol=0):
                raise RuntimeError(f"sparse and dense rollout differ at n={n}, w={w}")
            row = _best(lambda: attention_rollout(stack, queries=n // 2), repeats)
            cone_graph = flow_cone([layer_csr(ei, a, n) for ei, a in stack], n // 2)
            levels = cone_graph.levels
            cone = f"{cone_graph.num_nodes} / {cone_graph.num_edges}"
            if cone_graph.num_edges <= max_flow_edges:
                flow = _best(lambda: attention_flow(stack, n // 2), 1)
                flow_one, flow_all = f"{flow:.2f} s", f"{flow * n / 60:.0f} min"
                with mock.patch.object(Network, "max_flow", autospec=True, side_effect=Network.max_flow) as solved:
                    top = _best(lambda: top_flow(stack, n // 2, TOP), 1)  # counts the compiled max-flows
                flow_top = f"{top:.2f} s ({solved.call_count})"
            else:
                flow_one = flow_all = flow_top = f"skipped (E > {max_flow_edges})"
            yield (
                f"| {n} | {w} | {sparse * 1e3:.0f} ms | {full._nnz()} | {dense * 1e3:.0f} ms | {dense / sparse:.1f}x | "
                f"{row * 1e3:.1f} ms | {cone} | {len(levels[0])} | {flow_one} | {flow_all} | {flow_top} |"
            )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="python -m tgattn.bench.influence", description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 4096], help="sequence lengths n")
    parser.add_argument("--windows", type=int, nargs="+", default=[8, 16, 64], help="window radii w")
    parser.add_argument("--layers", type=int, default=4, help="layers L (default: 4)")
    parser.add_argument("--heads", type=int, default=4, help="heads H (default: 4)")
    parser.add_argument("--repeats", type=int, default=3, help="sparse rollout timings: best of (default: 3)")
    parser.add_argument("--max-flow-edges", type=int, default=20000, help="skip flow on larger cones (default: 20000)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")
    args = parser.parse_args(argv)
    # imported once the arguments parse: --help and argument errors answer without torch
    import torch

    torch.set_num_threads(args.threads)
    for line in run(args.sizes, args.windows, args.layers, args.heads, args.repeats, args.max_flow_edges):
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
