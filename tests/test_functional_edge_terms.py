"""graph_attention's per-edge key and value terms (edge_key= / edge_value=) against a per-query oracle.

    s_ij = scale <q_i, k_j + ek_ij> + b_ij,     o_i = sum_j a_ij (v_j + ev_ij)
"""
import pytest
import torch

from tgattn import builders
from tgattn.engine.recompute import dropout_factor
from tgattn.functional import attention_with_edge_terms, graph_attention
from tgattn.verify import random_edges

TOL = dict(rtol=1e-10, atol=1e-10)
HEADS, DK, DV = 2, 4, 5


def oracle(q, k, v, edge_index, ek, ev, scale, bias=None, mult=None):
    """One query at a time: its edges' scores, their softmax, the weighted sum (empty rows: 0)."""
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[2])
    weights = q.new_zeros(edge_index.shape[1], q.shape[1])
    for i in range(q.shape[0]):
        edges = (edge_index[1] == i).nonzero().flatten()
        if edges.numel() == 0:
            continue
        src = edge_index[0, edges]
        scores = (q[i] * (k[src] + ek[edges])).sum(-1) * scale  # [e_i, H]
        if bias is not None:
            scores = scores + bias[edges]
        a = scores.softmax(0)
        weights[edges] = a
        used = a if mult is None else a * mult[edges]
        out[i] = (used.unsqueeze(-1) * (v[src] + ev[edges])).sum(0)
    return out, weights


def _with_duplicates(n):
    ei = builders.window(n, 2)
    return torch.cat([ei, ei[:, ::5]], dim=1)[:, torch.randperm(ei.shape[1] + ei[:, ::5].shape[1])]  # unsorted


PATTERNS = {  # (edge_index, n_q, n_k)
    "window": lambda: (builders.window(12, 2), 12, 12),
    "random-with-empty-rows": lambda: (random_edges(14, 14, 0.12, 1), 14, 14),
    "duplicates-unsorted": lambda: (_with_duplicates(10), 10, 10),
    "cross": lambda: (random_edges(6, 9, 0.4, 0), 6, 9),
    "full": lambda: (builders.full(7), 7, 7),
}


def _leaf(*shape):
    return torch.randn(*shape, dtype=torch.float64, requires_grad=True)


@pytest.mark.parametrize("form", ["vectors", "features-factored", "features-expanded"])
@pytest.mark.parametrize("backend", ["auto", "gather", "dense", "tile", "fused", "csr"])
@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_equals_oracle(pattern, backend, form):
    torch.manual_seed(0)
    edge_index, nq, nk = PATTERNS[pattern]()
    num_edges = edge_index.shape[1]
    q, k, v = _leaf(nq, HEADS, DK), _leaf(nk, HEADS, DK), _leaf(nk, HEADS, DV)
    bias = _leaf(num_edges, HEADS)
    if form == "vectors":
        ek, ev = _leaf(num_edges, HEADS, DK), _leaf(num_edges, HEADS, DV)
        leaves, terms = [ek, ev], (ek, ev)
    else:  # F = 3 < d (applied to the features) or F = 7 > d (applied to the edges)
        f = 3 if form == "features-factored" else 7
        e, wk, wv = _leaf(num_edges, f), _leaf(HEADS * DK, f), _leaf(HEADS * DV, f)
        leaves, terms = [e, wk, wv], ((e, wk), (e, wv))
    out, weights = graph_attention(
        q, k, v, edge_index, bias=bias, edge_key=terms[0], edge_value=terms[1], return_weights=True, backend=backend
    )
    if form == "vectors":
        ek, ev = terms
    else:
        ek, ev = ((e @ w.T).view(num_edges, HEADS, -1) for w in (wk, wv))
    ref, ref_weights = oracle(q, k, v, edge_index, ek, ev, DK**-0.5, bias)
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(weights, ref_weights, **TOL)
    grad_out, grad_weights = torch.randn_like(out), torch.randn_like(weights)
    inputs = [q, k, v, bias] + leaves
    grads = torch.autograd.grad((out, weights), inputs, (grad_out, grad_weights))
    ref_grads = torch.autograd.grad((ref, ref_weights), inputs, (grad_out, grad_weights))
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("backend", ["auto", "gather", "csr"])
def test_dropout_and_edge_scale_apply_to_both_value_terms(backend):
    """One mask on a_ij for v_j and ev_ij alike: the oracle with dropout_factor's mask of the same seed."""
    torch.manual_seed(0)
    edge_index, n, _ = PATTERNS["duplicates-unsorted"]()
    num_edges = edge_index.shape[1]
    q, k, v = _leaf(n, HEADS, DK), _leaf(n, HEADS, DK), _leaf(n, HEADS, DV)
    ek, ev, edge_scale = _leaf(num_edges, HEADS, DK), _leaf(num_edges, HEADS, DV), _leaf(num_edges, 1)
    out, weights = attention_with_edge_terms(
        q, k, v, edge_index, None, edge_scale, None, 0.3, True, backend, ek, ev,
        generator=torch.Generator().manual_seed(5),
    )
    dropped = dropout_factor(num_edges, HEADS, 0.3, q, torch.Generator().manual_seed(5))  # [E, H]
    assert (dropped == 0).any()
    ref, ref_weights = oracle(q, k, v, edge_index, ek, ev, DK**-0.5, mult=edge_scale * dropped)
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(weights, ref_weights, **TOL)  # before dropout, as without edge terms
    grad = torch.randn_like(out)
    inputs = [q, k, v, ek, ev, edge_scale]
    for a, b in zip(torch.autograd.grad(out, inputs, grad), torch.autograd.grad(ref, inputs, grad), strict=True):
        torch.testing.assert_close(a, b, **TOL)


