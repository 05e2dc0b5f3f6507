"""The roads a PyTorch user takes through the engine: inference mode, half precision, autocast,
edge sets changed in place, malformed structures, NaN in a bias or a gradient, double backward.

Every backend is compared with the float64 dense oracle or, for NaN placement, with what the
edge set allows (a NaN reaches the queries it touches and the keys of their edges, no more).
"""
from __future__ import annotations

import pytest
import torch

from tgattn import builders, engine
from tgattn.engine import fused
from tgattn.engine.analysis import Structure
from tgattn.functional import graph_attention

from engine_helpers import inputs, oracle

BACKENDS = ("auto", "dense", "tile", "fused", "csr", "gather")
SETS = {
    "causal": lambda n: builders.causal(n),  # dense (SDPA) under auto
    "window": lambda n: builders.window(n, 4),  # tiles under auto (fill 0.82+) or fused
    "random": lambda n: builders.from_mask(torch.rand(n, n, generator=torch.Generator().manual_seed(1)) < 0.3),
}
# Half precision is computed in float32, so what is left is the rounding of inputs and output.
DTYPE_TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _qkv(n, dtype, seed=0, heads=2, dim=8):
    q, k, v, grad_out = inputs(n, n, heads=heads, dk=dim, dtype=torch.float64, seed=seed)
    cast = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    return cast, grad_out.to(dtype)


@pytest.mark.parametrize("dtype", list(DTYPE_TOL))
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pattern", list(SETS))
def test_every_backend_takes_every_float_dtype(pattern, backend, dtype):
    n = 40
    ei = SETS[pattern](n)
    (q, k, v), grad_out = _qkv(n, dtype)
    out = graph_attention(q, k, v, ei, backend=backend)
    assert out.dtype == dtype
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    # The oracle runs in float64 on the same (rounded) inputs.
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = oracle(q64, k64, v64, ei)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), grad_out.double())
    tol = DTYPE_TOL[dtype]
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    for g, r in zip(grads, ref_grads):
        assert g.dtype == dtype
        torch.testing.assert_close(g.double(), r, atol=4 * tol, rtol=4 * tol)


