"""The fused kernel's FlashAttention-2-style backward: the forward saves the log-sum-exp,
the backward recomputes the weights, and nothing of size [H, E] is kept or made unless asked for."""
import os

import pytest
import torch

from tgattn import builders, engine
from tgattn.engine import fused
from tgattn.engine.tiles import fill_bound, tile_layout
from tgattn.functional import graph_attention
from tgattn.verify import random_edges

from engine_helpers import LargestTensor, inputs, max_err, oracle

pytestmark = pytest.mark.skipif(
    not fused.available() and not os.environ.get("CI"), reason="no C++ toolchain here (CI requires one)"
)



def test_forward_saves_the_log_sum_exp_of_each_row():
    n, heads = 40, 3
    ei = random_edges(n, n, 0.2, seed=0)
    ei = ei[:, ei[1] != 7]  # query 7 has no edge: its log-sum-exp is -inf
    q, k, v, _ = inputs(n, n, heads=heads, dk=5)
    bias = torch.randn(ei.shape[1], heads, dtype=torch.float64)
    bias[ei[1] == 3] = float("-inf")  # every edge of query 3 masked: -inf too
    s = engine.structure_of(ei, n, n)
    sorted_bias = bias if s.perm is None else bias[s.perm]
    _, lse, w = torch.ops.tgattn_fused.forward(q, k, v, s.rowptr, s.src, sorted_bias, 0.5, 0.0, 0, False)
    assert w.numel() == 0  # weights not asked for: not written
    scores = torch.full((heads, n, n), float("-inf"), dtype=torch.float64)
    scores[:, ei[1], ei[0]] = torch.einsum("ehd,ehd->he", q[ei[1]], k[ei[0]]) * 0.5 + bias.T
    ref = torch.logsumexp(scores, -1)  # [H, n]
    empty = torch.isneginf(ref)
    assert bool(empty[:, 7].all()) and bool(empty[:, 3].all())
    assert torch.equal(torch.isneginf(lse), empty) and max_err(lse[~empty], ref[~empty]) < 1e-12


@pytest.mark.parametrize("heads", [1, 2, 3, 8])
def test_backward_with_key_blocks_sharing_queries(heads):
    """Below 8 heads, with >= 4 edges per query row per block, the keys of a head are split into blocks
    that each sum their own dq (here about 15 edges per row: 3 blocks for 1 and 2 heads, 2 for 3)."""
    ei = random_edges(60, 50, 0.3, seed=heads)
    q, k, v, grad_out = inputs(60, 50, heads=heads, dk=9, dv=4)
    bias = torch.randn(ei.shape[1], 1, dtype=torch.float64, requires_grad=True)
    out = graph_attention(q, k, v, ei, bias=bias, backend="fused")
    ref = oracle(q, k, v, ei, bias.expand(-1, heads))
    assert max_err(out, ref) < 1e-10
    for a, b in zip(torch.autograd.grad(out, (q, k, v, bias), grad_out), torch.autograd.grad(ref, (q, k, v, bias), grad_out)):
        assert max_err(a, b) < 1e-10


@pytest.mark.parametrize("use", ["out", "weights", "both"])
def test_returned_weights_with_a_gradient_on_either_output(use):
    ei = random_edges(30, 30, 0.3, seed=5)
    q, k, v, grad_out = inputs(30, 30, heads=2, dk=6)
    r = torch.randn(ei.shape[1], 2, dtype=torch.float64)
    grads = []
    for backend in ("fused", "gather"):
        out, w = graph_attention(q, k, v, ei, return_weights=True, backend=backend)
        loss = {"out": (out * grad_out).sum(), "weights": (w * r).sum()}
        total = loss["out"] + loss["weights"] if use == "both" else loss[use]
        grads.append(torch.autograd.grad(total, (q, k) if use == "weights" else (q, k, v)) + (w,))  # weights ignore v
    for a, b in zip(*grads):
        assert max_err(a, b) < 1e-10


def test_nothing_of_size_edges_times_heads_is_made_or_kept():
    n, heads, dim = 256, 4, 4  # E = 33 n > n d: an [H, E] tensor is the largest thing a call could make
    ei = builders.window(n, 16)
    q, k, v, grad_out = inputs(n, n, heads=heads, dk=dim, dtype=torch.float32)
    saved = []
    engine.structure_of(ei, n, n)  # the analysis keeps [E] indices; measured here is the call
    with LargestTensor() as mode, torch.autograd.graph.saved_tensors_hooks(
        lambda t: saved.append(t.numel()) or t, lambda t: t
    ):
        graph_attention(q, k, v, ei, backend="fused").backward(grad_out)
    per_edge_head = ei.shape[1] * heads
    assert max(saved) <= n * heads * dim  # inputs, output and the log-sum-exp [H, n]
    assert mode.largest < per_edge_head


