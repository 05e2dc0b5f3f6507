"""Checks shared by the builder tests: edge-set invariants and equality with dense attention."""
from typing import Callable, Optional, Sequence

import torch

from tgattn import GraphAttention, builders
from tgattn.functional import graph_attention
from tgattn.reference import dense_attention

TOL = dict(rtol=0.0, atol=1e-10)  # float64


def ij(n_q: int, n_k: Optional[int] = None):
    """Query and key index grids ``i [Nq, 1]``, ``j [1, Nk]`` for writing a rule as arithmetic."""
    n_k = n_q if n_k is None else n_k
    return torch.arange(n_q).unsqueeze(1), torch.arange(n_k).unsqueeze(0)


def block_diag(masks: Sequence[torch.Tensor]) -> torch.Tensor:
    """Block-diagonal boolean mask of per-sequence masks (the twin of a packed batch)."""
    if not masks:
        return torch.zeros(0, 0, dtype=torch.bool)
    return torch.block_diag(*[m.to(torch.uint8) for m in masks]).bool()


def assert_edge_set(edge_index: torch.Tensor, expected_mask: torch.Tensor) -> None:
    """``edge_index`` is long, [2, E], sorted by (target, source), unique, and equals the mask."""
    assert edge_index.dtype == torch.long and edge_index.dim() == 2 and edge_index.shape[0] == 2
    n_q, n_k = expected_mask.shape
    if edge_index.numel():
        code = edge_index[1] * max(n_k, 1) + edge_index[0]
        assert bool((code[1:] > code[:-1]).all()), "edges must be strictly sorted by (target, source)"
    assert edge_index.shape[1] == int(expected_mask.sum())
    assert torch.equal(builders.to_mask(edge_index, n_q, n_k), expected_mask)


def assert_matches_dense(edge_index: torch.Tensor, n_q: int, n_k: Optional[int] = None, heads: int = 3, seed: int = 0):
    """graph_attention over ``edge_index`` equals dense attention under ``to_mask``: output and gradients."""
    n_k = n_q if n_k is None else n_k
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n_q, heads, 5, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(n_k, heads, 5, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(n_k, heads, 4, generator=g, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(n_q, heads, 4, generator=g, dtype=torch.float64)
    out = graph_attention(q, k, v, edge_index)
    ref = dense_attention(q, k, v, builders.to_mask(edge_index, n_q, n_k))
    torch.testing.assert_close(out, ref, **TOL)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad_out)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, **TOL)


def assert_layer_matches_dense(edge_index: torch.Tensor, n: int, heads: int = 2, seed: int = 0):
    """The GraphAttention layer (both backends) equals projections + dense attention + W_O."""
    torch.manual_seed(seed)
    layer = GraphAttention(8, heads).double()
    x = torch.randn(n, 8, dtype=torch.float64, requires_grad=True)
    q, k, v = layer.project(x)
    ref = layer.out_proj(dense_attention(q, k, v, builders.to_mask(edge_index, n, n)).reshape(n, 8))
    (ref_grad,) = torch.autograd.grad(ref.square().sum(), x)
    for backend in ("auto", "message_passing"):
        out = layer(x, edge_index, backend=backend)
        torch.testing.assert_close(out, ref, **TOL)
        (grad,) = torch.autograd.grad(out.square().sum(), x)
        torch.testing.assert_close(grad, ref_grad, **TOL)


def packed_twin(lengths: Sequence[int], rule: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """Twin of a packed batch: ``rule(L)`` is the ``[L, L]`` mask of one sequence."""
    return block_diag([rule(length) for length in lengths])
