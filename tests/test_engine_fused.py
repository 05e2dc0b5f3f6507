"""The fused C++ kernel: it is really used, equals the oracle on the shapes its SIMD code
splits (8-row blocks, vector chunks, tails), and the engine falls back when it is missing."""
import os

import pytest
import torch

from tgattn import builders, engine
from tgattn.engine import fused, native
from tgattn.functional import graph_attention
from tgattn.reference import dense_attention
from tgattn.verify import random_edges

from engine_helpers import TOL, inputs, max_err, oracle

needs_kernel = pytest.mark.skipif(
    not fused.available() and not os.environ.get("CI"), reason="no C++ toolchain here (CI requires one)"
)


@needs_kernel
def test_kernel_compiles_and_is_chosen():
    s = engine.structure_of(random_edges(40, 40, 0.2, seed=0), 40, 40)
    assert fused.available()
    assert engine.plan(s) == "fused"
    assert engine.plan(s, "fused", weights=True) == "fused"
    assert engine.plan(s, "fused", dropout=True) == "fused"  # dropout inside the kernel
    assert engine.plan(s, edge_scale=True) == "csr"
    assert engine.plan(s, fusable=False) == "csr"
    causal = engine.structure_of(builders.causal(64), 64, 64)  # SDPA's set: not with a cap or sinks
    for backend in ("auto", "dense", "tile", "fused"):
        assert engine.plan(causal, backend, softcap=True) == engine.plan(s, backend, sinks=True) == "fused"
    assert engine.plan(s, "csr", softcap=True, sinks=True) == "csr"
    assert engine.plan(s, softcap=True, edge_scale=True) == engine.plan(s, sinks=True, fusable=False) == "csr"


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("dk, dv", [(1, 3), (8, 8), (37, 5), (64, 64), (67, 70)])
def test_head_dims_around_the_vector_width(dk, dv, dtype):
    # degree ~20: several 8-row dot blocks plus a tail; dims below, at and past the vector chunks
    ei = random_edges(70, 60, 0.3, seed=1)
    q, k, v, grad_out = inputs(70, 60, heads=3, dk=dk, dv=dv, dtype=dtype)
    bias = torch.randn(ei.shape[1], 3, dtype=dtype)
    bias[torch.rand(ei.shape[1]) < 0.3] = float("-inf")
    bias.requires_grad_()
    out = graph_attention(q, k, v, ei, bias=bias, backend="fused")
    ref = oracle(q, k, v, ei, bias)
    assert max_err(out, ref) <= TOL[dtype]
    grads = torch.autograd.grad(out, (q, k, v, bias), grad_out)
    ref_grads = torch.autograd.grad(ref, (q, k, v, bias), grad_out)
    for a, b in zip(grads, ref_grads):
        assert max_err(a, b) <= 10 * TOL[dtype]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("nodes", [400, 1200], ids=["resident", "copied"])
def test_rows_read_in_place_or_from_copies_agree_with_the_oracle(nodes, dtype):
    """Tensors of at most 1 MiB (400 nodes x 8 heads x 32 x 4 bytes: 0.4 MB) are read in place, larger
    ones with many edges a node (1,200 nodes in float32: 1.2 MB) from per-head copies; forward and
    backward equal the CSR backend's (PyTorch ops, float64) either way, with a bias (bfloat16: 0.6 MB,
    in place)."""
    ei = random_edges(nodes, nodes, 6 / nodes, seed=4)  # ~6 edges a row: copies, by the reads alone
    q, k, v, grad_out = inputs(nodes, nodes, heads=8, dk=32, dtype=torch.float32)
    bias = torch.randn(ei.shape[1], 8)
    low = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out = graph_attention(*low, ei, bias=bias, backend="fused")
    ref = graph_attention(*(t.double() for t in low), ei, bias=bias.double(), backend="csr")
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert max_err(out.double(), ref) <= tol
    grads = torch.autograd.grad(out, low, grad_out.to(dtype))
    ref_grads = torch.autograd.grad(ref, low, grad_out.double())
    for a, b in zip(grads, ref_grads):
        assert max_err(a.double(), b.double()) <= 10 * tol


