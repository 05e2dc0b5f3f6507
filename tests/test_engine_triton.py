"""The Triton kernels against the float64 dense oracle: forward, gradients (q, k, v, bias,
returned weights), bias with -inf, dropout, empty rows, duplicates, packed / window / random /
causal sets and three float dtypes.

On a machine with CUDA the kernels run compiled on the GPU. Without one they run on CPU
tensors through Triton's interpreter: ``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` before
triton is imported, and each launch executes the real kernels one program at a time (about
10-40 ms a program here), so sizes stay tiny (tens of programs per launch).
"""
import pytest
import torch

from tgattn import builders, engine
from tgattn.engine import fused
from tgattn.functional import graph_attention
from tgattn.reference import dense_attention
from tgattn.verify import random_edges

from engine_helpers import inputs, max_err, oracle

pytest.importorskip("triton")
from tgattn.engine import triton as backend  # noqa: E402
from tgattn.engine.triton.attention import interpreter_ready, kernels_module, triton_attention  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(
    DEVICE.type == "cpu" and not interpreter_ready(),
    reason="TRITON_INTERPRET=1 must be set before triton is first imported (tests/conftest.py does it)",
)


@pytest.fixture(autouse=True)
def _kernels(monkeypatch):
    monkeypatch.delenv("TGATTN_NO_TRITON", raising=False)
    assert kernels_module().INTERPRETED == (DEVICE.type == "cpu")


def _dev(*tensors):
    """Copies on the test device (leaves again where the originals were)."""
    return [t.detach().to(DEVICE).requires_grad_(t.requires_grad) for t in tensors]


def _cpu_grads(out, leaves, grad_out):
    grads = torch.autograd.grad(out, leaves, grad_out.to(out.device))
    return [g.cpu() for g in grads]


def _check(edge_index, n_q, n_k, *, heads=2, dk=8, dv=None, bias=None, tol=1e-10):
    """graph_attention(backend="triton") equals the oracle, forward and every gradient."""
    q, k, v, grad_out = inputs(n_q, n_k, heads=heads, dk=dk, dv=dv)
    leaves = [q, k, v] if bias is None else [q, k, v, bias]
    mine = _dev(*leaves)
    b = None if bias is None else mine[3]
    out = graph_attention(*mine[:3], edge_index.to(DEVICE), bias=b, backend="triton")
    ref = oracle(q, k, v, edge_index, bias)
    assert max_err(out.cpu(), ref) <= tol
    for a, r in zip(_cpu_grads(out, mine, grad_out), torch.autograd.grad(ref, leaves, grad_out)):
        assert max_err(a, r) <= tol


def _packed_window():
    return builders.window([7, 12, 5], 2)


CASES = {
    "window": (lambda: builders.window(40, 3), 40, 40),
    "causal": (lambda: builders.causal(24), 24, 24),
    "random": (lambda: random_edges(36, 30, 0.2, seed=1), 36, 30),
    "packed_window": (_packed_window, 24, 24),
    "packed_causal": (lambda: builders.causal([9, 4, 11]), 24, 24),
    "bigbird": (lambda: builders.bigbird(32, 2, 1, 2, generator=torch.Generator().manual_seed(0)), 32, 32),
}


@pytest.mark.parametrize("case", list(CASES))
def test_forward_and_gradients_equal_the_oracle(case):
    make, n_q, n_k = CASES[case]
    _check(make(), n_q, n_k)


def test_bias_per_head_and_shared_with_minus_inf():
    ei = random_edges(30, 30, 0.25, seed=2)
    e = ei.shape[1]
    g = torch.Generator().manual_seed(4)
    per_head = torch.randn(e, 2, generator=g, dtype=torch.float64)
    per_head[torch.rand(e, 2, generator=g) < 0.3] = float("-inf")
    _check(ei, 30, 30, bias=per_head.requires_grad_())
    shared = torch.randn(e, generator=g, dtype=torch.float64)
    shared[torch.rand(e, generator=g) < 0.3] = float("-inf")
    _check(ei, 30, 30, bias=shared.requires_grad_())