@pytest.mark.parametrize("mode", ["inference_mode", "no_grad"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_inference_and_no_grad_modes_with_edge_sets_made_inside(mode, backend):
    n = 30
    (q, k, v), _ = _qkv(n, torch.float64, seed=2)
    ref = oracle(q, k, v, builders.window(n, 3, causal=True)).detach()
    context = torch.inference_mode if mode == "inference_mode" else torch.no_grad
    with context():
        ei = builders.window(n, 3, causal=True)  # an inference tensor under inference_mode
        first = graph_attention(q, k, v, ei, backend=backend)
        again = graph_attention(q, k, v, ei, backend=backend)  # the cached analysis
    torch.testing.assert_close(first, ref, atol=1e-10, rtol=0)
    torch.testing.assert_close(again, ref, atol=1e-10, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_around_a_layer(dtype):
    from tgattn import GraphAttention

    torch.manual_seed(0)
    layer = GraphAttention(32, 4)
    x = torch.randn(50, 32)
    for ei in (builders.window(50, 5), builders.causal(50)):
        ref = layer(x, ei)
        with torch.autocast("cpu", dtype=dtype):
            out = layer(x, ei)
        assert out.dtype == dtype  # the output projection ran under autocast
        torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("how", ["numpy", "data", "dlpack"])
def test_an_edge_set_changed_behind_torch_back_is_analysed_again(backend, how):
    n = 12
    (q, k, v), _ = _qkv(n, torch.float64, seed=3)
    ei = builders.window(n, 1)
    graph_attention(q, k, v, ei, backend=backend)  # analysed and cached
    view = {"numpy": lambda: ei.numpy(), "data": lambda: ei.data, "dlpack": lambda: torch.from_dlpack(ei)}[how]()
    view[0, 5] = 9  # no version bump through any of these
    out = graph_attention(q, k, v, ei, backend=backend)
    torch.testing.assert_close(out, oracle(q, k, v, ei.clone()), atol=1e-10, rtol=0)
    view[0, 5] = n  # out of range, written the same way
    with pytest.raises(ValueError, match=f"key/source node {n}"):
        graph_attention(q, k, v, ei, backend=backend)


@pytest.mark.skipif(not fused.available(), reason="fused kernel not compiled")
@pytest.mark.parametrize("layout", ["sorted", "unsorted", "int32", "strided"])
def test_same_edges_in_one_pass_equals_the_gathered_comparison(layout, monkeypatch):
    """The cache's check of a hit (the extension's ``same_edges``) says what comparing gathered copies
    says: the edges as analysed are the same; one changed source or target at the first, a middle or the
    last sorted position is not."""
    from tgattn.engine import analysis

    g = torch.Generator().manual_seed(4)
    ei = torch.randint(0, 30, (2, 9000), generator=g)  # more than one block of the one-pass compare
    if layout == "sorted":
        ei = ei[:, torch.argsort(ei[1] * 30 + ei[0])]
    elif layout == "int32":
        ei = ei.int()
    elif layout == "strided":
        ei = ei.T.contiguous().T  # [2, E] with a row stride of 1
    s = analysis.analyse(ei.long(), 30, 30)
    assert (s.perm is None) == (layout == "sorted")

    def gathered(edges):  # the comparison without the extension
        with monkeypatch.context() as m:
            m.setattr(analysis.native, "available", lambda: False)
            return analysis.same_edges(edges, s)

    assert analysis.same_edges(ei, s) and gathered(ei)
    for pos in (0, 4500, 8999):
        e = pos if s.perm is None else int(s.perm[pos])
        for row in (0, 1):
            changed = ei.clone()
            changed[row, e] = (changed[row, e] + 1) % 30
            assert not analysis.same_edges(changed, s) and not gathered(changed)


@pytest.mark.skipif(not fused.available(), reason="fused kernel not compiled")
def test_same_edges_split_over_threads_finds_a_change_in_any_block():
    """The one-pass check split into blocks over two threads: the same edges pass, a change in the
    first or the last block of a large unsorted set is found."""
    from tgattn.engine import analysis

    ei = torch.randint(0, 500, (2, 300_000), generator=torch.Generator().manual_seed(6))
    s = analysis.analyse(ei, 500, 500)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert analysis.same_edges(ei, s)
        for pos in (10, 299_990):
            changed = ei.clone()
            changed[1, int(s.perm[pos])] = (changed[1, int(s.perm[pos])] + 1) % 500
            assert not analysis.same_edges(changed, s)
    finally:
        torch.set_num_threads(before)


def test_structure_of_validates_before_caching():
    ei = builders.window(10, 1)
    ei[0, 3] = 10**9
    with pytest.raises(ValueError, match="key/source node 1000000000"):
        engine.structure_of(ei, 10, 10)
    (q, k, v), _ = _qkv(10, torch.float64)
    with pytest.raises(ValueError, match="key/source node 1000000000"):
        graph_attention(q, k, v, ei, backend="fused")


@pytest.mark.skipif(not fused.available(), reason="fused kernel not compiled")
@pytest.mark.parametrize("bad", ["col_too_big", "col_negative", "rowptr_end", "rowptr_down"])
def test_fused_kernel_refuses_a_malformed_structure(bad):
    n = 10
    s = engine.analyse(builders.window(n, 1), n, n)
    src, rowptr = s.src.clone(), s.rowptr.clone()
    if bad == "col_too_big":
        src[4] = n
    elif bad == "col_negative":
        src[4] = -1
    elif bad == "rowptr_end":
        rowptr[-1] += 1
    else:
        rowptr[3] = int(rowptr[4]) + 1  # goes down from row 3 to row 4
    broken = Structure(n, n, s.num_edges, None, src, s.dst, rowptr, False)
    (q, k, v), _ = _qkv(n, torch.float32)
    with pytest.raises(RuntimeError, match="tgattn fused"):
        fused.fused_attention(q.detach(), k.detach(), v.detach(), broken, None, 0.5)


@pytest.mark.skipif(not fused.available(), reason="fused kernel not compiled")
def test_fused_kernel_refuses_an_index_out_of_range_in_any_chunk_of_its_check():
    """The index check runs in chunks of 2^16 edges over the threads: a bad key near the end
    (in the second thread's chunks) is found too."""
    n = 3000
    s = engine.analyse(builders.window(n, 30), n, n)
    assert s.num_edges > 2 * 2**16
    src = s.src.clone()
    src[-5] = n
    broken = Structure(n, n, s.num_edges, None, src, s.dst, s.rowptr, False)
    (q, k, v), _ = _qkv(n, torch.float32)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with pytest.raises(RuntimeError, match="holds an index outside"):
            fused.fused_attention(q.detach(), k.detach(), v.detach(), broken, None, 0.5)
    finally:
        torch.set_num_threads(before)


def _nan_places(ei, n, row):
    """Rows of q and of k / v that a NaN at query ``row`` may reach: itself, and its keys."""
    keys = torch.zeros(n, dtype=torch.bool)
    keys[ei[0][ei[1] == row]] = True
    rows = torch.zeros(n, dtype=torch.bool)
    rows[row] = True
    return rows, keys


def _nan_rows(t):
    return t.isnan().flatten(1).any(-1)


def _reaches_within(t, allowed, needed):
    """NaN rows of ``t`` lie inside ``allowed`` and include ``needed``."""
    bad = _nan_rows(t)
    return not bool((bad & ~allowed).any()) and bool(bad[needed].all())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pattern", list(SETS))
def test_nan_in_a_bias_reaches_exactly_its_query(pattern, backend):
    n, row = 30, 17
    ei = SETS[pattern](n)
    (q, k, v), grad_out = _qkv(n, torch.float64, seed=4)
    bias = torch.zeros(ei.shape[1], dtype=torch.float64)
    bias[(ei[1] == row).nonzero()[0]] = float("nan")  # one edge of query `row`
    bias.requires_grad_()
    out = graph_attention(q, k, v, ei, bias=bias, backend=backend)
    rows, keys = _nan_places(ei, n, row)
    assert torch.equal(_nan_rows(out), rows)
    gq, gk, gv, gb = torch.autograd.grad(out, (q, k, v, bias), grad_out)
    # As in the dense oracle, the NaN edge's key always gets NaN; the row's other keys may.
    nan_key = ei[0, (ei[1] == row).nonzero()[0]]
    assert torch.equal(_nan_rows(gq), rows)
    assert _reaches_within(gk, keys, nan_key) and _reaches_within(gv, keys, nan_key)
    assert _reaches_within(gb.unsqueeze(-1), ei[1] == row, (ei[1] == row).nonzero()[0])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pattern", list(SETS))
def test_nan_in_the_upstream_gradient_reaches_exactly_the_keys_of_its_query(pattern, backend):
    n, row = 30, 11
    ei = SETS[pattern](n)
    (q, k, v), grad_out = _qkv(n, torch.float64, seed=5)
    grad_out[row, 0, 0] = float("nan")
    out = graph_attention(q, k, v, ei, backend=backend)
    gq, gk, gv = torch.autograd.grad(out, (q, k, v), grad_out)
    rows, keys = _nan_places(ei, n, row)
    assert torch.equal(_nan_rows(gq), rows)
    assert torch.equal(_nan_rows(gk), keys) and torch.equal(_nan_rows(gv), keys)


def _second_order(attend, q, k, v, bias, grad_out, probe):
    """Gradients of ``<probe, d out / d q · grad_out>`` with respect to every input."""
    out = attend(q, k, v, bias)
    (gq,) = torch.autograd.grad(out, q, grad_out, create_graph=True)
    return torch.autograd.grad((gq * probe).sum(), (q, k, v, bias))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pattern", list(SETS))
def test_double_backward_is_exact_on_every_backend(pattern, backend):
    n = 12
    ei = SETS[pattern](n)
    (q, k, v), grad_out = _qkv(n, torch.float64, seed=6, heads=2, dim=4)
    g = torch.Generator().manual_seed(0)
    bias = torch.randn(ei.shape[1], 2, dtype=torch.float64, generator=g).requires_grad_()
    probe = torch.randn(q.shape, dtype=torch.float64, generator=g)
    got = _second_order(lambda *t: graph_attention(*t[:3], ei, bias=t[3], backend=backend), q, k, v, bias, grad_out, probe)
    ref = _second_order(lambda *t: oracle(*t[:3], ei, bias=t[3]), q, k, v, bias, grad_out, probe)
    for a, r in zip(got, ref):
        torch.testing.assert_close(a, r, atol=1e-10, rtol=1e-10)


def test_double_backward_through_dropout_is_refused_on_dense():
    (q, k, v), grad_out = _qkv(8, torch.float64)
    out = graph_attention(q, k, v, builders.causal(8), dropout_p=0.5, backend="dense")
    with pytest.raises(RuntimeError, match="double backward through attention dropout"):
        torch.autograd.grad(out, q, grad_out, create_graph=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_argument_checks_are_the_same_on_every_backend(backend):
    (q, k, v), _ = _qkv(8, torch.float32)
    ei = builders.causal(8)
    with pytest.raises(ValueError, match="scale must be a finite number"):
        graph_attention(q, k, v, ei, scale=float("nan"), backend=backend)
    for bad in (torch.zeros(ei.shape[1], dtype=torch.long), torch.zeros(ei.shape[1], dtype=torch.bool)):
        with pytest.raises(ValueError, match=f"bias must be a floating-point tensor \\(got {bad.dtype}\\)"):
            graph_attention(q, k, v, ei, bias=bad, backend=backend)
    with pytest.raises(ValueError, match="q, k, v must share a dtype"):
        graph_attention(q, k.double(), v, ei, backend=backend)
    with pytest.raises(ValueError, match="head dim >= 1"):
        graph_attention(q[:, :, :0], k[:, :, :0], v, ei, backend=backend)
