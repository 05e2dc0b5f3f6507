"""Engine backends on the corner cases of the contract: bias, empty rows, duplicates, order, shapes."""
import pytest
import torch

from tgattn import builders, engine
from tgattn.functional import graph_attention
from tgattn.verify import random_edges

from engine_helpers import inputs, max_err, oracle

FAST = ["dense", "tile", "fused", "csr"]


def _check(edge_index, n_q, n_k, backend, *, heads=2, dk=6, dv=None, bias=None, scale=None, tol=1e-10):
    q, k, v, grad_out = inputs(n_q, n_k, heads=heads, dk=dk, dv=dv)
    leaves = (q, k, v) if bias is None else (q, k, v, bias)
    out = graph_attention(q, k, v, edge_index, bias=bias, scale=scale, backend=backend)
    ref = oracle(q, k, v, edge_index, bias, scale=scale)
    assert out.shape == ref.shape
    assert max_err(out, ref) <= tol
    grads = torch.autograd.grad(out, leaves, grad_out, allow_unused=True)
    ref_grads = torch.autograd.grad(ref, leaves, grad_out, allow_unused=True)
    for a, b in zip(grads, ref_grads):
        a = torch.zeros_like(b) if a is None else a
        b = torch.zeros_like(a) if b is None else b
        assert max_err(a, b) <= tol


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("n, base", [(20, lambda: builders.window(20, 2)), (4, lambda: builders.full(4))])
def test_duplicated_edges_count_once_per_copy(backend, n, base):
    ei = base()
    ei = torch.cat([ei, ei[:, ::3], ei[:, ::7], ei[:, :3]], dim=1)  # some edges twice, some three times
    assert engine.analyse(ei, n, n).duplicates
    _check(ei, n, n, backend)


@pytest.mark.parametrize("backend", FAST)
def test_duplicates_with_bias(backend):
    ei = builders.causal(12)
    ei = torch.cat([ei, ei[:, ::2]], dim=1)
    bias = torch.randn(ei.shape[1], 2, dtype=torch.float64, requires_grad=True)
    _check(ei, 12, 12, backend, bias=bias)


SCALE_SETS = {
    "causal": (8, lambda: builders.causal(8)),
    "packed-causal": (9, lambda: builders.causal([4, 5])),
    "packed-causal-equal": (8, lambda: builders.causal([4, 4])),
    "full": (6, lambda: builders.full(6)),
    "window": (12, lambda: builders.window(12, 2)),
}


@pytest.mark.parametrize("backend", ["auto", "gather"] + FAST)
@pytest.mark.parametrize("scale", [0.0, -0.0, -0.7])
@pytest.mark.parametrize("name", list(SCALE_SETS))
def test_any_finite_scale(name, scale, backend):
    """Scale 0 (uniform weights over each row) and negative scales, on sets that reach SDPA too:
    its CPU kernels multiply their causal mask by the scale (0 * -inf = NaN) when left alone."""
    n, make = SCALE_SETS[name]
    _check(make(), n, n, backend, scale=scale)
    bias = torch.randn(make().shape[1], 2, dtype=torch.float64, requires_grad=True)
    _check(make(), n, n, backend, bias=bias, scale=scale)


@pytest.mark.parametrize("backend", ["auto", "gather"] + FAST)
@pytest.mark.parametrize("scale", [1e-50, -1e-50, 1e-300])
@pytest.mark.parametrize("name", list(SCALE_SETS))
def test_scale_that_rounds_to_zero_in_float32(name, scale, backend):
    """float32 inputs with a scale below float32's range: 0 where the kernels compute (found by
    tests/test_engine_fuzz.py: SDPA gave NaN on causal sets at scale 6e-84)."""
    n, make = SCALE_SETS[name]
    q, k, v, grad_out = inputs(n, n, heads=2, dk=6, dtype=torch.float32)
    out = graph_attention(q, k, v, make(), scale=scale, backend=backend)
    wide = [t.double() for t in (q, k, v)]
    ref = oracle(*wide, make(), scale=scale)
    assert max_err(out.double(), ref) <= 1e-5
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad_out.double())
    for a, b in zip(grads, ref_grads):
        assert max_err(a.double(), b.double()) <= 1e-5


@pytest.mark.parametrize("backend", ["auto", "gather"] + FAST)
@pytest.mark.parametrize("edges", ["causal", "window", "random"])
def test_inputs_with_any_strides(backend, edges):
    """q, k, v as views with any strides: a transposed (non-contiguous) last dimension, heads
    expanded from one (stride 0), every other row of a larger tensor."""
    n = 40
    ei = {"causal": builders.causal(n), "window": builders.window(n, 3), "random": random_edges(n, n, 0.2, seed=5)}[edges]
    g = torch.Generator().manual_seed(4)
    q_base = torch.randn(n, 6, 2, generator=g, dtype=torch.float64, requires_grad=True)
    k_base = torch.randn(n, 1, 6, generator=g, dtype=torch.float64, requires_grad=True)
    v_base = torch.randn(2 * n, 5, 2, generator=g, dtype=torch.float64, requires_grad=True)
    q, k, v = q_base.transpose(1, 2), k_base.expand(n, 2, 6), v_base[::2].transpose(1, 2)  # [n, 2, 6 | 6 | 5]
    assert q.stride(-1) != 1 and k.stride(1) == 0 and v.stride(-1) != 1
    grad_out = torch.randn(n, 2, 5, generator=g, dtype=torch.float64)
    out = graph_attention(q, k, v, ei, backend=backend)
    ref = oracle(q, k, v, ei)
    assert max_err(out, ref) <= 1e-10
    leaves = (q_base, k_base, v_base)
    for a, b in zip(torch.autograd.grad(out, leaves, grad_out), torch.autograd.grad(ref, leaves, grad_out)):
        assert max_err(a, b) <= 1e-10


