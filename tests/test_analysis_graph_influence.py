"""Attention flow beside PyG's Jacobian influence on a graph (tgattn.analysis.graph_influence)."""
import networkx as nx
import pytest
import torch

from analysis_cases import flow_oracle
from tgattn import GraphAttentionConv
from tgattn.analysis.graph_influence import Stack, flow_beside_jacobian


def test_flow_and_jacobian_equal_their_oracles_per_node_and_per_hop():
    pytest.importorskip("torch_geometric.utils.influence")
    torch.manual_seed(0)
    n = 30
    edge_index = torch.randint(0, n, (2, 90))
    edge_index = edge_index[:, edge_index[0] != edge_index[1]]
    x = torch.randn(n, 6)
    model = Stack([GraphAttentionConv(6, 5, heads=2), GraphAttentionConv(10, 3, heads=1)]).eval()
    node = 7
    side = flow_beside_jacobian(model, x, edge_index, node)
    # the Jacobian on the whole graph, by torch (nodes past 2 hops get 0 there too)
    full = torch.autograd.functional.jacobian(lambda features: model(features, edge_index)[node], x)  # [3, N, 6]
    torch.testing.assert_close(side.jacobian, full.abs().sum((0, 2)).double(), atol=1e-5, rtol=1e-5)
    # the flow by networkx's max-flow on the layered graph of the model's own weights, built densely in the test
    # (not attention_flow, which the code under test calls: a wrong flow there would pass a comparison with itself)
    expected = flow_oracle(model.attention(x, edge_index), node, n)
    assert (expected > 0).sum() > 5  # the node has a cone of inputs to compare
    torch.testing.assert_close(side.flow, expected, atol=1e-12, rtol=0)
    # hops by networkx: the distance from each node to `node` along the edges
    graph = nx.DiGraph(edge_index.t().tolist())
    graph.add_nodes_from(range(n))
    distance = nx.single_target_shortest_path_length(graph, node)
    distance = dict(distance) if not isinstance(distance, dict) else distance
    for values, per_hop in ((side.flow, side.flow_per_hop), (side.jacobian, side.jacobian_per_hop)):
        sums = torch.stack([sum((values[j] for j, d in distance.items() if d == h), torch.zeros((), dtype=torch.float64))
                            for h in range(3)])
        torch.testing.assert_close(per_hop, sums / sums[0])
    with pytest.raises(ValueError, match=r"node must be in \[0, 30\) \(got 30\)"):
        flow_beside_jacobian(model, x, edge_index, 30)