def test_empty_rows_and_rows_whose_edges_are_all_removed():
    ei = random_edges(30, 20, 0.15, seed=5)
    ei = ei[:, ei[1] % 4 != 0]  # every fourth query has no edge
    bias = torch.zeros(ei.shape[1], dtype=torch.float64)
    bias[ei[1] % 4 == 1] = float("-inf")  # and these queries lose all of theirs
    bias.requires_grad_()
    q, k, v, grad_out = _dev(*inputs(30, 20, heads=2, dk=8))
    b = _dev(bias)[0]
    out = graph_attention(q, k, v, ei.to(DEVICE), bias=b, backend="triton").cpu()
    dead = torch.arange(30) % 4 <= 1
    assert bool((out[dead] == 0).all()) and not bool((out[~dead] == 0).all())
    dq, db = _cpu_grads(graph_attention(q, k, v, ei.to(DEVICE), bias=b, backend="triton"), (q, b), grad_out)
    assert bool((dq[dead] == 0).all()) and bool((db[ei[1] % 4 == 1] == 0).all())
    _check(ei, 30, 20, bias=bias)


def test_duplicated_edges_count_once_per_copy():
    ei = builders.window(20, 2)
    ei = torch.cat([ei, ei[:, ::3], ei[:, :4]], dim=1)  # some edges twice or three times, unsorted
    assert engine.analyse(ei, 20, 20).duplicates
    bias = torch.randn(ei.shape[1], 2, dtype=torch.float64, requires_grad=True)
    _check(ei, 20, 20, bias=bias)


def _dense_bias(bias, ei, n_q, n_k):
    """``[H or 1, Nq, Nk]`` from an ``[E, H or 1]`` edge bias (no duplicates)."""
    dense = bias.new_zeros(bias.shape[1], n_q, n_k)
    dense[:, ei[1], ei[0]] = bias.T
    return dense


def _sorted(ei, n_q, n_k):
    """``(structure on the device, sorted edge_index on the CPU)``."""
    s = engine.analyse(ei.to(DEVICE), n_q, n_k)
    return s, torch.stack([s.src, s.dst]).cpu()


@pytest.mark.parametrize("blocks", [(2, 4), (16, 2), (16, 16)])
def test_block_sizes_head_dims_and_differentiable_weights(blocks):
    # skewed degrees (global tokens): rows of one block end at different chunks; dk, dv not powers of 2
    s, ei = _sorted(builders.union(builders.window(16, 1), builders.global_tokens(16, [0, 5])), 16, 16)
    q, k, v, grad_out = inputs(16, 16, heads=2, dk=5, dv=3)
    bias = torch.randn(s.num_edges, 1, dtype=torch.float64, requires_grad=True)
    r = torch.randn(s.num_edges, 2, dtype=torch.float64)
    mine = _dev(q, k, v, bias)
    out, w = triton_attention(*mine[:3], s, mine[3], 0.4, 0.0, True, blocks=blocks)
    ref, ref_w = dense_attention(q, k, v, builders.to_mask(ei, 16, 16), bias=_dense_bias(bias, ei, 16, 16), scale=0.4,
                                 return_weights=True)
    ref_w = ref_w[:, ei[1], ei[0]].T  # [E, H]
    assert max_err(out.cpu(), ref) <= 1e-10
    assert max_err(w.cpu(), ref_w) <= 1e-10
    loss = (out * grad_out.to(DEVICE)).sum() + (w * r.to(DEVICE)).sum()
    grads = [g.cpu() for g in torch.autograd.grad(loss, mine)]
    ref_grads = torch.autograd.grad((ref * grad_out).sum() + (ref_w * r).sum(), (q, k, v, bias))
    for a, b in zip(grads, ref_grads):
        assert max_err(a, b) <= 1e-10