@pytest.mark.parametrize("backend", FAST)
def test_unsorted_edges_and_weights_in_caller_order(backend):
    ei = builders.window(30, 3)
    perm = torch.randperm(ei.shape[1], generator=torch.Generator().manual_seed(3))
    shuffled = ei[:, perm]
    bias = torch.randn(ei.shape[1], dtype=torch.float64, requires_grad=True)
    _check(shuffled, 30, 30, backend, bias=bias)
    q, k, v, _ = inputs(30, 30)
    _, w_sorted = graph_attention(q, k, v, ei, return_weights=True, backend=backend)
    _, w_shuffled = graph_attention(q, k, v, shuffled, return_weights=True, backend=backend)
    assert max_err(w_shuffled, w_sorted[perm]) <= 1e-12


@pytest.mark.parametrize("backend", FAST)
def test_bias_minus_inf_empties_rows(backend):
    ei = builders.causal(16)
    bias = torch.zeros(ei.shape[1], 2, dtype=torch.float64)
    bias[ei[1] == 5] = float("-inf")  # query 5 loses every key
    bias[(ei[1] == 9) & (ei[0] < 4), 1] = float("-inf")  # query 9, head 1 loses some keys
    bias.requires_grad_()
    _check(ei, 16, 16, backend, bias=bias)
    q, k, v, _ = inputs(16, 16, heads=2)
    out = graph_attention(q, k, v, ei, bias=bias, backend=backend)
    assert torch.equal(out[5], torch.zeros_like(out[5]))
    out.sum().backward()
    assert torch.equal(q.grad[5], torch.zeros_like(q.grad[5]))


@pytest.mark.parametrize("backend", FAST)
def test_empty_rows_give_zero_output_and_gradient(backend):
    ei = random_edges(50, 50, 0.04, seed=2)
    empty = torch.bincount(ei[1], minlength=50) == 0
    assert empty.any()
    _check(ei, 50, 50, backend)
    q, k, v, _ = inputs(50, 50)
    out = graph_attention(q, k, v, ei, backend=backend)
    out.sum().backward()
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
    assert torch.equal(q.grad[empty], torch.zeros_like(q.grad[empty]))


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("heads", [1, 2, 8])
def test_heads_and_value_dim(backend, heads):
    _check(builders.window(40, 5), 40, 40, backend, heads=heads, dk=4, dv=7)


@pytest.mark.parametrize("backend", FAST)
def test_cross_attention(backend):
    _check(random_edges(23, 61, 0.2), 23, 61, backend, dv=3)
    _check(builders.full(1).new_tensor([[0, 1, 2, 60, 59], [0, 0, 1, 22, 22]]), 23, 61, backend)


@pytest.mark.parametrize("backend", FAST)
def test_cross_attention_full_rectangle(backend):
    ei = builders.from_mask(torch.ones(7, 19, dtype=torch.bool))
    assert engine.analyse(ei, 7, 19).kind == "full"
    _check(ei, 7, 19, backend)


@pytest.mark.parametrize("backend", FAST + ["auto"])
def test_no_edges(backend):
    ei = torch.empty(2, 0, dtype=torch.long)
    q, k, v, _ = inputs(5, 4)
    out, w = graph_attention(q, k, v, ei, return_weights=True, backend=backend)
    assert torch.equal(out, torch.zeros(5, 4, 8, dtype=torch.float64)) and w.shape == (0, 4)
    out.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q))


@pytest.mark.parametrize("backend", FAST)
def test_returned_weights_are_exact_and_differentiable(backend):
    ei = builders.window(25, 3, causal=True)
    q, k, v, _ = inputs(25, 25)
    out, w = graph_attention(q, k, v, ei, return_weights=True, backend=backend)
    out_g, w_g = graph_attention(q, k, v, ei, return_weights=True, backend="gather")
    assert max_err(out, out_g) <= 1e-10 and max_err(w, w_g) <= 1e-10
    probe = torch.randn_like(w)
    grads = torch.autograd.grad((out.sum() + (w * probe).sum()), (q, k, v))
    grads_g = torch.autograd.grad((out_g.sum() + (w_g * probe).sum()), (q, k, v))
    for a, b in zip(grads, grads_g):
        assert max_err(a, b) <= 1e-10