@needs_kernel
def test_float32_softmax_with_widely_spread_scores():
    """The vectorised float32 exp: with scores spread over hundreds (weights underflowing to
    0), fused is as close to the float64 oracle as the CSR path's torch.exp."""
    ei = builders.window(64, 20)
    q, k, v, _ = inputs(64, 64, heads=2, dk=16, dtype=torch.float32)
    ref = oracle(*(t.double() * c for t, c in ((q, 12.0 * 4), (k, 1), (v, 1))), ei)
    errors = {b: max_err(graph_attention(q, k, v, ei, scale=12.0, backend=b).double(), ref) for b in ("fused", "csr")}
    assert errors["csr"] > 1e-6  # the case is hard: many weights far apart
    assert errors["fused"] <= 2 * errors["csr"]


@needs_kernel
def test_results_do_not_depend_on_the_thread_count():
    ei = random_edges(300, 300, 0.1, seed=3)
    q, k, v, grad_out = inputs(300, 300, heads=4, dk=32, dtype=torch.float32)
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out = graph_attention(q, k, v, ei, backend="fused")
            results.append((out,) + torch.autograd.grad(out, (q, k, v), grad_out))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(*results))


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_blocks_of_a_local_pattern_copy_only_their_keys(threads):
    """A block whose rows reference at most a quarter of the keys copies only those K / V rows
    (at 2 threads: 8 blocks of 75 queries, each over about 120 of the 900 keys; at 1 thread the
    whole head), here with key ranges inside the keys and queries without edges."""
    n_q, n_k = 600, 900
    i = torch.arange(n_q).repeat_interleave(7)
    j = i * 3 // 2 + torch.arange(-3, 4).repeat(n_q)
    keep = (j >= 0) & (j < n_k) & (i % 50 != 7)
    ei = torch.stack([j[keep], i[keep]])
    q, k, v, grad_out = inputs(n_q, n_k, heads=3, dk=16)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        out = graph_attention(q, k, v, ei, backend="fused")
        got = torch.autograd.grad(out, (q, k, v), grad_out)
    finally:
        torch.set_num_threads(before)
    ref = oracle(q, k, v, ei)
    assert max_err(out, ref) < 1e-12
    assert out[7].abs().max() == 0  # no edges: zero output
    for g, r in zip(got, torch.autograd.grad(ref, (q, k, v), grad_out)):
        assert max_err(g, r) < 1e-11


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_a_long_local_pattern_in_blocks_of_a_bounded_number_of_edges(threads):
    """1.4 million edges: at 1 thread 5 blocks of at most 2^18 edges (more than 4 per thread),
    at 2 threads the 8 blocks of 4 per thread; the CSR backend (equal to the oracle in
    test_engine) is the reference at a length the dense oracle cannot hold."""
    n = 21_000
    ei = builders.window(n, 32)
    q, k, v, grad_out = inputs(n, n, heads=2, dk=8, dtype=torch.float32)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        results = {}
        for backend in ("fused", "csr"):
            out = graph_attention(q, k, v, ei, backend=backend)
            results[backend] = (out,) + torch.autograd.grad(out, (q, k, v), grad_out)
    finally:
        torch.set_num_threads(before)
    assert ei.shape[1] > 5 * 2**18
    for a, b in zip(results["fused"], results["csr"]):
        assert max_err(a, b) < 1e-5


def test_engine_falls_back_to_csr_without_the_kernel(monkeypatch):
    monkeypatch.setitem(native._state, "tried", True)
    monkeypatch.setitem(native._state, "ok", False)
    ei = random_edges(40, 40, 0.2, seed=4)
    s = engine.structure_of(ei, 40, 40)
    assert engine.plan(s) == engine.plan(s, "fused") == "csr"
    q, k, v, _ = inputs(40, 40, heads=2, dk=4)
    assert max_err(graph_attention(q, k, v, ei, backend="fused"), oracle(q, k, v, ei)) <= 1e-10


def test_no_fused_environment_variable_disables_the_kernel(monkeypatch):
    monkeypatch.setitem(native._state, "tried", False)
    monkeypatch.setitem(native._state, "ok", False)
    monkeypatch.setenv("TGATTN_NO_FUSED", "1")
    assert not fused.available()


@needs_kernel
def _row_sums(a, b, ptr, idx):
    """out[i] = sum over row i's edges of a[idx[e]] + b[idx[e]] (``[N, H, d]``), in plain torch."""
    rows = torch.repeat_interleave(torch.arange(ptr.numel() - 1), ptr.diff())
    out = torch.zeros(ptr.numel() - 1, a.shape[1], a.shape[2], dtype=a.dtype)
    return out.index_add_(0, rows, a[idx] + b[idx])