@pytest.mark.parametrize("blocks", [(2, 4), (16, 2)])
def test_softcap_and_sinks_across_block_sizes_with_dropout(blocks):
    # Gemma 2's cap and gpt-oss's sinks: rows of one program end at different chunks, rows without an
    # edge (the sink takes their whole weight), dropout on the edges only (the sink has no value).
    from test_functional_softcap_sinks import oracle as capped_oracle

    ei = random_edges(20, 16, 0.25, seed=7)
    s, ei = _sorted(ei[:, ei[1] % 5 != 2], 20, 16)  # queries 2, 7, ... have no edge
    q, k, v, grad_out = inputs(20, 16, heads=2, dk=8)
    q, k = (t.detach().mul(2).requires_grad_() for t in (q, k))  # scores of a few units: the cap bites
    bias = torch.randn(s.num_edges, 2, dtype=torch.float64, requires_grad=True)
    sinks = torch.tensor([0.3, -1.2], dtype=torch.float64, requires_grad=True)
    p = 0.3
    torch.manual_seed(5)
    keep = backend.dropout_keep(backend.draw_seed(), s.num_edges, 2, p, DEVICE).cpu()
    torch.manual_seed(5)
    mine = _dev(q, k, v, bias, sinks)
    out, w = triton_attention(*mine[:3], s, mine[3], 0.4, p, True, blocks=blocks, softcap=1.5, sinks=mine[4])
    ref, ref_w = capped_oracle(q, k, v, ei, 0.4, softcap=1.5, bias=bias, sinks=sinks, mult=keep.double() / (1 - p))
    assert max_err(out.cpu(), ref) <= 1e-10 and max_err(w.cpu(), ref_w) <= 1e-10
    r = torch.randn(s.num_edges, 2, dtype=torch.float64)
    loss = (out * grad_out.to(DEVICE)).sum() + (w * r.to(DEVICE)).sum()
    ref_loss = (ref * grad_out).sum() + (ref_w * r).sum()
    for a, b in zip([g.cpu() for g in torch.autograd.grad(loss, mine)], torch.autograd.grad(ref_loss, (q, k, v, bias, sinks))):
        assert max_err(a, b) <= 1e-10