@pytest.mark.parametrize("dk", [16, 9])  # rows copied through vector registers, and by memcpy
def test_queries_and_keys_without_edges_get_zeros(dk):
    """Output rows and dk / dv rows are written by their first sum; those with no edge must still be zeroed."""
    n = 30
    ei = random_edges(n, n, 0.3, seed=9)
    ei = ei[:, (ei[1] != 4) & (ei[0] != 11)]  # query 4 attends to nothing, no query attends to key 11
    q, k, v, grad_out = inputs(n, n, heads=2, dk=dk)  # node-major: the kernel copies each head's rows
    out = graph_attention(q, k, v, ei, backend="fused")
    ref = oracle(q, k, v, ei)
    assert max_err(out, ref) < 1e-10 and bool((out[4] == 0).all())
    got = torch.autograd.grad(out, (q, k, v), grad_out)
    for g, r in zip(got, torch.autograd.grad(ref, (q, k, v), grad_out)):
        assert max_err(g, r) < 1e-10
    assert bool((got[1][11] == 0).all()) and bool((got[2][11] == 0).all())


def test_callers_layout_and_packed_heads_give_identical_numbers():
    """Node-major inputs are read through per-thread head copies; head-major ones in place: same sums."""
    ei = random_edges(80, 80, 0.2, seed=6)
    q, k, v, grad_out = inputs(80, 80, heads=4, dk=16, dtype=torch.float32)
    packed = [t.detach().transpose(0, 1).contiguous().transpose(0, 1).requires_grad_() for t in (q, k, v)]
    results = []
    for tensors in ((q, k, v), packed):
        out = graph_attention(*tensors, ei, backend="fused")
        results.append((out,) + torch.autograd.grad(out, tensors, grad_out))
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_transposed_pattern_in_int32_or_int64_gives_the_same_gradients():
    ei = random_edges(50, 50, 0.2, seed=7)
    q, k, v, grad_out = inputs(50, 50, heads=2, dk=8)
    s = engine.structure_of(ei, 50, 50)
    out, lse, _ = torch.ops.tgattn_fused.forward(q, k, v, s.rowptr, s.src, None, 0.3, 0.0, 0, False)
    grads = []
    for narrow in (True, False):
        colptr, row_t, perm = torch.ops.tgattn_fused.transpose_rows(s.rowptr, s.src, 50, False, narrow)
        assert row_t.dtype == (torch.int32 if narrow else torch.int64) and perm.numel() == 0
        grads.append(torch.ops.tgattn_fused.backward(
            grad_out, q, k, v, out, lse, None, None, None, s.rowptr, colptr, row_t, None, 0.3, 0.0, 0, False
        ))
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    assert fused.backward_pattern(s, False)[1].dtype == torch.int32


def test_sort_edges_reports_repeated_edges():
    ei = random_edges(30, 30, 0.2, seed=8)
    for edges, expected in ((ei, False), (torch.cat([ei, ei[:, :3]], 1), True), (ei.flip(1), False)):
        s = engine.analyse(edges, 30, 30)
        assert s.duplicates == expected


def test_sort_edges_gives_the_row_pointer_of_the_sorted_targets():
    """The extension's sort returns the rows' pointer with the sorted edges (int32 below 2^31 edges):
    that of ``row_pointer`` over the sorted targets, for edges in order and out of order, with empty rows."""
    from tgattn.engine.analysis import row_pointer

    ei = random_edges(30, 40, 0.1, seed=9)  # 30 queries, 40 keys
    ei = ei[:, ei[1] != 7]  # row 7 without edges
    for edges in (ei, ei.flip(1)):
        perm, src, dst, _, rowptr, _ = torch.ops.tgattn_fused.sort_edges(edges[0], edges[1], 30, 40)
        assert (perm.numel() == 0) == (edges is ei)
        assert rowptr.dtype == torch.int32 and torch.equal(rowptr, row_pointer(dst, 30))
        assert torch.equal(engine.analyse(edges, 30, 40).rowptr, rowptr)


def test_plan_lays_out_no_tiles_it_will_not_use():
    s = engine.analyse(builders.window(512, 64), 512, 512)
    assert engine.plan(s) == "fused" and "tiles" not in s.extras  # fill 0.8, below the threshold
    assert fill_bound(s) == tile_layout(s).fill  # exact for band layouts
    wide = engine.analyse(builders.window(2048, 256), 2048, 2048)  # tiles win under auto
    assert engine.plan(wide, "fused") == "fused" and "tiles" not in wide.extras
    assert engine.plan(wide) == "tile"
