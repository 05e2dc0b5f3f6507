"""graph_attention against the dense oracle: outputs, gradients, weights, errors."""
import math

import pytest
import torch

from tgattn import builders
from tgattn.functional import graph_attention
from tgattn.reference import dense_attention
from tgattn.verify import random_edges

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def _inputs(nq, nk, h, dk, dv, dtype):
    make = lambda *s: torch.randn(*s, dtype=dtype, requires_grad=True)  # noqa: E731
    return make(nq, h, dk), make(nk, h, dk), make(nk, h, dv)


EDGE_SETS = {
    "full": lambda: (builders.full(13), 13, 13),
    "causal": lambda: (builders.causal(13), 13, 13),
    "window": lambda: (builders.window(20, 3), 20, 20),
    "window-causal": lambda: (builders.window(20, 3, causal=True), 20, 20),
    "packed": lambda: (builders.causal([3, 1, 7]), 11, 11),
    "cross": lambda: (random_edges(6, 9, 0.4, 0), 6, 9),
    "random-with-empty-rows": lambda: (random_edges(15, 15, 0.1, 1), 15, 15),
}


def _assert_matches_dense(edge_index, nq, nk, heads, dk, dv, dtype, bias=None, dense_bias=None):
    q, k, v = _inputs(nq, nk, heads, dk, dv, dtype)
    out = graph_attention(q, k, v, edge_index, bias=bias)
    ref = dense_attention(q, k, v, builders.to_mask(edge_index, nq, nk), bias=dense_bias)
    tol = TOL[dtype]
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    grad = torch.randn_like(out)
    g1 = torch.autograd.grad(out, (q, k, v), grad)
    g2 = torch.autograd.grad(ref, (q, k, v), grad)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("heads", [1, 2, 8])
@pytest.mark.parametrize("name", list(EDGE_SETS))
def test_equals_dense(name, heads, dtype):
    edge_index, nq, nk = EDGE_SETS[name]()
    _assert_matches_dense(edge_index, nq, nk, heads, 4, 6, dtype)  # d_v != d_k


@pytest.mark.parametrize("per_head", [False, True])
def test_bias_with_minus_inf_equals_dense(per_head):
    edge_index, n = builders.window(12, 2), 12
    shape = (edge_index.shape[1], 3) if per_head else (edge_index.shape[1],)
    bias = torch.randn(*shape, dtype=torch.float64)
    bias[::4] = float("-inf")
    dense = torch.zeros(3, n, n, dtype=torch.float64)
    dense[:, edge_index[1], edge_index[0]] = bias.T if per_head else bias
    _assert_matches_dense(edge_index, n, n, 3, 4, 4, torch.float64, bias=bias, dense_bias=dense)


def test_weights_in_edge_order_and_normalised():
    edge_index = builders.causal(6)
    perm = torch.randperm(edge_index.shape[1])
    q, k, v = _inputs(6, 6, 2, 4, 4, torch.float64)
    _, w_sorted = graph_attention(q, k, v, edge_index, return_weights=True)
    out, w_perm = graph_attention(q, k, v, edge_index[:, perm], return_weights=True)
    torch.testing.assert_close(w_perm, w_sorted[perm])
    sums = torch.zeros(6, 2, dtype=torch.float64).index_add_(0, edge_index[1], w_sorted)
    torch.testing.assert_close(sums, torch.ones(6, 2, dtype=torch.float64))
    _, dense_w = dense_attention(q, k, v, builders.to_mask(edge_index, 6), return_weights=True)
    torch.testing.assert_close(w_sorted, dense_w[:, edge_index[1], edge_index[0]].T)


def test_duplicate_edges_count_once_per_copy():
    edge_index = builders.full(4)
    doubled = torch.cat([edge_index, edge_index[:, :3]], dim=1)  # edges (0,0), (1,0), (2,0) twice
    q, k, v = _inputs(4, 4, 2, 4, 4, torch.float64)
    bias = torch.zeros(4, 4, dtype=torch.float64)
    bias[0, :3] = math.log(2)  # two copies weigh like one edge with +log 2
    out = graph_attention(q, k, v, doubled)
    torch.testing.assert_close(out, dense_attention(q, k, v, None, bias=bias), rtol=0, atol=1e-12)


