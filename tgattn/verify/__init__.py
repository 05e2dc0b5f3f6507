"""``python -m tgattn verify``: prove on this machine that graph attention equals dense attention.

The cases run here, each against the dense oracle every test compares with
(:func:`tgattn.reference.dense_attention`).

Each case builds an edge set, runs :func:`tgattn.functional.graph_attention` and the dense
oracle on the same random float64 inputs, and compares outputs and input gradients.

Layer "applications" (with models, lm, hf, distributed, analysis, verify): built on the layers
below, never importing a benchmark or a command line (docs/conventions.md, "Layering").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch
from torch import Tensor

from .. import builders
from ..functional import graph_attention
from ..reference import dense_attention

TOLERANCE = 1e-10  # float64


@dataclass
class Case:
    """An edge set to verify: ``make()`` returns ``(edge_index, n_q, n_k)``."""

    name: str
    make: Callable[[], Tuple[Tensor, int, int]]


def _square(name: str, fn: Callable[[], Tensor], n) -> Case:
    return Case(name, lambda: (fn(), builders._common.total_nodes(n), builders._common.total_nodes(n)))


def random_edges(n_q: int, n_k: int, p: float, seed: int = 0) -> Tensor:
    """A seeded random edge set: each (query, key) pair kept with probability ``p``."""
    g = torch.Generator().manual_seed(seed)
    return builders.from_mask(torch.rand(n_q, n_k, generator=g) < p)


def _topk_edges(n: int, k_top: int, seed: int = 0) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(n, 4, 8, generator=g), torch.randn(n, 4, 8, generator=g)
    return builders.topk(q, k, k_top).edge_index


def _probsparse_edges(n: int, factor: int, seed: int = 0) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(n, 4, 8, generator=g), torch.randn(n, 4, 8, generator=g)
    return builders.probsparse(q, k, factor, causal=True, generator=g).edge_index


def _networkx_edges(n: int, p: float, seed: int = 0) -> Tensor:
    import networkx as nx

    return builders.from_networkx(nx.gnp_random_graph(n, p, seed=seed, directed=True))


CASES: List[Case] = [
    _square("full(64)", lambda: builders.full(64), 64),
    _square("causal(64)", lambda: builders.causal(64), 64),
    _square("window(128, w=8)", lambda: builders.window(128, 8), 128),
    _square("window(128, w=8, causal)", lambda: builders.window(128, 8, causal=True), 128),
    _square("causal(packed [5, 17, 42])", lambda: builders.causal([5, 17, 42]), [5, 17, 42]),
    _square("full(packed [1, 30, 33])", lambda: builders.full([1, 30, 33]), [1, 30, 33]),
    Case("cross random(40 q x 70 k, p=0.1)", lambda: (random_edges(40, 70, 0.1), 40, 70)),
    _square("random(100, p=0.05) with empty rows", lambda: random_edges(100, 100, 0.05, seed=1), 100),
    # pattern families of tgattn.builders (one representative each)
    _square("dilated(96, w=3, dilation=4)", lambda: builders.dilated(96, 3, 4), 96),
    _square("block_local(packed [20, 45], 8, causal)", lambda: builders.block_local([20, 45], 8, causal=True), [20, 45]),
    _square("strided(100, 10, causal)", lambda: builders.strided(100, 10, causal=True), 100),
    _square("fixed(96, block=16, c=2, causal)", lambda: builders.fixed(96, 16, 2, causal=True), 96),
    _square(
        "longformer: window(80, 4) | global [0, 40]",
        lambda: builders.union(builders.window(80, 4), builders.global_tokens(80, [0, 40])),
        80,
    ),
    _square("random(90, r=5)", lambda: builders.random(90, 5, generator=torch.Generator().manual_seed(0)), 90),
    _square(
        "bigbird(packed [30, 70], 3, 2, 3, causal)",
        lambda: builders.bigbird([30, 70], 3, 2, 3, generator=torch.Generator().manual_seed(0), causal=True),
        [30, 70],
    ),
    _square("prefix_lm(64, prefix=16)", lambda: builders.prefix_lm(64, 16), 64),
    Case("cross(30 q x 50 k)", lambda: (builders.cross(30, 50), 30, 50)),
    Case("cross_window(packed [12, 20] x [30, 25], 2)", lambda: (builders.cross_window([12, 20], [30, 25], 2), 32, 55)),
    _square("topk(64, k_top=6) union of heads", lambda: _topk_edges(64, 6), 64),
    _square("probsparse(100, c=2, causal) head union", lambda: _probsparse_edges(100, 2), 100),
    _square("from_networkx(gnp(60, 0.1, directed))", lambda: _networkx_edges(60, 0.1), 60),
]


@dataclass
class Result:
    name: str
    n_q: int
    n_k: int
    edges: int
    out_err: float
    grad_err: float

    @property
    def density(self) -> float:
        return self.edges / max(self.n_q * self.n_k, 1)

    @property
    def passed(self) -> bool:
        return self.out_err <= TOLERANCE and self.grad_err <= TOLERANCE


def check(case: Case, heads: int = 4, dim: int = 16, seed: int = 0, backend: str = "auto") -> Result:
    """Compare graph attention with the dense oracle on one case (float64)."""
    edge_index, n_q, n_k = case.make()
    g = torch.Generator().manual_seed(seed)
    shapes = ((n_q, heads, dim), (n_k, heads, dim), (n_k, heads, dim + 3))
    q, k, v = (torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True) for s in shapes)
    grad_out = torch.randn(n_q, heads, dim + 3, generator=g, dtype=torch.float64)
    out = graph_attention(q, k, v, edge_index, backend=backend)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    ref = dense_attention(q, k, v, builders.to_mask(edge_index, n_q, n_k))
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad_out)
    out_err = (out - ref).abs().max().item() if out.numel() else 0.0
    grad_err = max(((a - b).abs().max().item() if a.numel() else 0.0) for a, b in zip(grads, ref_grads))
    return Result(case.name, n_q, n_k, edge_index.shape[1], out_err, grad_err)


def format_table(results: List[Result]) -> str:
    header = f"{'case':<42} {'nodes':>11} {'edges':>7} {'density':>8} {'max|out|':>9} {'max|grad|':>9}  result"
    lines = [header, "-" * len(header)]
    for r in results:
        nodes = f"{r.n_q}x{r.n_k}" if r.n_q != r.n_k else str(r.n_q)
        lines.append(
            f"{r.name:<42} {nodes:>11} {r.edges:>7} {r.density:>8.3f} {r.out_err:>9.1e} {r.grad_err:>9.1e}  "
            + ("pass" if r.passed else "FAIL")
        )
    return "\n".join(lines)


def main(backend: str = "auto", cases: Optional[List[Case]] = None) -> int:
    """Print the verification table; return 0 when every case passes, 1 otherwise."""
    results = [check(case, backend=backend) for case in (cases or CASES)]
    print(format_table(results))
    failed = sum(not r.passed for r in results)
    print(f"\n{len(results) - failed} passed, {failed} failed (tolerance {TOLERANCE:g}, float64, backend={backend})")
    return 1 if failed else 0
