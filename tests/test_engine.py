"""Every engine backend equals the dense oracle on every verification case, values and gradients."""
import pytest
import torch

from tgattn import engine, verify
from tgattn.functional import graph_attention

from engine_helpers import TOL, inputs, max_err, oracle

BACKENDS = ["auto", "dense", "tile", "fused", "csr", "gather"]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", verify.CASES, ids=[c.name for c in verify.CASES])
def test_backend_matches_oracle(case, backend, dtype):
    edge_index, n_q, n_k = case.make()
    q, k, v, grad_out = inputs(n_q, n_k, heads=2, dk=8, dv=5, dtype=dtype)
    out = graph_attention(q, k, v, edge_index, backend=backend)
    ref = oracle(q, k, v, edge_index)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad_out)
    assert max_err(out, ref) <= TOL[dtype]
    for g, r in zip(grads, ref_grads):
        assert max_err(g, r) <= TOL[dtype]


@pytest.mark.parametrize("backend", ["dense", "tile", "fused", "csr"])
@pytest.mark.parametrize("case", verify.CASES, ids=[c.name for c in verify.CASES])
def test_backend_with_bias_matches_oracle(case, backend):
    edge_index, n_q, n_k = case.make()
    q, k, v, grad_out = inputs(n_q, n_k, heads=2, dk=4)
    g = torch.Generator().manual_seed(1)
    bias = torch.randn(edge_index.shape[1], 2, generator=g, dtype=torch.float64)
    bias[torch.rand(edge_index.shape[1], generator=g) < 0.2] = float("-inf")
    bias.requires_grad_()
    out = graph_attention(q, k, v, edge_index, bias=bias, backend=backend)
    ref = oracle(q, k, v, edge_index, bias)
    grads = torch.autograd.grad(out, (q, k, v, bias), grad_out)
    ref_grads = torch.autograd.grad(ref, (q, k, v, bias), grad_out)
    assert max_err(out, ref) <= 1e-10
    for a, b in zip(grads, ref_grads):
        assert max_err(a, b) <= 1e-10


@pytest.mark.parametrize("case", verify.CASES, ids=[c.name for c in verify.CASES])
def test_auto_picks_a_fast_backend(case):
    """``auto`` never uses the gather path; full / causal sets run on dense SDPA (packed ones
    when SDPA pays, see ``engine.dispatch.dense_pays``)."""
    edge_index, n_q, n_k = case.make()
    chosen = engine.plan(engine.structure_of(edge_index, n_q, n_k))
    assert chosen in engine.ENGINE_BACKENDS
    if case.name.startswith(("full", "causal")):
        assert chosen == ("dense" if engine.dispatch.dense_pays(engine.structure_of(edge_index, n_q, n_k)) else "fused")
