"""from_networkx: a directed graph's adjacency is the attention mask (transposed)."""
import networkx as nx
import pytest
import torch

from builder_checks import assert_edge_set, assert_layer_matches_dense, assert_matches_dense
from tgattn import builders


def twin(G, nodes):
    adjacency = torch.as_tensor(nx.to_numpy_array(G, nodelist=nodes)) > 0  # [u, v] = edge u -> v
    return adjacency.T.contiguous()  # mask[i = v, j = u]


@pytest.mark.parametrize("n,p,seed", [(0, 0.5, 0), (1, 0.0, 0), (12, 0.3, 1), (25, 0.15, 2)])
def test_random_digraph(n, p, seed):
    G = nx.gnp_random_graph(n, p, seed=seed, directed=True)
    G.add_edges_from([(0, 0)] if n else [])
    e = builders.from_networkx(G)
    assert_edge_set(e, twin(G, list(G)))
    if n > 1:
        assert_matches_dense(e, n)
        assert_layer_matches_dense(e, n)


def test_labels_order_undirected_and_multigraph():
    G = nx.DiGraph([("c", "a"), ("a", "b")])
    order = ["a", "b", "c"]
    assert_edge_set(builders.from_networkx(G, nodelist=order), twin(G, order))
    U = nx.path_graph(5)
    assert torch.equal(builders.from_networkx(U), builders.difference(builders.window(5, 1), torch.arange(5).expand(2, 5)))
    M = nx.MultiDiGraph([(0, 1), (0, 1), (1, 0)])
    assert builders.from_networkx(M).tolist() == [[1, 0], [0, 1]]


def test_errors():
    G = nx.DiGraph([(0, 1), (1, 2)])
    with pytest.raises(ValueError, match="node 2 has an edge but is not in nodelist"):
        builders.from_networkx(G, nodelist=[0, 1])
    with pytest.raises(ValueError, match="twice"):
        builders.from_networkx(G, nodelist=[0, 1, 1, 2])