def test_no_edges_gives_zeros():
    q, k, v = _inputs(3, 4, 2, 4, 5, torch.float64)
    out, w = graph_attention(q, k, v, torch.empty(2, 0, dtype=torch.long), return_weights=True)
    assert torch.equal(out, torch.zeros(3, 2, 5, dtype=torch.float64)) and w.shape == (0, 2)
    out.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q))


def test_empty_query_set():
    q, k, v = _inputs(0, 4, 2, 4, 4, torch.float64)
    assert graph_attention(q, k, v, torch.empty(2, 0, dtype=torch.long)).shape == (0, 2, 4)


def test_gradcheck_small():
    edge_index = torch.tensor([[0, 1, 2, 0, 2, 1], [0, 0, 1, 2, 2, 2]])
    q, k, v = _inputs(3, 3, 2, 3, 2, torch.float64)
    bias = torch.randn(6, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *t: graph_attention(*t[:3], edge_index, bias=t[3]), (q, k, v, bias))


def test_scale_argument():
    q, k, v = _inputs(5, 5, 1, 4, 4, torch.float64)
    edge_index = builders.full(5)
    torch.testing.assert_close(
        graph_attention(q, k, v, edge_index, scale=0.1), dense_attention(q, k, v, None, scale=0.1), rtol=0, atol=1e-12
    )


def test_dropout_zeroes_weights_and_rescales():
    q, k, v = (torch.randn(50, 1, 4, dtype=torch.float64) for _ in range(3))
    v = torch.ones_like(v)
    out = graph_attention(q, k, v, builders.full(50), dropout_p=0.5)
    # With v = 1 each output is sum_j a_ij m_ij / (1 - p): 1 on average, not exactly 1.
    assert not torch.allclose(out, torch.ones_like(out))
    assert abs(out.mean().item() - 1.0) < 0.1


def test_nan_propagates_only_to_touched_queries():
    q, k, v = _inputs(4, 4, 1, 2, 2, torch.float64)
    with torch.no_grad():
        v[3] = float("nan")
    out = graph_attention(q, k, v, builders.causal(4))
    assert torch.isfinite(out[:3]).all() and torch.isnan(out[3]).all()


@pytest.mark.parametrize(
    "edge_index, match",
    [
        (torch.zeros(3, 2, dtype=torch.long), r"shape \[2, E\]"),
        (torch.zeros(2, 2), "dtype"),
        (torch.tensor([[0, 5], [0, 1]]), "key/source node 5, but there are 4"),
        (torch.tensor([[0, 1], [0, 7]]), "query/target node 7, but there are 3"),
        (torch.tensor([[0, -1], [0, 1]]), "negative node id -1"),
    ],
)
def test_bad_edge_index_is_named(edge_index, match):
    q, k, v = torch.randn(3, 2, 4), torch.randn(4, 2, 4), torch.randn(4, 2, 4)
    with pytest.raises(ValueError, match=match):
        graph_attention(q, k, v, edge_index)


@pytest.mark.parametrize(
    "shapes, match",
    [
        (((3, 3, 4), (3, 2, 4), (3, 2, 4)), r"multiple of k's.*got q 3, k 2 and v 2 heads"),
        (((3, 2, 4), (3, 1, 4), (3, 2, 4)), r"v must have k's.*got q 2, k 1 and v 2 heads"),
        (((3, 2, 4), (3, 2, 5), (3, 2, 4)), "same head dim"),
        (((3, 2, 4), (3, 2, 4), (2, 2, 4)), "same number of nodes"),
        (((3, 8), (3, 2, 4), (3, 2, 4)), r"q must have shape \[N, H, d\]"),
    ],
)
def test_mismatched_shapes_are_named(shapes, match):
    q, k, v = (torch.randn(*s) for s in shapes)
    with pytest.raises(ValueError, match=match):
        graph_attention(q, k, v, builders.full(3))


def test_bad_bias_dropout_and_backend():
    q = k = v = torch.randn(3, 2, 4)
    ei = builders.full(3)
    with pytest.raises(ValueError, match=r"bias must have shape \[E\] or \[E, H\] = \[9, 2\]"):
        graph_attention(q, k, v, ei, bias=torch.zeros(8))
    with pytest.raises(ValueError, match=r"\+inf"):
        graph_attention(q, k, v, ei, bias=torch.full((9,), float("inf")))
    with pytest.raises(ValueError, match="dropout_p must be in"):
        graph_attention(q, k, v, ei, dropout_p=1.5)
    with pytest.raises(ValueError, match="backend must be one of"):
        graph_attention(q, k, v, ei, backend="nope")


