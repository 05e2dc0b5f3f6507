"""Graphormer encodings: shortest-path distances vs networkx, bias gradients vs the dense oracle."""
import networkx as nx
import pytest
import torch

from tgattn import builders
from tgattn.functional import graph_attention
from tgattn.nn import CentralityEncoding, SpatialEncoding, shortest_path_distance
from tgattn.reference import dense_attention

TOL = dict(rtol=0.0, atol=1e-10)  # float64


def random_graph(n, m, seed, directed=False):
    g = torch.Generator().manual_seed(seed)
    ei = torch.randint(0, n, (2, m), generator=g)
    ei = ei[:, ei[0] != ei[1]]
    return ei if directed else torch.cat([ei, ei.flip(0)], 1)


@pytest.mark.parametrize("directed", [False, True])
@pytest.mark.parametrize("max_distance", [0, 2, 30])
def test_distance_equals_networkx(directed, max_distance):
    n = 25
    ei = random_graph(n, 22, seed=1, directed=directed)
    G = nx.DiGraph()
    G.add_nodes_from(range(n))
    G.add_edges_from(ei.t().tolist())
    lengths = dict(nx.all_pairs_shortest_path_length(G))
    pairs = builders.union(builders.window(n, 3), builders.random(n, 4, generator=torch.Generator().manual_seed(2)))
    expected = torch.tensor([min(lengths[j].get(i, 10**6), max_distance + 1) for j, i in pairs.t().tolist()])
    assert torch.equal(shortest_path_distance(ei, pairs, n, max_distance=max_distance), expected)


def test_distance_of_packed_graphs_never_crosses_graphs():
    ei = torch.tensor([[0, 1, 3], [1, 2, 4]])
    ei = torch.cat([ei, ei.flip(0)], 1)
    d = shortest_path_distance(ei, builders.full(5), 5, max_distance=4)
    dense = torch.full((5, 5), 5)
    dense[builders.full(5)[1], builders.full(5)[0]] = d
    assert torch.equal(dense[:3, :3], torch.tensor([[0, 1, 2], [1, 0, 1], [2, 1, 0]]))
    assert (dense[:3, 3:] == 5).all() and (dense[3:, :3] == 5).all() and dense[3, 4] == 1


@pytest.mark.parametrize("pattern", ["full", "sparse"])
@pytest.mark.parametrize("backend", ["auto", "fused", "csr"])
def test_learned_distance_bias_gradient_equals_dense_oracle(pattern, backend):
    n, h = 14, 3
    ei = random_graph(n, 16, seed=3)
    pairs = builders.full(n) if pattern == "full" else builders.union(builders.add_self_loops(ei, n), builders.window(n, 2))
    dist = shortest_path_distance(ei, pairs, n, max_distance=3)
    torch.manual_seed(0)
    enc = SpatialEncoding(h, max_distance=3).double()
    torch.nn.init.normal_(enc.bias.weight)
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(n, h, 5, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out = graph_attention(q, k, v, pairs, bias=enc(dist), backend=backend)
    grads = torch.autograd.grad(out.sin().sum(), (q, k, v, enc.bias.weight))
    # oracle: the same table read densely, [H, N, N], masked to the pattern
    dense_dist = torch.full((n, n), 4, dtype=torch.long)
    dense_dist[pairs[1], pairs[0]] = dist
    ref = dense_attention(q, k, v, builders.to_mask(pairs, n), bias=enc(dense_dist).permute(2, 0, 1))
    ref_grads = torch.autograd.grad(ref.sin().sum(), (q, k, v, enc.bias.weight))
    torch.testing.assert_close(out, ref, **TOL)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, **TOL)
    assert grads[3].abs().sum() > 0


def test_spatial_encoding_buckets_and_zero_start():
    enc = SpatialEncoding(2, max_distance=2)
    assert torch.equal(enc(torch.tensor([0, 5])), torch.zeros(2, 2))
    with torch.no_grad():
        enc.bias.weight.copy_(torch.arange(8.0).view(4, 2))
    assert torch.equal(enc(torch.tensor([1, 3, 99])), torch.tensor([[2.0, 3.0], [6.0, 7.0], [6.0, 7.0]]))
    assert repr(enc) == "SpatialEncoding(heads=2, max_distance=2)"


def test_centrality_encoding_adds_degree_vectors():
    enc = CentralityEncoding(3, max_degree=1)
    ei = torch.tensor([[0, 0, 1], [1, 2, 2]])  # in-degrees 0, 1, 2 -> capped 0, 1, 1; out-degrees 2, 1, 0 -> 1, 1, 0
    x = torch.randn(3, 3)
    expected = x + enc.in_degree.weight[[0, 1, 1]] + enc.out_degree.weight[[1, 1, 0]]
    torch.testing.assert_close(enc(x, ei), expected)


def test_errors_name_the_value():
    with pytest.raises(ValueError, match=r"max_distance must be >= 0 \(got -1\)"):
        shortest_path_distance(torch.zeros(2, 0, dtype=torch.long), builders.full(2), 2, max_distance=-1)
    with pytest.raises(ValueError, match=r"num_heads must be >= 1 \(got 0\)"):
        SpatialEncoding(0)