@pytest.mark.parametrize("backend", ["csr", "gather"])
def test_dropout_matches_gather_with_the_same_mask(backend):
    """Dropout keeps E[out] = out and zeroes whole edges; compare with gather under one seed.

    (These two draw the mask with ``torch.rand``; the fused kernel hashes it from a seed and
    has its own oracle test in test_engine_fused.py.)"""
    ei = builders.window(30, 4)
    q, k, v, _ = inputs(30, 30)
    torch.manual_seed(5)
    out = graph_attention(q, k, v, ei, dropout_p=0.3, backend=backend)
    keep = torch.Generator().manual_seed(5)
    mask = (torch.rand(ei.shape[1], 4, generator=keep) >= 0.3).double() / 0.7
    _, w = graph_attention(q, k, v, ei, return_weights=True, backend="gather")
    expected = torch.zeros_like(out).index_add_(0, ei[1], (w * mask).unsqueeze(-1) * v[ei[0]])
    assert max_err(out, expected) <= 1e-10


@pytest.mark.parametrize("backend", FAST)
def test_nan_value_reaches_only_the_queries_that_attend_to_it(backend):
    ei = builders.window(64, 2)
    q, k, v, _ = inputs(64, 64)
    v = v.detach().clone()
    v[40, 0, 0] = float("nan")
    out = graph_attention(q, k, v, ei, backend=backend)
    touched = (torch.arange(64) - 40).abs() <= 2
    assert out[touched].isnan().any(dim=(1, 2)).all()
    assert not out[~touched].isnan().any()



@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("where", ["value", "outside"])
def test_nan_in_one_projection_of_q_k_v(backend, where):
    """q, k, v as column slices of one projection (a conv's): a NaN value reaches only its
    queries; a NaN in columns none of them reads (a root term's) reaches nothing."""
    ei = builders.window(64, 2)
    proj = torch.randn(64, 4 * 16, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    clean = graph_attention(*(t.view(64, 2, 8) for t in proj.split(16, 1)[:3]), ei, backend=backend)
    proj[40, 32 if where == "value" else 48] = float("nan")
    q, k, v = (t.view(64, 2, 8) for t in proj.split(16, 1)[:3])
    out = graph_attention(q, k, v, ei, backend=backend)
    touched = ((torch.arange(64) - 40).abs() <= 2) if where == "value" else torch.zeros(64, dtype=torch.bool)
    assert out[touched].isnan().any(dim=(1, 2)).all()
    assert max_err(out[~touched], clean[~touched]) <= 1e-12


def test_all_finite_decides_as_a_check_of_every_value():
    """Against torch.isfinite over each tensor: a NaN in any view is found, through its base or
    not; a NaN outside the views counts only where the base is summed whole (at most twice
    the views' size), never where a small view of a large base is checked alone."""
    from tgattn.engine.dispatch import all_finite

    def exact(*ts):
        return all(bool(torch.isfinite(t).all()) for t in ts)

    for column in range(48):  # every column of q | k | v | root
        proj = torch.randn(6, 48)
        proj[3, column] = float("inf") if column % 2 else float("nan")
        views = proj.split(12, 1)[:3]
        assert all_finite(*views) == (exact(*views) if column < 36 else False)
    big = torch.randn(100, 48)
    big[50, 0] = float("nan")
    assert all_finite(big[:2, :4], big[:2, 4:8]) and exact(big[:2, :4], big[:2, 4:8])
    q = torch.randn(4, 2, 3)
    assert all_finite(q, q, q) and not all_finite(q, q, torch.tensor([float("nan")]))

def test_float32_window():
    q, k, v, grad_out = inputs(200, 200, dtype=torch.float32)
    ei = builders.window(200, 9)
    ref = oracle(q.double(), k.double(), v.double(), ei)
    for backend in FAST:
        out = graph_attention(q, k, v, ei, backend=backend)
        assert max_err(out.double(), ref) <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["tile", "csr"])
def test_gradcheck(backend):
    ei = torch.cat([builders.window(7, 1), torch.tensor([[6, 0], [0, 6]])], dim=1)  # band + two far edges
    q, k, v, _ = inputs(7, 7, heads=2, dk=3, dv=2)
    bias = torch.randn(ei.shape[1], 2, dtype=torch.float64, requires_grad=True)
    fn = lambda q, k, v, b: graph_attention(q, k, v, ei, bias=b, backend=backend)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v, bias), fast_mode=True)


def test_gradcheck_dense():
    q, k, v, _ = inputs(6, 6, heads=2, dk=3)
    ei = builders.causal([2, 4])
    fn = lambda q, k, v: graph_attention(q, k, v, ei, backend="dense")  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v), fast_mode=True)


@pytest.mark.slow
@pytest.mark.parametrize("cells", [256, 1 << 12])
def test_tile_chunking(monkeypatch, cells):
    """Small chunks: blocks of one head at a time (256 cells) or a few heads at a time."""
    from tgattn.engine import tiles

    monkeypatch.setattr(tiles, "CHUNK_CELLS", cells)
    for ei in (builders.window(40, 4), random_edges(40, 40, 0.2, seed=4)):
        engine.CACHE.clear()
        bias = torch.randn(ei.shape[1], 3, dtype=torch.float64, requires_grad=True)
        _check(ei, 40, 40, "tile", heads=3, bias=bias)
