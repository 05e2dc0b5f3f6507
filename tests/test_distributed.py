"""tgattn.distributed without processes: partitions, plans (all ranks built in one process), and
attention over each rank's key table filled by hand, against single-process graph_attention."""
import pytest
import torch

from tgattn import GraphAttention, GraphAttentionConv, builders
from tgattn.functional import graph_attention
from tgattn.distributed import (DistributedGraphAttention, DistributedGraphAttentionConv, Partition, bandwidth,
                                contiguous, distribute, halo_exchange, halo_rows, louvain, make_plan, make_plans,
                                partition_graph)
from tgattn.distributed.gnn import graph_with_loops

from conftest import DATA

GEN = torch.Generator().manual_seed(0)
EDGE_SETS = {
    "window": builders.window(50, 3),
    "causal_window": builders.window(50, 4, causal=True),
    "bigbird": builders.bigbird(50, 2, 1, 2, generator=GEN),
    "random": builders.random(50, 4, generator=GEN),
    "causal": builders.causal(50),
    "packed": builders.causal([20, 30]),
}


def test_contiguous_ranges():
    p = contiguous(10, 4)
    assert p.sizes() == [3, 3, 2, 2]
    assert torch.equal(torch.cat([p.nodes(r) for r in range(4)]), torch.arange(10))
    assert contiguous(2, 4).sizes() == [1, 1, 0, 0]
    with pytest.raises(ValueError, match="world_size > 0"):
        contiguous(5, 0)


def test_partition_rejects_bad_owners():
    with pytest.raises(ValueError, match="outside 0 .. 1"):
        Partition(torch.tensor([0, 2]), 2)
    with pytest.raises(ValueError, match="LongTensor"):
        Partition(torch.tensor([0.0, 1.0]), 2)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_window_halo_is_w_rows_per_boundary(world):
    w = 4
    assert halo_rows(builders.window(60, w, causal=True), contiguous(60, world)) == [0] + [w] * (world - 1)
    assert halo_rows(builders.window(60, w), contiguous(60, world)) == [w] + [2 * w] * (world - 2) + [w]


@pytest.mark.parametrize("name", list(EDGE_SETS))
@pytest.mark.parametrize("world", [2, 3])
def test_plans_route_every_row(name, world):
    """Local edges are the rank's edges; the key table holds exactly the rows they read, own rows in
    place; what each rank sends to another is exactly what that one lists in its halo."""
    edge_index = EDGE_SETS[name]
    part = contiguous(50, world)
    plans = make_plans(edge_index, part)
    minimum = halo_rows(edge_index, part)
    for r, plan in enumerate(plans):
        assert torch.equal(plan.global_edges(), part.local_edges(edge_index, r))
        assert torch.equal(plan.keys[plan.own_offset:plan.own_offset + plan.num_queries], plan.nodes)
        assert plan.halo_rows == minimum[r] == plan.num_keys - plan.num_queries
        assert torch.equal(torch.unique(plan.keys), torch.unique(torch.cat([plan.nodes, plan.global_edges()[0]])))
        assert bool((plan.keys[1:] > plan.keys[:-1]).all())  # contiguous ranges: the table stays in order
    for r, plan in enumerate(plans):
        sent = plan.nodes[plan.send_index].split(plan.send_counts)
        for w, other in enumerate(plans):
            halo = torch.cat([other.keys[:other.own_offset], other.keys[other.own_offset + other.num_queries:]])
            assert torch.equal(sent[w], halo.split(other.recv_counts)[r])


@pytest.mark.parametrize("name", list(EDGE_SETS))
def test_key_tables_give_single_process_attention(name):
    """Each rank's attention over its key table (filled by hand) equals one process on its rows."""
    edge_index = EDGE_SETS[name]
    q, k, v = (torch.randn(50, 2, 4, dtype=torch.float64) for _ in range(3))
    bias = torch.randn(edge_index.shape[1], 2, dtype=torch.float64)
    ref = graph_attention(q, k, v, edge_index, bias=bias)
    part = Partition(torch.randint(3, (50,), generator=torch.Generator().manual_seed(1)), 3)  # scattered owners
    for r, plan in enumerate(make_plans(edge_index, part)):
        mine = part.owner[edge_index[1]] == r
        out = graph_attention(q[plan.nodes], k[plan.keys], v[plan.keys], plan.edge_index, bias=bias[mine])
        torch.testing.assert_close(out, ref[plan.nodes], rtol=0, atol=1e-10)


def test_one_rank_needs_no_process_group():
    layer = GraphAttention(8, 2).double()
    x = torch.randn(20, 8, dtype=torch.float64)
    edge_index = builders.window(20, 3)
    plan = make_plan(edge_index, contiguous(20, 1))
    assert halo_exchange(x, plan) is x
    torch.testing.assert_close(DistributedGraphAttention.from_layer(layer)(x, plan), layer(x, edge_index))
    with pytest.raises(ValueError, match="x has 19 rows, but rank 0 owns 20"):
        halo_exchange(x[:19], plan)
    with pytest.raises(ValueError, match="refers to node 20, but the partition has 20 nodes"):
        make_plan(torch.tensor([[20], [0]]), contiguous(20, 1))


def test_distribute_swaps_layers_with_their_weights():
    from tgattn.models import GPT, GPTConfig

    model = GPT(GPTConfig(block_size=8, vocab_size=5, n_layer=2, n_head=2, n_embd=8))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    distribute(model)
    assert all(isinstance(b.attn, DistributedGraphAttention) for b in model.transformer.h)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_conv_needs_self_loops_in_the_graph():
    with pytest.raises(ValueError, match="add the loops"):
        DistributedGraphAttentionConv(8, 4, add_self_loops=True)
    with pytest.raises(ValueError, match="adds self-loops"):
        DistributedGraphAttentionConv.from_conv(GraphAttentionConv(8, 4, add_self_loops=True))


@pytest.fixture(scope="module")
def cora():
    from tgattn.datasets import load_planetoid

    if not DATA.is_dir():
        pytest.skip(f"shared data folder not found at {DATA} (set TGATTN_DATA)")
    return load_planetoid("Cora", DATA)


def test_graph_partitioners_on_cora(cora):
    """Balanced parts; the graph partitioners leave a smaller halo than node-id ranges."""
    ei, n = cora.edge_index, cora.num_nodes
    halo = {}
    for part in (louvain(ei, n, 4), bandwidth(ei, n, 4), contiguous(n, 4)):
        assert max(part.sizes()) <= 1.1 * n / 4, (part.method, part.sizes())
        halo[part.method] = sum(halo_rows(ei, part))
    assert halo["louvain"] < halo["bandwidth"] < halo["contiguous"]
    plans = make_plans(graph_with_loops(cora), louvain(ei, n, 4))
    assert sum(p.halo_rows for p in plans) == halo["louvain"]  # self-loops never cross


def test_metis_on_cora(cora):
    pytest.importorskip("pymetis")
    ei, n = cora.edge_index, cora.num_nodes
    part = partition_graph(ei, n, 4)
    assert part.method == "metis"
    assert max(part.sizes()) <= 1.05 * n / 4
    assert sum(halo_rows(ei, part)) < sum(halo_rows(ei, louvain(ei, n, 4)))


def test_partition_graph_names_the_bad_method():
    with pytest.raises(ValueError, match="'spectral'"):
        partition_graph(EDGE_SETS["window"], 50, 2, method="spectral")
