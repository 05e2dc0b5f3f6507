"""+inf in edge features makes the output of its query non-finite, the same on every backend.

``graph_attention(edge_key=...)`` adds the key term to the scores as a bias, where a caller's +inf
is refused ("bias holds +inf"); a +inf that comes from edge features is what an infinite key gives:
the softmax of a +inf score, NaN, for that query only (``TransformerConv`` gives a non-finite row).
The other queries are checked against attention written out edge by edge (tests/edgewise_oracle.py;
before, against ``gather``, which an error shared with it would pass).
"""
import pytest
import torch
from torch_geometric.nn import TransformerConv

from edgewise_oracle import edgewise_attention
from tgattn import builders
from tgattn.functional import BACKENDS, graph_attention
from tgattn.nn import GraphAttentionConv

N, HEADS, D, F = 6, 2, 4, 3
BAD_EDGE = 7  # edge (j, i) = (1, 3) of causal(6)


def _inputs():
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(N, HEADS, D, generator=g, dtype=torch.float64) for _ in range(3))
    q = q.abs()  # with positive weights: a +inf feature gives +inf key scores, in every head
    ei = builders.causal(N)
    features = torch.randn(ei.shape[1], F, generator=g, dtype=torch.float64)
    weight = torch.randn(HEADS * D, F, generator=g, dtype=torch.float64).abs()
    return q, k, v, ei, features, weight


TERMS = {
    "pair key": lambda e, w: dict(edge_key=(e, w)),
    "pair key and value": lambda e, w: dict(edge_key=(e, w), edge_value=(e, w)),
    "vector key": lambda e, w: dict(edge_key=(e @ w.T).view(-1, HEADS, D)),
    "pair value": lambda e, w: dict(edge_value=(e, w)),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("term", list(TERMS))
def test_inf_edge_features_give_their_query_a_non_finite_row(backend, term):
    q, k, v, ei, features, weight = _inputs()
    spoilt = features.clone()
    spoilt[BAD_EDGE, 1] = float("inf")
    out = graph_attention(q, k, v, ei, backend=backend, **TERMS[term](spoilt, weight))
    query = int(ei[1, BAD_EDGE])
    assert not torch.isfinite(out[query]).any(), (backend, out[query])  # (a -inf score would drop the edge)
    ref, _ = edgewise_attention(q, k, v, ei, **_as_vectors(TERMS[term](features, weight)))
    others = torch.arange(N) != query
    torch.testing.assert_close(out[others], ref[others], rtol=1e-10, atol=1e-10)


def _as_vectors(terms: dict) -> dict:
    """graph_attention's ``edge_key`` / ``edge_value`` as the oracle's vectors ``[E, H, D]``."""
    vector = {name: t if isinstance(t, torch.Tensor) else (t[0] @ t[1].T).view(-1, HEADS, D) for name, t in terms.items()}
    return {{"edge_key": "key_term", "edge_value": "value_term"}[name]: t for name, t in vector.items()}


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_given_inf_bias_is_still_refused_beside_edge_terms(backend):
    q, k, v, ei, features, weight = _inputs()
    bias = torch.zeros(ei.shape[1], dtype=torch.float64)
    bias[3] = float("inf")
    with pytest.raises(ValueError, match=r"^bias holds \+inf"):
        graph_attention(q, k, v, ei, bias=bias, backend=backend, edge_key=(features, weight))


@pytest.mark.parametrize("backend", ["auto", "csr", "gather", "message_passing"])
def test_the_conv_follows_transformer_conv(backend):
    torch.manual_seed(1)
    pyg = TransformerConv(4, D, heads=HEADS, edge_dim=F)
    conv = GraphAttentionConv(4, D, heads=HEADS, edge_dim=F)
    conv.load_state_dict(pyg.state_dict())
    x, ei = torch.randn(N, 4), builders.causal(N)
    edge_attr = torch.randn(ei.shape[1], F)
    edge_attr[BAD_EDGE, 0] = float("inf")
    with torch.no_grad():
        expected, out = pyg(x, ei, edge_attr), conv(x, ei, edge_attr, backend=backend)
    assert torch.equal(torch.isfinite(out), torch.isfinite(expected))
    assert not torch.isfinite(expected[int(ei[1, BAD_EDGE])]).all()
    torch.testing.assert_close(out.nan_to_num(0, 0, 0), expected.nan_to_num(0, 0, 0))


def test_edge_bias_features_give_their_query_a_non_finite_row():
    conv = GraphAttentionConv(4, D, heads=HEADS, edge_bias_dim=F)
    x, ei = torch.randn(N, 4), builders.causal(N)
    edge_attr = torch.randn(ei.shape[1], F)
    with torch.no_grad():
        conv.lin_edge_bias.weight.abs_()  # a +inf feature gives a +inf score bias
        ref = conv(x, ei, edge_attr)
        edge_attr[BAD_EDGE, 2] = float("inf")
        out = conv(x, ei, edge_attr)
    query = int(ei[1, BAD_EDGE])
    assert torch.isnan(out[query]).all()
    others = torch.arange(N) != query
    torch.testing.assert_close(out[others], ref[others])