def test_only_one_term_and_no_edges():
    edge_index, n, _ = PATTERNS["window"]()
    q, k, v = _leaf(n, HEADS, DK), _leaf(n, HEADS, DK), _leaf(n, HEADS, DV)
    ek, ev = _leaf(edge_index.shape[1], HEADS, DK), _leaf(edge_index.shape[1], HEADS, DV)
    zero_k, zero_v = torch.zeros_like(ek), torch.zeros_like(ev)
    torch.testing.assert_close(graph_attention(q, k, v, edge_index, edge_key=ek),
                               oracle(q, k, v, edge_index, ek, zero_v, DK**-0.5)[0], **TOL)
    torch.testing.assert_close(graph_attention(q, k, v, edge_index, edge_value=ev),
                               oracle(q, k, v, edge_index, zero_k, ev, DK**-0.5)[0], **TOL)
    empty = torch.zeros(2, 0, dtype=torch.long)
    out = graph_attention(q, k, v, empty, edge_key=ek[:0], edge_value=ev[:0])
    assert out.shape == (n, HEADS, DV) and not out.any()


def test_half_precision_is_computed_in_float32():
    edge_index, n, _ = PATTERNS["window"]()
    q, k, v = (torch.randn(n, HEADS, DK, dtype=torch.float64) for _ in range(3))
    ek, ev = (torch.randn(edge_index.shape[1], HEADS, DK, dtype=torch.float64) for _ in range(2))
    ref = oracle(q, k, v, edge_index, ek, ev, DK**-0.5)[0]
    out = graph_attention(*(t.bfloat16() for t in (q, k, v)), edge_index, edge_key=ek.bfloat16(), edge_value=ev.bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref, rtol=5e-2, atol=5e-2)


def test_bad_terms_are_named():
    edge_index = builders.window(6, 1)
    num_edges = edge_index.shape[1]
    q = k = v = torch.randn(6, HEADS, DK)
    with pytest.raises(ValueError, match=rf"edge_key must have shape \[E, H, d\] = \[{num_edges}, 2, 4\] \(got \[{num_edges}, 2, 3\]\)"):
        graph_attention(q, k, v, edge_index, edge_key=torch.randn(num_edges, HEADS, 3))
    with pytest.raises(ValueError, match=r"edge_value must have q's dtype torch.float32 \(got torch.float64\)"):
        graph_attention(q, k, v, edge_index, edge_value=torch.randn(num_edges, HEADS, DK, dtype=torch.float64))
    with pytest.raises(ValueError, match=rf"edge_key weight must have shape \[H \* d, F\] = \[8, 3\] \(got \[6, 3\]\)"):
        graph_attention(q, k, v, edge_index, edge_key=(torch.randn(num_edges, 3), torch.randn(6, 3)))
    with pytest.raises(ValueError, match=rf"edge_value features must have shape \[E, F\] with E = {num_edges}"):
        graph_attention(q, k, v, edge_index, edge_value=(torch.randn(num_edges - 1, 3), torch.randn(8, 3)))
    with pytest.raises(TypeError, match="edge_key must be a tensor"):
        graph_attention(q, k, v, edge_index, edge_key=(torch.randn(num_edges, 3),))
    with pytest.raises(ValueError, match="refers to key/source node 9"):
        graph_attention(q, k, v, torch.tensor([[9], [0]]), edge_key=torch.randn(1, HEADS, DK))


def test_one_pair_for_keys_and_values_of_different_widths_is_refused():
    """The same (features, weight) object for both terms is shared only when dk == dv."""
    edge_index = builders.window(6, 1)
    q, k, v = torch.randn(6, HEADS, DK), torch.randn(6, HEADS, DK), torch.randn(6, HEADS, DV)
    term = (torch.randn(edge_index.shape[1], 9), torch.randn(HEADS * DK, 9))
    with pytest.raises(ValueError, match=r"edge_value weight must have shape \[H \* d, F\] = \[10, 9\]"):
        graph_attention(q, k, v, edge_index, edge_key=term, edge_value=term)


def test_compiles_without_graph_breaks():
    """Under torch.compile the terms trace around the custom op, as one graph (fullgraph=True)."""
    from torch._dynamo.testing import CompileCounter

    edge_index, n, _ = PATTERNS["duplicates-unsorted"]()
    q, k, v = (torch.randn(n, HEADS, DK) for _ in range(3))
    e, w = torch.randn(edge_index.shape[1], 3), torch.randn(HEADS * DK, 3)

    def attend(q, k, v, edge_index, e, w, p):
        return graph_attention(q, k, v, edge_index, edge_key=(e, w), edge_value=(e, w), dropout_p=p)

    counter = CompileCounter()
    compiled = torch.compile(attend, backend=counter, fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v, edge_index, e, w, 0.0), attend(q, k, v, edge_index, e, w, 0.0),
                               rtol=1e-5, atol=1e-5)
    dropped = compiled(q, k, v, edge_index, e, w, 0.5)
    assert counter.frame_count == 2 and dropped.isfinite().all()
    assert not torch.allclose(dropped, attend(q, k, v, edge_index, e, w, 0.0))