# Float64 oracle vs. low-precision kernels: float32 accumulation, inputs and outputs rounded.
DTYPE_TOL = {torch.float32: 2e-6, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("dtype", list(DTYPE_TOL), ids=["f32", "f16", "bf16"])
def test_low_precision_dtypes(dtype):
    ei = builders.window(32, 4)
    q, k, v, grad_out = (t.detach().to(dtype) for t in inputs(32, 32, heads=2, dk=16))
    bias = torch.randn(ei.shape[1], 2).to(dtype)
    exact = [t.double().requires_grad_() for t in (q, k, v, bias)]  # the rounded inputs, in float64
    mine = _dev(*(t.requires_grad_() for t in (q, k, v, bias)))
    out = graph_attention(*mine[:3], ei.to(DEVICE), bias=mine[3], backend="triton")
    ref = oracle(*exact[:3], ei, exact[3])
    assert out.dtype == dtype
    tol = DTYPE_TOL[dtype]
    assert max_err(out.cpu().double(), ref) <= tol
    ref_grads = torch.autograd.grad(ref, exact, grad_out.double())
    for a, b in zip(_cpu_grads(out, mine, grad_out), ref_grads):
        assert a.dtype == dtype
        assert max_err(a.double(), b) <= 4 * tol * max(1.0, b.abs().max().item())


def test_dropout_equals_the_oracle_with_the_same_mask():
    s, ei = _sorted(random_edges(30, 30, 0.3, seed=6), 30, 30)
    q, k, v, grad_out = inputs(30, 30, heads=2, dk=8)
    bias = torch.randn(s.num_edges, 2, dtype=torch.float64, requires_grad=True)
    p = 0.4
    torch.manual_seed(11)
    keep = backend.dropout_keep(backend.draw_seed(), s.num_edges, 2, p, DEVICE).cpu()  # [E, H]
    torch.manual_seed(11)  # the call draws the same seed
    mine = _dev(q, k, v, bias)
    out, _ = triton_attention(*mine[:3], s, mine[3], 0.3, p, False)
    _, weights = dense_attention(q, k, v, builders.to_mask(ei, 30, 30), bias=_dense_bias(bias, ei, 30, 30), scale=0.3,
                                 return_weights=True)
    kept = torch.zeros_like(weights)
    kept[:, ei[1], ei[0]] = keep.T.double() / (1 - p)
    ref = torch.einsum("hij,jhd->ihd", weights * kept, v)
    assert 0.5 < keep.float().mean().item() < 0.7  # about 1 - p kept
    assert max_err(out.cpu(), ref) <= 1e-10
    for a, b in zip(_cpu_grads(out, mine, grad_out), torch.autograd.grad(ref, (q, k, v, bias), grad_out)):
        assert max_err(a, b) <= 1e-10
    runs = []
    for seed in (11, 11, 12):
        torch.manual_seed(seed)
        runs.append(graph_attention(*mine[:3], ei.to(DEVICE), bias=mine[3], scale=0.3, dropout_p=p, backend="triton"))
    assert torch.equal(runs[0], out) and torch.equal(runs[1], out) and max_err(runs[2], out) > 1e-3


def test_nan_reaches_exactly_the_queries_that_attend_to_it():
    ei = builders.window(24, 2)
    q, k, v, _ = inputs(24, 24, heads=2, dk=8)
    v = v.detach().clone()
    v[10, 1, 3] = float("nan")
    out = graph_attention(*_dev(q, k, v), ei.to(DEVICE), backend="triton").cpu()
    hit = builders.to_mask(ei, 24, 24)[:, 10]  # queries that see key 10
    assert torch.equal(out[:, 1].isnan().any(-1), hit)
    assert not bool(out[:, 0].isnan().any())


def test_dispatch_names_and_fallbacks(monkeypatch):
    causal = engine.analyse(builders.causal(16), 16, 16)
    window = engine.analyse(builders.window(16, 2), 16, 16)
    assert engine.plan(window, triton=True) == "triton"
    assert engine.plan(causal, triton=True) == "dense"  # SDPA does full / causal sets
    assert engine.plan(causal, "triton", triton=True) == "triton"  # a name is exact
    # falls back like fused, whose kernel takes dropout
    assert engine.plan(window, "triton", dropout=True, triton=False) == ("fused" if fused.available() else "csr")
    q = torch.zeros(16, 2, 4)
    assert not backend.usable(q.long(), named=True)
    if DEVICE.type == "cpu":
        assert backend.usable(q, named=True) and not backend.usable(q)  # CPU: only when named
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        assert not backend.usable(q, named=True)
    else:
        assert backend.usable(q.cuda()) and not backend.usable(q, named=True)
    monkeypatch.setenv("TGATTN_NO_TRITON", "1")
    assert not backend.available() and not backend.usable(q.to(DEVICE), named=True)


def test_no_double_backward():
    q, k, v, grad_out = _dev(*inputs(16, 16, heads=1, dk=4))
    out = graph_attention(q, k, v, builders.window(16, 2).to(DEVICE), backend="triton")
    with pytest.raises(RuntimeError, match="second derivative"):
        torch.autograd.grad(out, q, grad_out, create_graph=True)


@pytest.mark.parametrize("case", ["random_shuffled", "window_shuffled_with_duplicates"])
def test_on_a_gpus_route_forward_and_gradients_equal_the_oracle(monkeypatch, case):
    """The route of a GPU on CPU tensors: the device analysis of a new set and the walks' torch fallbacks
    (the transposed pattern from a sort and a search, both pointers and orders at once with n_q = n_k),
    not the fused extension's counting sorts."""
    from tgattn.engine import analysis, native

    monkeypatch.setattr(analysis, "HOST_DEVICES", frozenset())
    monkeypatch.setattr(native, "available", lambda: False)
    engine.CACHE.clear()
    shuffle = torch.Generator().manual_seed(3)
    if case == "random_shuffled":
        ei, n_q, n_k = random_edges(20, 14, 0.3, seed=2), 20, 14
    else:
        ei, n_q, n_k = builders.window(18, 2), 18, 18
        ei = torch.cat([ei, ei[:, ::5]], 1)
    _check(ei[:, torch.randperm(ei.shape[1], generator=shuffle)], n_q, n_k)
