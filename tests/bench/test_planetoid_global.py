import networkx as nx
import pytest
import torch
from torch_geometric.data import Data

from tgattn.bench import models
from tgattn.bench import planetoid as bench
from tgattn.bench.models import GlobalNet, spd_buckets


def small_graph():
    """Two components: a 7-node path with a chord, and a triangle; undirected (both directions)."""
    pairs = [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 6), (1, 4), (7, 8), (8, 9), (9, 7)]
    src, dst = zip(*pairs)
    ei = torch.tensor([src + dst, dst + src])
    g = torch.Generator().manual_seed(0)
    return Data(x=torch.randn(10, 6, generator=g, dtype=torch.float64), edge_index=ei, y=torch.tensor([0, 1, 2] * 3 + [0]))


def test_spd_buckets_match_networkx():
    data = small_graph()
    graph = nx.Graph(data.edge_index.T.tolist())
    lengths = dict(nx.all_pairs_shortest_path_length(graph))
    buckets = spd_buckets(data.edge_index, 10, max_distance=2)
    for i in range(10):
        for j in range(10):
            d = lengths[i].get(j)
            assert buckets[i, j] == (4 if d is None else min(d, 3))
    assert spd_buckets(data.edge_index, 10, max_distance=9).max() == 11  # unreachable: its own bucket
    with pytest.raises(ValueError, match="max_distance must be a positive int"):
        spd_buckets(data.edge_index, 10, max_distance=0)


def test_union_with_local_only_bias_equals_the_local_model():
    """Bias -inf beyond distance 1 turns the all-pairs union back into graph edges + self-loops."""
    data = small_graph()
    torch.manual_seed(0)
    union = models.build_model("tgattn_union", data, "Cora").double().eval()
    assert isinstance(union, GlobalNet) and union.pairs.shape == (2, 100)
    local = models.build_model("tgattn", data, "Cora").double().eval()
    local.load_state_dict({k: v for k, v in union.state_dict().items() if k.startswith("conv")})
    with torch.no_grad():
        for emb in (union.bias1, union.bias2):
            assert torch.equal(emb.weight[:, 0], -2.0 * torch.arange(8.0, dtype=torch.float64))  # distance decay
            emb.weight[:2] = 0.0
            emb.weight[2:] = float("-inf")
    expected = local(data.x, data.edge_index)
    torch.testing.assert_close(union(data.x, data.edge_index), expected, rtol=1e-10, atol=1e-10)
    with torch.no_grad():
        union.bias1.weight[1, 0] = 0.7  # a neighbour bias in one head changes the output
    assert (union(data.x, data.edge_index) - expected).abs().max() > 1e-4


def test_global_model_ignores_edges_and_trains_its_distance_bias():
    data = small_graph()
    torch.manual_seed(0)
    plain = models.build_model("tgattn_global", data, "Cora").double().eval()
    assert plain.bias1 is None
    out = plain(data.x, data.edge_index)
    torch.testing.assert_close(plain(data.x, data.edge_index[:, :0]), out, rtol=0, atol=0)
    union = models.build_model("tgattn_union", data, "Cora").double().train()
    union(data.x, data.edge_index).pow(2).sum().backward()
    grad = union.bias1.weight.grad  # [8 buckets, 8 heads]
    assert torch.isfinite(grad).all()
    assert grad[[0, 1, 2, 3, 4, 7]].abs().sum(1).min() > 0  # every bucket present in the graph learns
    assert torch.equal(grad[[5, 6]], torch.zeros_like(grad[[5, 6]]))  # distances 5 and 6+ do not occur


def test_graph_transformer_models_are_accepted(data_root):
    args = bench.parse_args(["--model", "tgattn_global", "tgattn_union", "--data-root", str(data_root)])
    assert args.model == ["tgattn_global", "tgattn_union"]
