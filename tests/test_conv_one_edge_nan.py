"""GraphAttentionConv's one-edge-row shortcut does not change what a NaN or an infinity does.

A row with one in-edge has softmax weight 1 on it when its score is finite, so the conv skips its
query; a NaN or infinite score gives weight NaN instead. Oracles: PyG's ``TransformerConv`` with the
same weights, and the conv's own ``message_passing`` path (which has no shortcut). (A score of
``-inf`` is tgattn's removed edge: a row whose scores are all ``-inf`` outputs 0 on every path,
where ``TransformerConv`` gives NaN; the cases here give NaN or ``+inf`` scores.)
"""
import pytest
import torch
from torch_geometric.nn import TransformerConv

from tgattn.nn import GraphAttentionConv

# Node 0 has two in-edges, nodes 1-5 one each (more than half the rows: the shortcut's case).
EDGES = torch.tensor([[1, 2, 0, 1, 2, 3, 0], [0, 0, 1, 2, 3, 4, 5]])


def _bad_query_features(x, convs):
    x[5, 1] = float("nan")  # node 5: one in-edge, from node 0


def _infinite_query_features(x, convs):
    x[4, 0] = float("inf")


def _bad_query_weight(x, convs):
    for conv in convs:
        conv.lin_query.weight.data[0, 0] = float("nan")


def _bad_key_bias(x, convs):
    for conv in convs:
        conv.lin_key.bias.data[2] = float("nan")


@pytest.mark.parametrize("spoil", [_bad_query_features, _infinite_query_features, _bad_query_weight, _bad_key_bias])
@pytest.mark.parametrize("root_weight", [False, True])
def test_non_finite_scores_reach_one_edge_rows_as_in_transformer_conv(spoil, root_weight):
    torch.manual_seed(0)
    pyg = TransformerConv(4, 3, heads=2, root_weight=root_weight)
    ours = GraphAttentionConv(4, 3, heads=2, root_weight=root_weight)
    ours.load_state_dict(pyg.state_dict(), strict=False)  # without root_weight PyG keeps an unused lin_skip
    x = torch.randn(6, 4)
    with torch.no_grad():
        spoil(x, (pyg, ours))
        expected = pyg(x, EDGES)
        assert not torch.isfinite(expected).all()  # the case is one where a row goes NaN
        for backend in ("auto", "message_passing"):
            torch.testing.assert_close(ours(x, EDGES, backend=backend), expected, equal_nan=True, msg=backend)


def test_finite_inputs_still_take_the_shortcut(monkeypatch):
    """The check does not turn the shortcut off for finite inputs: the one-edge rows' queries are not projected."""
    conv = GraphAttentionConv(4, 3, heads=2, root_weight=False)
    rows_seen = []
    project = conv._project
    monkeypatch.setattr(conv, "_project", lambda *a: rows_seen.append(a[3]) or project(*a))
    conv(torch.randn(6, 4), EDGES)
    assert rows_seen[0].tolist() == [0]  # only node 0, the row with two edges