@needs_kernel
@pytest.mark.parametrize("d", [5, 64, 70])
def test_gather_rows_reads_every_edge_row(d):
    # the benchmark's reads-only floor must read exactly the kernel's rows, or it bounds nothing
    g = torch.Generator().manual_seed(0)
    s = engine.structure_of(random_edges(50, 40, 0.3, seed=2), 50, 40)  # 50 queries, 40 keys
    a, b = torch.randn(2, 40, 3, d, generator=g, dtype=torch.float64)  # [N, H, d]
    got = torch.ops.tgattn_fused.gather_rows(a, b, s.rowptr, s.src)
    assert max_err(got, _row_sums(a, b, s.rowptr, s.src)) < 1e-12
    a_heads_first = a.transpose(0, 1).contiguous().transpose(0, 1)  # same values, other strides
    got = torch.ops.tgattn_fused.gather_rows(a_heads_first, b, s.rowptr, s.src)
    assert max_err(got, _row_sums(a, b, s.rowptr, s.src)) < 1e-12


@needs_kernel
def test_reads_only_backward_reads_the_backward_rows():
    g = torch.Generator().manual_seed(0)
    n = 30
    s = engine.structure_of(random_edges(n, n, 0.3, seed=3), n, n)
    q, k, v = (torch.randn(n, 2, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    rows = tuple(t.detach() for t in (q, k, v))
    out = fused.ReadsOnly.apply(q, k, v, rows, s)
    qr, kr, vr = rows
    assert max_err(out, _row_sums(kr, vr, s.rowptr, s.src)) < 1e-12
    grad = torch.randn(out.shape, generator=g, dtype=torch.float64)
    out.backward(grad)
    colptr, row_t, _ = engine.csr.transpose_pattern(s)
    assert max_err(q.grad, _row_sums(vr, kr, s.rowptr, s.src)) < 1e-12
    assert max_err(k.grad, _row_sums(qr, grad, colptr, row_t)) < 1e-12


@needs_kernel
def test_tiles_only_above_the_measured_fill(monkeypatch):
    # window w = 64 at fill 0.75 measured faster on the fused kernel; w = 256 at 0.84 on tiles
    from tgattn.engine.dispatch import TILE_FILL_VS_CSR, TILE_FILL_VS_FUSED
    from tgattn.engine.tiles import tile_layout

    middle = engine.analyse(builders.window(512, 64), 512, 512)
    full = engine.analyse(builders.window(2048, 256), 2048, 2048)
    assert TILE_FILL_VS_CSR < tile_layout(middle).fill < TILE_FILL_VS_FUSED < tile_layout(full).fill
    assert engine.plan(middle) == "fused" and engine.plan(full) == "tile"
    assert engine.plan(middle, fusable=False) == "tile"  # against CSR the tiles win from 0.3


@pytest.mark.parametrize("with_bias", [False, True])
def test_dropout_inside_the_kernel_equals_the_oracle_with_the_same_mask(with_bias):
    n, heads, p = 30, 2, 0.4
    ei = random_edges(n, n, 0.3, seed=7)
    q, k, v, grad_out = inputs(n, n, heads=heads, dk=4)
    bias = torch.randn(ei.shape[1], heads, dtype=torch.float64).requires_grad_() if with_bias else None
    torch.manual_seed(11)
    out = graph_attention(q, k, v, ei, bias=bias, dropout_p=p, backend="fused")
    torch.manual_seed(11)  # replay torch's generator: the seed the kernel was given
    keep = fused.dropout_keep(heads, ei.shape[1], p, int(torch.randint(0, 2**62, ())))  # [H, E], sorted order
    s = engine.structure_of(ei, n, n)
    factor = torch.zeros(heads, n, n, dtype=torch.float64)
    factor[:, s.dst, s.src] = keep.double() / (1 - p)  # the mask in dense form
    mask, dense_bias = torch.zeros(n, n, dtype=torch.bool), None
    mask[ei[1], ei[0]] = True
    if bias is not None:
        dense_bias = torch.zeros(heads, n, n, dtype=torch.float64)
        dense_bias[:, ei[1], ei[0]] = bias.T
    _, weights = dense_attention(q, k, v, mask, bias=dense_bias, return_weights=True)  # [H, Nq, Nk]
    ref = torch.einsum("hij,jhd->ihd", weights * factor, v)
    assert max_err(out, ref) < 1e-10
    wanted = (q, k, v) + ((bias,) if bias is not None else ())
    for got, exp in zip(torch.autograd.grad(out, wanted, grad_out), torch.autograd.grad(ref, wanted, grad_out)):
        assert max_err(got, exp) < 1e-10


def test_dropout_keeps_one_minus_p_of_the_edges_and_follows_the_seed():
    keep = fused.dropout_keep(8, 50_000, 0.3, 1234)
    assert abs(keep.double().mean().item() - 0.7) < 0.005  # 400k draws: 7 standard deviations
    assert torch.equal(keep, fused.dropout_keep(8, 50_000, 0.3, 1234))
    assert not torch.equal(keep, fused.dropout_keep(8, 50_000, 0.3, 1235))
    assert not torch.equal(keep[0], keep[1])  # heads draw independently


def _keeps(seed: int, h: int, e: int, p: float) -> bool:
    """The kernel's dropout draw, ported: SplitMix64's finaliser of (seed, h, e), and its top
    53 bits as a float in [0, 1) compared with p (the kernel compares integers instead)."""
    m = 2**64 - 1
    x = seed ^ ((h * 0x9E3779B97F4A7C15) & m) ^ ((e * 0xD1B54A32D192ED03) & m)
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    x ^= x >> 31
    return (x >> 11) * 2.0**-53 >= p


def _top_bits(seed: int, h: int, e: int) -> int:
    """The 53 bits the draw of (seed, h, e) compares with p: the p at which it flips."""
    lo, hi = 0, 2**53  # a binary search on p through the port
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _keeps(seed, h, e, mid * 2.0**-53) else (lo, mid)
    return lo


@needs_kernel
def test_dropout_draws_equal_the_float_comparison_of_the_port():
    seed, heads, edges = 987654321, 3, 40
    for p in (0.1, 0.3, 0.6, 0.95):
        keep = fused.dropout_keep(heads, edges, p, seed)
        port = torch.tensor([[_keeps(seed, h, e, p) for e in range(edges)] for h in range(heads)])
        assert torch.equal(keep, port)
    # at the boundary: an edge is kept at p = u * 2^-53 exactly (u: its 53 bits), dropped one step above
    # and half a step above (p * 2^53 not an integer: the kernel's threshold rounds up, not down)
    cases = [(h, e, _top_bits(seed, h, e)) for h in range(heads) for e in range(8)]
    for h, e, u in [c for c in cases if c[2] < 2**52][:3]:  # (u + 0.5) 2^-53 is exact below 2^52
        for p, kept in ((u * 2.0**-53, True), ((u + 0.5) * 2.0**-53, False), ((u + 1) * 2.0**-53, False)):
            assert bool(fused.dropout_keep(h + 1, e + 1, p, seed)[h, e]) == kept


@needs_kernel
def test_kernel_reads_and_writes_any_row_and_head_strides():
    """q, k, v as the transposes of head-major tensors (the layout of an SDPA caller): no copies, same numbers."""
    ei = random_edges(40, 40, 0.3, seed=8)
    q, k, v, grad_out = inputs(40, 40, heads=3, dk=6)
    strided = [t.detach().transpose(0, 1).contiguous().transpose(0, 1).requires_grad_() for t in (q, k, v)]
    assert not strided[0].is_contiguous()
    out = graph_attention(*strided, ei, backend="fused")
    ref = oracle(q, k, v, ei)
    assert max_err(out, ref) < 1e-10
    got = torch.autograd.grad(out, strided, grad_out.transpose(0, 1).contiguous().transpose(0, 1))
    for g, r in zip(got, torch.autograd.grad(ref, (q, k, v), grad_out)):
        assert max_err(g, r) < 1e-10


def test_auto_runs_short_unequal_packed_sequences_off_sdpa():
    """One SDPA call per distinct length does not pay for many short sequences (measured in dispatch)."""
    short = [5, 9, 17, 30, 12, 44]  # molecule-sized graphs
    for ei in (builders.full(short), builders.causal(short)):
        s = engine.structure_of(ei, sum(short), sum(short))
        assert s.kind.startswith("packed") and engine.plan(s) != "dense" and engine.plan(s, "dense") == "dense"
    for lengths in ([64] * 6, [200, 300, 150]):  # equal lengths, or long ones: SDPA
        s = engine.structure_of(builders.causal(lengths), sum(lengths), sum(lengths))
        assert engine.plan(s) == "dense"


def _short_and_long_rows(n: int, seed: int) -> torch.Tensor:
    """Queries with 0 to 12 keys (mostly 1-8, as in molecule batches), a hub key with many
    queries, nodes without edges: the kernels' groups of eight short rows (or keys) and the
    groups that fall back to the general path, with a last group of fewer than eight."""
    g = torch.Generator().manual_seed(seed)
    degrees = torch.randint(1, 9, (n,), generator=g)
    degrees[torch.randperm(n, generator=g)[:4]] = torch.tensor([0, 0, 11, 12])
    src, dst = [], []
    for i, deg in enumerate(degrees.tolist()):
        keys = torch.randperm(n - 1, generator=g)[:deg]
        keys[keys >= 5] += 1  # key 5 only as the hub below
        src.append(keys), dst.append(torch.full((deg,), i))
    hub = torch.arange(0, n, 3)  # key 5: a third of the queries
    return torch.unique(torch.stack([torch.cat(src + [torch.full_like(hub, 5)]), torch.cat(dst + [hub])]), dim=1)


@needs_kernel
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dk, dv", [(16, 16), (12, 20)])
def test_short_rows_and_keys_in_float32_equal_the_oracle(dk, dv, with_bias):
    """float32 takes the kernels' eight-rows-at-a-time path for rows and keys of 1-8 edges
    (molecule batches); q, k, v strided as a conv's projections; dropout and returned weights;
    a bias with -inf entries (one query's edges all -inf in head 0) and its gradient."""
    n, heads, p = 61, 3, 0.3
    ei = _short_and_long_rows(n, seed=3)
    q64, k64, v64, grad_out = inputs(n, n, heads=heads, dk=dk, dv=dv)
    packed = torch.cat([t.detach().reshape(n, -1) for t in (q64, k64, v64)], 1).float()  # [N, H * (2 dk + dv)]
    q, k, v = (t.view(n, heads, -1) for t in packed.split([heads * dk, heads * dk, heads * dv], 1))
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))  # views, not contiguous
    bias = None
    if with_bias:
        g = torch.Generator().manual_seed(9)
        bias = torch.randn(ei.shape[1], heads, generator=g)
        bias[torch.rand(ei.shape[1], heads, generator=g) < 0.1] = float("-inf")
        bias[ei[1] == 7, 0] = float("-inf")  # query 7 attends to nothing in head 0
        bias.requires_grad_()
    torch.manual_seed(5)
    out, w = graph_attention(q, k, v, ei, bias=bias, dropout_p=p, return_weights=True, backend="fused")
    torch.manual_seed(5)
    keep = fused.dropout_keep(heads, ei.shape[1], p, int(torch.randint(0, 2**62, ())))  # [H, E], sorted order
    s = engine.structure_of(ei, n, n)
    factor = torch.zeros(heads, n, n, dtype=torch.float64)
    factor[:, s.dst, s.src] = keep.double() / (1 - p)
    mask = torch.zeros(n, n, dtype=torch.bool)
    mask[ei[1], ei[0]] = True
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    dense_bias, wanted = None, (q, k, v)
    if with_bias:
        exact.append(bias.detach().double().requires_grad_())
        dense_bias = torch.zeros(heads, n, n, dtype=torch.float64)
        dense_bias[:, ei[1], ei[0]] = exact[3].T
        wanted = (q, k, v, bias)
    _, weights = dense_attention(*exact[:3], mask, bias=dense_bias, return_weights=True)  # [H, Nq, Nk]
    ref = torch.einsum("hij,jhd->ihd", weights * factor, exact[2])
    assert max_err(out.double(), ref) < 1e-5
    assert max_err(w.double(), weights[:, ei[1], ei[0]].T) < 1e-6
    got = torch.autograd.grad(out, wanted, grad_out.float())
    for g, r in zip(got, torch.autograd.grad(ref, exact, grad_out)):
        assert torch.equal(g.isfinite(), torch.ones_like(g, dtype=torch.bool))
        assert max_err(g.double(), r) < 1e-5


