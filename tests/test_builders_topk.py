"""topk: per-head selection equals per-head masked dense attention (forward and gradient)."""
import pytest
import torch

from builder_checks import TOL, assert_edge_set
from tgattn import GraphAttention, builders
from tgattn.functional import graph_attention
from tgattn.reference import dense_attention


def qkv(n_q, n_k, heads=3, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    shapes = ((n_q, heads, 6), (n_k, heads, 6), (n_k, heads, 5))
    return [torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=requires_grad) for s in shapes]


def topk_twin(q, k, k_top, base_mask):
    """Per head h and query i: the k_top largest q_i . k_j among allowed j (all of them if fewer)."""
    scores = torch.einsum("ihd,jhd->hij", q, k).masked_fill(~base_mask, float("-inf"))  # [H, Nq, Nk]
    mask = torch.zeros_like(scores, dtype=torch.bool)
    if k_top and scores.shape[2]:
        mask.scatter_(2, scores.topk(k_top, dim=2).indices, True)
    return mask & base_mask


@pytest.mark.parametrize("k_top", [0, 1, 3, 9])
@pytest.mark.parametrize("n_q,n_k", [(0, 0), (1, 1), (1, 9), (9, 9), (5, 12), (12, 10)])
def test_topk_full_base(n_q, n_k, k_top):
    q, k, _ = qkv(n_q, n_k)
    if k_top > n_k:
        with pytest.raises(ValueError, match=f"k_top must be <= the number of keys {n_k} \\(got {k_top}\\)"):
            builders.topk(q, k, k_top)
        return
    sel = builders.topk(q, k, k_top)
    twin = topk_twin(q, k, k_top, torch.ones(n_q, n_k, dtype=torch.bool))
    assert torch.equal(builders.head_masks(sel, n_q, n_k), twin)
    assert_edge_set(sel.edge_index, twin.any(0))
    assert sel.bias.shape == (sel.edge_index.shape[1], 3) and bool(((sel.bias == 0) | (sel.bias == float("-inf"))).all())
    assert int((sel.bias == 0).sum()) == n_q * k_top * 3


@pytest.mark.parametrize("base_fn,n", [
    (lambda: builders.causal(11), 11),
    (lambda: builders.window(14, 2), 14),
    (lambda: builders.full([4, 0, 1, 7]), 12),
    (lambda: builders.random(10, 4, generator=torch.Generator().manual_seed(2)), 10),
])
def test_topk_within_base(base_fn, n):
    base = base_fn()
    q, k, _ = qkv(n, n, seed=1)
    sel = builders.topk(q, k, 3, base=base)
    twin = topk_twin(q, k, 3, builders.to_mask(base, n, n))
    assert torch.equal(builders.head_masks(sel, n, n), twin)
    assert_edge_set(sel.edge_index, twin.any(0))


def test_topk_accepts_any_order_and_duplicates():
    base = builders.window(9, 2)
    shuffled = torch.cat([base[:, torch.randperm(base.shape[1])], base[:, :5]], dim=1)
    q, k, _ = qkv(9, 9)
    a, b = builders.topk(q, k, 2, base=base), builders.topk(q, k, 2, base=shuffled)
    assert torch.equal(a.edge_index, b.edge_index) and torch.equal(a.bias, b.bias)


@pytest.mark.parametrize("n_q,n_k,k_top,base", [(10, 10, 3, None), (7, 13, 4, None), (12, 12, 2, "causal")])
def test_topk_attention_equals_per_head_dense(n_q, n_k, k_top, base):
    q, k, v = qkv(n_q, n_k, seed=3, requires_grad=True)
    base_edges = builders.causal(n_q) if base else None
    sel = builders.topk(q, k, k_top, base=base_edges)
    assert not sel.bias.requires_grad  # the selection is not differentiable
    mask = builders.head_masks(sel, n_q, n_k)  # [H, Nq, Nk]
    out = graph_attention(q, k, v, sel.edge_index, bias=sel.bias)
    ref = dense_attention(q, k, v, mask)
    torch.testing.assert_close(out, ref, **TOL)
    grad_out = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), grad_out), torch.autograd.grad(ref, (q, k, v), grad_out)):
        torch.testing.assert_close(a, b, **TOL)


def test_topk_layer_equals_per_head_dense():
    torch.manual_seed(0)
    layer = GraphAttention(12, 3).double()
    x = torch.randn(15, 12, dtype=torch.float64, requires_grad=True)
    q, k, v = layer.project(x)
    sel = builders.topk(q, k, 4, base=builders.causal(15))
    ref = layer.out_proj(dense_attention(q, k, v, builders.head_masks(sel, 15, 15)).reshape(15, 12))
    (ref_grad,) = torch.autograd.grad(ref.square().sum(), x)
    for backend in ("auto", "message_passing"):
        out = layer(x, sel.edge_index, edge_bias=sel.bias, backend=backend)
        torch.testing.assert_close(out, ref, **TOL)
        (grad,) = torch.autograd.grad(out.square().sum(), x)
        torch.testing.assert_close(grad, ref_grad, **TOL)


def test_topk_errors():
    q, k, _ = qkv(4, 4)
    with pytest.raises(ValueError, match=r"k_top must be >= 0 \(got -1\)"):
        builders.topk(q, k, -1)
    with pytest.raises(ValueError, match="shapes"):
        builders.topk(q, k[:, :2], 1)
    with pytest.raises(ValueError, match="key/source node 7"):
        builders.topk(q, k, 1, base=torch.tensor([[7], [0]]))
