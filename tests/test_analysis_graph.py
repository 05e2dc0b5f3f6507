import networkx as nx
import pytest
import torch

from analysis_cases import HAND, random_stack
from tgattn import builders
from tgattn.analysis import layer_matrix, to_networkx, to_networkx_layered


def test_edges_follow_the_pyg_direction_with_weights_per_head():
    n = 5
    (layer,), (dense,) = random_stack([builders.causal(n)], n, heads=2)
    ei, alpha = layer
    tokens = ["The", "sky", "is", "blue", "."]
    graph = to_networkx(ei, alpha, tokens=tokens)
    assert graph.number_of_nodes() == n and graph.number_of_edges() == ei.shape[1]
    assert [graph.nodes[i]["token"] for i in range(n)] == tokens
    assert sorted(graph.predecessors(3)) == [0, 1, 2, 3]  # query 3 reads keys 0..3
    for j, i, data in graph.edges(data=True):  # edge j -> i carries A[i, j]
        assert data["heads"] == pytest.approx(dense[:, i, j].tolist(), abs=1e-12)
        assert data["weight"] == pytest.approx(float(dense[:, i, j].mean()), abs=1e-12)
    one = to_networkx(ei, alpha, head=1)
    assert all(d["weight"] == pytest.approx(float(dense[1, i, j]), abs=1e-12) for j, i, d in one.edges(data=True))
    mean = to_networkx(ei, alpha, head="mean")
    assert all(set(d) == {"weight"} for _, _, d in mean.edges(data=True))
    # Each query's incoming weights sum to 1 (softmax over its keys).
    for i in range(n):
        assert sum(d["weight"] for _, _, d in graph.in_edges(i, data=True)) == pytest.approx(1.0, abs=1e-12)


def test_bare_pattern_and_duplicates():
    ei = builders.window(4, 1)
    graph = to_networkx(ei)
    assert set(graph.edges) == {tuple(e) for e in ei.t().tolist()}
    assert all(not d for _, _, d in graph.edges(data=True))
    assert to_networkx(builders.causal(2), num_nodes=4).number_of_nodes() == 4
    doubled = torch.tensor([[0, 0], [1, 1]])
    graph = to_networkx(doubled, torch.tensor([[0.25, 1.0], [0.5, 0.0]]))
    assert graph.edges[0, 1] == {"weight": 0.875, "heads": (0.75, 1.0)}


def test_layered_graph_matches_layer_matrices():
    graph = to_networkx_layered(HAND, tokens=["a", "b", "c"])
    assert graph.number_of_nodes() == 9
    # Raw attention: the 6 edges of causal(3) per layer, zero weights included (the pattern).
    assert graph.number_of_edges() == 12
    assert graph.edges[(1, 1), (2, 2)]["weight"] == 0.5 and graph.edges[(1, 1), (2, 1)]["weight"] == 0.0
    assert not graph.has_edge((1, 2), (2, 1))
    assert graph.nodes[(1, 2)] == {"layer": 1, "position": 2, "token": "c"}
    assert nx.is_directed_acyclic_graph(graph)
    residual = to_networkx_layered(HAND, residual=True)
    for layer, (ei, alpha) in enumerate(HAND, start=1):
        dense = layer_matrix(ei, alpha, 3).to_dense()
        for i in range(3):
            for j in range(3):
                edge = ((layer - 1, j), (layer, i))
                assert residual.has_edge(*edge) == (j <= i)  # causal edges + self-loops
                assert residual.get_edge_data(*edge, {"weight": 0.0})["weight"] == dense[i, j]


def test_graph_errors():
    with pytest.raises(ValueError, match="tokens has 2 labels"):
        to_networkx(builders.causal(3), tokens=["a", "b"], num_nodes=3)
    with pytest.raises(ValueError, match="head 3"):
        to_networkx(builders.causal(2), torch.ones(3, 2), head=3)
    with pytest.raises(ValueError, match="alpha has 2 rows"):
        to_networkx(builders.causal(2), torch.ones(2, 2))
