"""The fast backends never build an ``[E, H, d]`` tensor, edge sets are analysed once, and a
few edges among many nodes cost one int32 row pointer of the nodes and the kernels' outputs,
nothing else of their size."""
import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tgattn import GraphAttention, builders, engine
from tgattn.engine import fused
from tgattn.engine.analysis import analyse
from tgattn.engine.csr import unique_pattern
from tgattn.functional import graph_attention

from engine_helpers import LargestTensor, inputs, max_err

needs_kernel = pytest.mark.skipif(
    not fused.available() and not os.environ.get("CI"), reason="no C++ toolchain here (CI requires one)"
)



def _run(edge_index, n, backend, heads=4, dim=32, bias=False, weights=False):
    q, k, v, grad_out = inputs(n, n, heads=heads, dk=dim, dtype=torch.float32)
    b = torch.randn(edge_index.shape[1], heads, requires_grad=True) if bias else None
    saved = []
    with LargestTensor() as mode, torch.autograd.graph.saved_tensors_hooks(
        lambda t: saved.append(t.numel()) or t, lambda t: t
    ):
        out = graph_attention(q, k, v, edge_index, bias=b, return_weights=weights, backend=backend)
        out = out[0] if weights else out
        out.backward(grad_out)
    return mode.largest, max(saved)


@pytest.mark.parametrize(
    "backend,bias,weights",
    [
        ("tile", False, False),
        ("tile", True, False),
        ("fused", False, False),
        ("fused", True, True),
        ("csr", False, False),
        ("csr", True, True),
    ],
)
def test_fast_backends_hold_no_edge_feature_tensor(backend, bias, weights):
    n, heads, dim = 512, 4, 64
    ei = builders.window(n, 16)
    per_edge_features = ei.shape[1] * heads * dim  # [E, H, d]
    largest, largest_saved = _run(ei, n, backend, heads, dim, bias, weights)
    assert largest_saved <= max(n * heads * dim, ei.shape[1] * heads)  # inputs, outputs or [E, H]
    assert largest <= per_edge_features // 4


def test_dense_backend_holds_no_edge_feature_tensor():
    n, heads, dim = 256, 4, 32
    largest, largest_saved = _run(builders.causal(n), n, "dense", heads, dim)
    assert largest_saved <= n * heads * dim and largest <= n * n * heads * dim // 16


def test_gather_path_does_build_it():
    """The probe can fail: the textbook path gathers ``[E, H, d]``."""
    n, heads, dim = 256, 4, 32
    ei = builders.window(n, 8)
    largest, _ = _run(ei, n, "gather", heads, dim)
    assert largest >= ei.shape[1] * heads * dim


def test_analysis_is_cached_across_layers():
    engine.CACHE.clear()
    ei = builders.window(300, 6)
    x = torch.randn(300, 32)
    layers = [GraphAttention(32, 4) for _ in range(3)]
    for layer in layers:
        x = layer(x, ei)
    assert engine.CACHE.misses == 1 and engine.CACHE.hits == 2
    ei.add_(0)  # an in-place write that changes nothing: still the same edge set
    layers[0](x, ei)
    assert engine.CACHE.misses == 1
    ei[0, -1] -= 1  # a real change: analysed again
    layers[0](x, ei)
    assert engine.CACHE.misses == 2


def test_cache_forgets_dead_edge_sets():
    engine.CACHE.clear()
    ei = builders.window(50, 2)
    engine.structure_of(ei, 50, 50)
    assert len(engine.CACHE.entries) == 1
    del ei
    assert len(engine.CACHE.entries) == 0


class NewStorages(TorchDispatchMode):
    """Records the bytes of every storage an operator returns that none of its inputs holds
    (an allocation: views and in-place results are not counted)."""

    def __init__(self):
        super().__init__()
        self.nbytes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        held = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in held:
                self.nbytes.append(t.untyped_storage().nbytes())
        return out


