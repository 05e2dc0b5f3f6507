"""A NaN sink (``graph_attention(..., sinks=...)``) gives NaN in its head, the same on every backend.

The rule: a NaN sink is in every softmax of its head, so every output of that head is NaN (a
query without edges too: its softmax holds the sink alone) and so is every weight of that head;
the other heads are what they are with a finite sink there, checked against attention written out
edge by edge (tests/edgewise_oracle.py; before, against ``gather``, which a shared error would
pass). Before, csr / gather left the denominator at 1 (outputs outside the values' hull) and
fused / auto / tile / dense dropped the sink.
"""
import pytest
import torch

from edgewise_oracle import edgewise_attention
from tgattn import builders
from tgattn.functional import BACKENDS, graph_attention

NAN = float("nan")


def _inputs(dtype=torch.float64):
    g = torch.Generator().manual_seed(1)
    n = 7
    q, k = (torch.randn(n, 2, 4, generator=g, dtype=dtype) for _ in range(2))
    v = torch.rand(n, 2, 3, generator=g, dtype=dtype) * 2  # values in [0, 2): a hull to leave
    ei = builders.causal(n)[:, 1:]  # query 0 has no edge
    return q, k, v, ei


def _call(q, k, v, ei, sinks, attend, **kw):
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    out, weights = attend(*leaves[:3], ei, leaves[3], **kw)
    (out[:, 1].sum() + weights[:, 1].sum()).backward()  # the finite head's gradients
    return out, weights, [t.grad for t in leaves]


def _tgattn(backend):
    def attend(q, k, v, ei, sinks, **kw):
        return graph_attention(q, k, v, ei, sinks=sinks, backend=backend, return_weights=True, **kw)

    return attend


def _written_out(q, k, v, ei, sinks, edge_key=None, edge_value=None):
    """The oracle, with the (features, weight) pairs turned into vectors ``[E, H, d]`` here."""
    terms = [None if t is None else (t[0] @ t[1].T).view(ei.shape[1], q.shape[1], -1) for t in (edge_key, edge_value)]
    return edgewise_attention(q, k, v, ei, key_term=terms[0], value_term=terms[1], sinks=sinks)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("edge_terms", [False, True])
def test_a_nan_sink_makes_its_head_nan_and_leaves_the_others(backend, edge_terms):
    q, k, v, ei = _inputs()
    kw = {}
    if edge_terms:  # (features, weight) pairs: the fused kernel's edge-term path where it runs
        g = torch.Generator().manual_seed(2)
        e, w = torch.randn(ei.shape[1], 2, generator=g, dtype=q.dtype), torch.randn(8, 2, generator=g, dtype=q.dtype)
        kw = dict(edge_key=(e, w), edge_value=(e, w[:6]))
    sinks = torch.tensor([NAN, 0.3], dtype=q.dtype)
    out, weights, grads = _call(q, k, v, ei, sinks, _tgattn(backend), **kw)
    assert torch.isnan(out[:, 0]).all(), (backend, out[:, 0, 0])
    assert torch.isnan(weights[:, 0]).all(), (backend, weights[:, 0])
    finite = sinks.clone()
    finite[0] = 0.0
    ref, ref_weights, ref_grads = _call(q, k, v, ei, finite, _written_out, **kw)
    assert torch.equal(ref[0, 1], torch.zeros(3, dtype=q.dtype))  # query 0: the sink alone, no value
    torch.testing.assert_close(out[:, 1], ref[:, 1], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(weights[:, 1], ref_weights[:, 1], rtol=1e-10, atol=1e-10)
    for name, grad, ref_grad in zip("q k v".split(), grads, ref_grads):
        torch.testing.assert_close(grad[:, 1], ref_grad[:, 1], rtol=1e-10, atol=1e-10, msg=name)
    assert grads[3][1] == pytest.approx(float(ref_grads[3][1]), rel=1e-10)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_nan_sink_in_half_precision_and_without_edges(backend):
    q, k, v, ei = _inputs(torch.bfloat16)
    sinks = torch.tensor([0.0, NAN])  # float32 sinks with bfloat16 inputs
    out = graph_attention(q, k, v, ei, sinks=sinks, backend=backend)
    assert torch.isnan(out[:, 1]).all(), backend
    ref, _ = edgewise_attention(q.double(), k.double(), v.double(), ei, sinks=torch.tensor([0.0, 0.0], dtype=torch.float64))
    torch.testing.assert_close(out[:, 0].double(), ref[:, 0], rtol=0, atol=2e-2)  # bfloat16 outputs: 8 bits
    empty = torch.zeros(2, 0, dtype=torch.long)
    out = graph_attention(q, k, v, empty, sinks=sinks, backend=backend)
    assert torch.isnan(out[:, 1]).all() and torch.equal(out[:, 0], torch.zeros_like(out[:, 0])), backend