def _few_edges(n: int, seed: int, crowded: bool) -> torch.Tensor:
    """Edges among n nodes, far fewer than the nodes: 16 queries with 3 keys each among the first
    24 keys (groups of eight short rows and keys: the float32 eight-lane paths) and 100 random
    edges. With ``crowded`` also query 0 and query n - 1 with n / 2 keys each: with one thread the
    forward's blocks of a head copy its K / V rows (query 0), read them in place (the scattered
    rows), and copy them again (query n - 1)."""
    g = torch.Generator().manual_seed(seed)
    parts = [torch.stack([torch.randint(0, 24, (48,), generator=g), torch.arange(16).repeat_interleave(3)])]
    parts.append(torch.randint(0, n, (2, 100), generator=g))
    if crowded:
        for i in (0, n - 1):
            parts.append(torch.stack([torch.randperm(n, generator=g)[: n // 2], torch.full((n // 2,), i)]))
    return torch.unique(torch.cat(parts, 1), dim=1)


@needs_kernel
@pytest.mark.parametrize("crowded", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_few_edges_among_many_nodes_read_the_rows_in_place(dtype, crowded):
    """Blocks with far fewer edges than the nodes they would copy read K / V (forward) and q / dO
    (backward, which then sums dq where it goes) in place: equal to the textbook path, with a
    bias holding -inf and returned weights, q / k / v strided as a projection's views; the same
    bits at 1 and 2 threads (whose blocks, and so choices, differ)."""
    n, heads, dim = 3000, 3, 8
    ei = _few_edges(n, seed=4, crowded=crowded)
    q64, k64, v64, grad_out = inputs(n, n, heads=heads, dk=dim)
    packed = torch.cat([t.detach().reshape(n, -1) for t in (q64, k64, v64)], 1).to(dtype)
    q, k, v = (t.view(n, heads, dim).detach().requires_grad_() for t in packed.split(heads * dim, 1))
    g = torch.Generator().manual_seed(5)
    bias = torch.randn(ei.shape[1], heads, generator=g, dtype=dtype)
    bias[torch.rand(ei.shape[1], heads, generator=g) < 0.2] = float("-inf")
    bias.requires_grad_()
    wrt = (q, k, v, bias)
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out, w = graph_attention(q, k, v, ei, bias=bias, return_weights=True, backend="fused")
            results.append((out, w) + torch.autograd.grad((out, w), wrt, (grad_out.to(dtype), torch.ones_like(w))))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(*results))
    ref64 = [t.detach().double().requires_grad_() for t in wrt]
    out, w = graph_attention(*ref64[:3], ei, bias=ref64[3], return_weights=True, backend="gather")
    ref = (out, w) + torch.autograd.grad((out, w), ref64, (grad_out, torch.ones_like(w)))
    for got, want in zip(results[0], ref):
        assert max_err(got.double(), want) <= 10 * TOL[dtype]


@needs_kernel
def test_row_pointers_of_either_width_give_the_same_bits():
    """The kernels take int32 row pointers (the analysis's, while E < 2^31) and int64 ones alike."""
    n, heads = 200, 2
    s = engine.structure_of(_few_edges(n, seed=6, crowded=True), n, n)
    assert s.rowptr.dtype == torch.int32
    q, k, v, grad_out = (t.detach().float() for t in inputs(n, n, heads=heads, dk=8))
    bias = torch.randn(s.num_edges, heads)
    results = []
    for rowptr, narrow in ((s.rowptr, True), (s.rowptr.long(), False)):
        out, lse, w = torch.ops.tgattn_fused.forward(q, k, v, rowptr, s.src, bias, 0.3, 0.2, 7, True)
        colptr, row_t, perm_t = torch.ops.tgattn_fused.transpose_rows(rowptr, s.src, n, True, narrow)
        assert colptr.dtype == row_t.dtype == perm_t.dtype == (torch.int32 if narrow else torch.int64)
        grads = torch.ops.tgattn_fused.backward(
            grad_out, q, k, v, out, lse, w, torch.ones_like(w), bias, rowptr, colptr, row_t, perm_t, 0.3, 0.2, 7, True
        )
        sums = torch.ops.tgattn_fused.gather_rows(k, v, rowptr, s.src)
        results.append([out, lse, w, colptr.long(), row_t.long(), perm_t.long(), *grads, sums])
    assert all(torch.equal(a, b) for a, b in zip(*results))
    colptr = results[0][3]
    assert torch.equal(colptr, torch.searchsorted(s.src.sort().values, torch.arange(n + 1)))


@pytest.mark.skipif(not fused.available(), reason="no C++ toolchain here")
def test_double_backward_with_one_tensor_for_q_k_and_v():
    """create_graph=True recomputes the gradients for views of the saved inputs: with q = k = v one
    tensor, a gradient for the tensor itself would count the paths through the other two again."""
    x = torch.randn(10, 2, 4, dtype=torch.float64, requires_grad=True)
    ei = builders.window(10, 2)
    second = []
    for backend in ("fused", "gather"):
        grad, = torch.autograd.grad(graph_attention(x, x, x, ei, backend=backend).pow(2).sum(), x, create_graph=True)
        second.append(torch.autograd.grad(grad.pow(2).sum(), x)[0])
    torch.testing.assert_close(*second, rtol=1e-10, atol=1e-10)
