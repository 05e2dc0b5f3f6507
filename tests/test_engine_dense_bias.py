"""The dense (SDPA) backend honours edge bias and attention dropout on full / causal / packed sets."""
import pytest
import torch

from tgattn import builders, engine
from tgattn.functional import graph_attention

from engine_helpers import inputs, max_err, oracle

SETS = {
    "full": (lambda: builders.full(9), 9),
    "causal": (lambda: builders.causal(9), 9),
    "packed_full_equal": (lambda: builders.full([4, 4, 4]), 12),
    "packed_full": (lambda: builders.full([3, 5, 1, 5]), 14),
    "packed_causal": (lambda: builders.causal([4, 2, 4, 6]), 16),
}


def _bias(edge_index, heads, seed):
    """Random bias with scattered -inf cells, one query with every key at -inf, in shuffled edge order."""
    g = torch.Generator().manual_seed(seed)
    bias = torch.randn(edge_index.shape[1], heads, generator=g, dtype=torch.float64)
    bias[torch.rand(edge_index.shape[1], generator=g) < 0.25] = float("-inf")
    bias[edge_index[1] == 2] = float("-inf")  # query 2 has no usable key: its output must be 0
    return bias.requires_grad_()


@pytest.mark.parametrize("bias_heads", [1, 3], ids=["E1", "EH"])
@pytest.mark.parametrize("name", SETS)
def test_dense_bias_matches_oracle_with_grads(name, bias_heads):
    make, n = SETS[name]
    ei = make()
    perm = torch.randperm(ei.shape[1], generator=torch.Generator().manual_seed(3))
    ei = ei[:, perm]  # the engine sorts; the bias must follow the caller's order
    s = engine.structure_of(ei, n, n)
    assert s.kind == name.replace("_equal", "") and engine.plan(s, "dense") == "dense"
    q, k, v, grad_out = inputs(n, n, heads=3, dk=4, dv=5)
    bias = _bias(ei, bias_heads, seed=len(name) + bias_heads)
    out = graph_attention(q, k, v, ei, bias=bias, backend="dense")
    ref = oracle(q, k, v, ei, bias)
    assert max_err(out, ref) <= 1e-10
    assert torch.equal(out[2], torch.zeros_like(out[2]))  # a row of -inf keys gives 0, not NaN
    grads = torch.autograd.grad(out, (q, k, v, bias), grad_out)
    ref_grads = torch.autograd.grad(ref, (q, k, v, bias), grad_out)
    for a, b in zip(grads, ref_grads):
        assert torch.isfinite(a).all() and max_err(a, b) <= 1e-10


@pytest.mark.parametrize("name", ["full", "causal", "packed_full", "packed_causal"])
def test_dense_dropout_drops_single_weights_and_rescales(name):
    """With one-hot values, the output row i *is* the dropped weight row: w_ij / (1 - p) or 0."""
    make, n = SETS[name]
    ei = make()
    p = 0.4
    s = engine.structure_of(ei, n, n)
    assert engine.plan(s, "dense", dropout=True) == "dense"
    q, k, _, _ = inputs(n, n, heads=2, dk=4)
    v = torch.eye(n, dtype=torch.float64).unsqueeze(1).expand(n, 2, n)  # v_j = e_j in every head
    bias = torch.randn(ei.shape[1], 2, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    _, w = graph_attention(q, k, v, ei, bias=bias, return_weights=True, backend="csr")  # [E, H], exact
    weights = torch.zeros(2, n, n, dtype=torch.float64)
    weights[:, ei[1], ei[0]] = w.T  # [H, Nq, Nk]
    torch.manual_seed(0)
    out = graph_attention(q, k, v, ei, bias=bias, dropout_p=p, backend="dense").permute(1, 0, 2)  # [H, Nq, Nk]
    kept = out != 0
    assert max_err(out[kept], weights[kept] / (1 - p)) <= 1e-10
    assert not bool(kept[weights == 0].any())  # never a weight off the edge set
    dropped = 1 - kept[weights > 0].double().mean().item()
    assert 0.25 < dropped < 0.55  # about p of the weights are dropped
    assert not torch.equal(kept[0], kept[1])  # heads draw their own masks
    torch.manual_seed(0)
    again = graph_attention(q, k, v, ei, bias=bias, dropout_p=p, backend="dense").permute(1, 0, 2)
    assert torch.equal(out, again)  # seeded: reproducible


def test_dense_dropout_without_bias_keeps_the_mean():
    q, k, _, _ = inputs(40, 40, heads=1, dk=4)
    v = torch.ones(40, 1, 3, dtype=torch.float64)
    assert engine.plan(engine.structure_of(builders.causal(40), 40, 40), dropout=True) == "dense"
    torch.manual_seed(0)
    out = graph_attention(q, k, v, builders.causal(40), dropout_p=0.5)
    assert not torch.allclose(out, torch.ones_like(out))  # each row: sum_j a_ij m_ij / (1 - p)
    assert abs(out.mean().item() - 1.0) < 0.15