@pytest.mark.parametrize("order", ["sorted", "unsorted"])
@pytest.mark.parametrize("duplicated", [False, True])
def test_a_few_edges_among_many_nodes_cost_one_row_pointer(order, duplicated):
    # 10 edges over a million nodes: of size n, the analysis (and the CSR backend's pattern
    # without duplicates) allocates the row pointer [n + 1], int32, and nothing else (it made
    # seven arrays of n: counts, prefix sums, first and last keys, masks; then one int64 pointer).
    n = 2**20
    src = torch.tensor([0, 1, 7, 8, 3, 3, n - 2, n - 1, 5, 6])
    dst = torch.tensor([0, 0, 4, 4, 9, 9 if duplicated else 10, 11, 11, n - 1, n - 1])
    edge_index = torch.stack([src, dst])
    if order == "unsorted":
        edge_index = edge_index.flip(1)
    with NewStorages() as mode:
        s = analyse(edge_index, n, n)
        pointers = [s.rowptr] + ([unique_pattern(s)[0]] if duplicated else [])
    assert all(p.dtype == torch.int32 for p in pointers)
    assert sorted(b for b in mode.nbytes if b >= n) == [4 * (n + 1)] * len(pointers)
    # the analysis itself, against the arithmetic of the edges
    key = dst * n + src
    assert torch.equal(s.dst * n + s.src, key.sort().values) and (s.perm is None) == (order == "sorted")
    assert s.duplicates == duplicated and s.intervals == (not duplicated) and s.kind == "general"
    for pointer, rows in zip(pointers, [dst, torch.unique(key) // n]):  # rows of the edges, of the distinct edges
        assert torch.equal(pointer, torch.searchsorted(rows, torch.arange(n + 1)))


def _pages(t: torch.Tensor) -> int:
    """The bytes the fused kernels' cache counts for a tensor of its blocks (whole pages)."""
    return -(-t.untyped_storage().nbytes() // 4096) * 4096


@needs_kernel
def test_the_fused_kernels_on_a_few_edges_among_many_nodes_allocate_their_outputs_only():
    # 10 edges among 2^18 nodes, q / k / v strided as a projection's views: the forward's blocks
    # read K and V in place (each thread copied a head of both: 2 x 8 MB here, 320 MB for
    # GraphAttentionConv(16, 4) on 10^7 nodes), and the backward reads q and dO in place and sums
    # dq where it goes (it copied both and cleared a dq of the head per block). What the cache
    # hands out at once (its peak) is then the outputs alone: out and lse, then dq, dk, dv and
    # the deltas. The transposed pattern is int32 like the row pointer.
    n, heads, dim = 2**18, 2, 8
    g = torch.Generator().manual_seed(0)
    projection = torch.randn(n, 3 * heads * dim, generator=g)
    q, k, v = (t.view(n, heads, dim) for t in projection.split(heads * dim, 1))
    edge_index = torch.randint(0, n, (2, 10), generator=g)
    s = engine.structure_of(edge_index, n, n)
    colptr, row_t, _ = fused.backward_pattern(s, False)
    assert s.rowptr.dtype == colptr.dtype == row_t.dtype == torch.int32

    fused.empty_cache()  # no free blocks (a reused one may be up to 1/8 larger); peak = live
    live = fused.cache_info()["live"]
    out, lse, _ = torch.ops.tgattn_fused.forward(q, k, v, s.rowptr, s.src, None, 0.3, 0.0, 0, False)
    assert fused.cache_info()["peak"] - live == _pages(out) + _pages(lse)

    grad_out = torch.randn(out.shape, generator=g)
    fused.empty_cache()
    live = fused.cache_info()["live"]
    dq, dk, dv, _ = torch.ops.tgattn_fused.backward(
        grad_out, q, k, v, out, lse, None, None, None, s.rowptr, colptr, row_t, None, 0.3, 0.0, 0, False
    )
    delta = _pages(lse)  # [H, n_q], as lse
    assert fused.cache_info()["peak"] - live == _pages(dq) + _pages(dk) + _pages(dv) + delta

    # and the numbers: the textbook path on the same edges
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    ref = graph_attention(q, k, v, edge_index, scale=0.3, backend="gather")
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad_out)
    assert max_err(out, ref) < 1e-6
    for got, want in zip((dq, dk, dv), ref_grads):
        assert max_err(got, want) < 1e-6