def _sdpa_accepts_mask(q_dtype, mask_dtype) -> bool:
    """Whether scaled_dot_product_attention takes a float attn_mask of this dtype with q's."""
    import torch.nn.functional as F

    probe = torch.zeros(1, 1, 3, 4, dtype=q_dtype)  # [B, H, L, d]
    try:
        F.scaled_dot_product_attention(probe, probe, probe, attn_mask=torch.zeros(3, 3, dtype=mask_dtype))
        return True
    except RuntimeError:
        return False


def _on_cells(ei, n, values, fill):
    """Per-edge values ``[E, H]`` as dense ``[H, n, n]`` cells (rows = queries), ``fill`` elsewhere."""
    cells = torch.full((n, n, values.shape[1]), fill, dtype=values.dtype)
    return cells.index_put((ei[1], ei[0]), values).permute(2, 0, 1)


# float64 oracles of the two per-edge arguments: an additive score bias, a factor on each weight
EDGE_TENSOR_ORACLES = {
    "bias": lambda q, k, v, ei, n, b: dense_attention(q, k, v, builders.to_mask(ei, n, n), bias=_on_cells(ei, n, b, float("-inf"))),
    "edge_scale": lambda q, k, v, ei, n, m: torch.einsum(
        "hij,jhd->ihd",
        (torch.einsum("ihd,jhd->hij", q, k) / 2.0).masked_fill(~builders.to_mask(ei, n, n), float("-inf")).softmax(-1)
        * _on_cells(ei, n, m, 0.0),  # scale 1 / sqrt(4)
        v,
    ),
}


@pytest.mark.parametrize("backend", ["auto", "gather", "dense", "tile", "fused", "csr"])
@pytest.mark.parametrize("edges", ["causal", "window"])
@pytest.mark.parametrize("name", ["bias", "edge_scale"])
def test_edge_tensor_dtype_follows_sdpa_float_mask(name, edges, backend):
    """A bias or edge_scale of another dtype than q's: accepted exactly where
    scaled_dot_product_attention accepts such a float attn_mask (q's dtype or float32), one
    ValueError naming both dtypes elsewhere, on every backend (a float64 edge_scale with float32
    q raised RuntimeErrors inside gather / csr). An accepted one gives the float64 oracle's
    values and gets its gradient in its own dtype."""
    floats = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
    ei = builders.causal(6) if edges == "causal" else builders.window(10, 2)
    n = int(ei.max()) + 1
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(n, 2, 4, generator=g, dtype=torch.float64) for _ in range(3)]
    draw = torch.randn if name == "bias" else torch.rand  # scores, or factors in [0, 1)
    edge64 = draw(ei.shape[1], 2, generator=g, dtype=torch.float64)
    tol = lambda *dtypes: max({torch.float64: 1e-10, torch.float32: 1e-5}.get(d, 2e-2) for d in dtypes)  # noqa: E731
    for q_dtype in floats:
        for e_dtype in floats:
            q, k, v = (t.to(q_dtype, copy=True).requires_grad_() for t in base)
            edge = edge64.to(e_dtype, copy=True).requires_grad_()
            if not _sdpa_accepts_mask(q_dtype, e_dtype):
                with pytest.raises(ValueError, match=name) as err:
                    graph_attention(q, k, v, ei, **{name: edge}, backend=backend)
                assert str(e_dtype) in str(err.value) and str(q_dtype) in str(err.value)
                continue
            out = graph_attention(q, k, v, ei, **{name: edge}, backend=backend)
            leaves = [t.detach().double().requires_grad_() for t in (q, k, v, edge)]
            ref = EDGE_TENSOR_ORACLES[name](*leaves[:3], ei, n, leaves[3])
            assert out.dtype == q_dtype
            torch.testing.assert_close(out.double(), ref, rtol=tol(q_dtype), atol=tol(q_dtype))
            out.double().sum().backward()
            ref.sum().backward()
            assert edge.grad.dtype == e_dtype
            for t, leaf in zip((q, k, v, edge), leaves):
                torch.testing.assert_close(t.grad.double(), leaf.grad, rtol=tol(q_dtype, t.dtype), atol=tol(q_dtype, t.dtype))
