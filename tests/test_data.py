"""tgattn.data: sequences <-> PyG graphs, batches without crossing edges, padded round trips."""
import pytest
import torch
from torch_geometric.data import Batch, Data

from builder_checks import TOL
from tgattn import GraphAttention, builders
from tgattn.data import from_padded, sequence_to_graph, to_padded
from tgattn.reference import dense_attention


def test_single_sequence_ids_and_features():
    g = sequence_to_graph(torch.tensor([3, 1, 4, 1]), builders.window, w=1, strings=list("pita"))
    assert isinstance(g, Data) and g.num_nodes == 4
    assert torch.equal(g.edge_index, builders.window(4, 1)) and g.position.tolist() == [0, 1, 2, 3]
    assert g.x.tolist() == [3, 1, 4, 1] and g.text == ["p", "i", "t", "a"]
    f = sequence_to_graph(torch.randn(5, 8), builders.full)
    assert f.x.shape == (5, 8) and f.edge_index.shape[1] == 25
    assert sequence_to_graph([], builders.causal).edge_index.shape == (2, 0)


def test_batch_edges_never_cross_and_match_packed_builder():
    seqs = [torch.arange(4), torch.arange(1), torch.arange(7)]
    batch = sequence_to_graph(seqs, builders.dilated, w=1, dilation=2, strings=[list("abcd"), ["e"], list("fghijkl")])
    assert isinstance(batch, Batch) and batch.ptr.tolist() == [0, 4, 5, 12]
    assert torch.equal(batch.edge_index, builders.dilated([4, 1, 7], 1, 2))
    assert bool((batch.batch[batch.edge_index[0]] == batch.batch[batch.edge_index[1]]).all())
    assert batch.position.tolist() == [0, 1, 2, 3, 0, 0, 1, 2, 3, 4, 5, 6] and batch.text[2][0] == "f"


def test_random_builder_draws_per_sequence():
    g = torch.Generator().manual_seed(0)
    batch = sequence_to_graph([list(range(16))] * 2, builders.random, r=3, generator=g)
    first, second = batch.edge_index[:, :48], batch.edge_index[:, 48:] - 16
    assert first.shape[1] == 48 and not torch.equal(first, second)


def test_layer_on_batch_equals_padded_dense_attention():
    torch.manual_seed(0)
    lengths, T, D = [3, 6, 1], 6, 8
    x = torch.randn(3, T, D, dtype=torch.float64)
    pad = torch.arange(T).unsqueeze(0) >= torch.tensor(lengths).unsqueeze(1)  # [B, T], True = padding
    batch = from_padded(x, pad, builders.causal)
    layer = GraphAttention(D, 2).double()
    out, out_pad = to_padded(layer(batch.x, batch.edge_index), batch.batch, max_len=T)
    assert torch.equal(out_pad, pad)
    for b, length in enumerate(lengths):  # per item: dense causal attention over its real tokens
        q, k, v = layer.project(x[b, :length])
        ref = layer.out_proj(dense_attention(q, k, v, builders.to_mask(builders.causal(length), length)).reshape(length, D))
        torch.testing.assert_close(out[b, :length], ref, **TOL)
        assert not out[b, length:].any()


def test_padded_round_trip_right_and_left_padding():
    tokens = torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0], [11, 0, 0, 0]])
    pad = tokens == 0
    batch = from_padded(tokens, pad, builders.full)
    assert batch.x.tolist() == [5, 6, 7, 8, 9, 10, 11] and batch.ptr.tolist() == [0, 4, 6, 7]
    assert torch.equal(batch.edge_index, builders.full([4, 2, 1]))
    padded, mask = to_padded(batch)
    assert torch.equal(padded, tokens) and torch.equal(mask, pad)
    left = torch.tensor([[0, 0, 1, 2], [3, 4, 5, 6]])
    lb = from_padded(left, left == 0)
    assert lb.x.tolist() == [1, 2, 3, 4, 5, 6] and lb.position.tolist() == [0, 1, 0, 1, 2, 3]
    padded, mask = to_padded(lb, fill_value=-1, max_len=5)
    assert padded.tolist() == [[1, 2, -1, -1, -1], [3, 4, 5, 6, -1]] and mask.sum().item() == 4


def test_errors():
    with pytest.raises(ValueError, match="got 2 token strings for 3 tokens"):
        sequence_to_graph([1, 2, 3], strings=["a", "b"])
    with pytest.raises(ValueError, match="got 1 string lists for 2 sequences"):
        sequence_to_graph([[1], [2]], strings=[["a"]])
    with pytest.raises(ValueError, match="padding_mask must be a bool tensor of shape"):
        from_padded(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="returned node 5 for a sequence of 3 tokens"):
        sequence_to_graph([1, 2, 3], lambda n: torch.tensor([[5], [0]]))
    with pytest.raises(ValueError, match="max_len = 2 is shorter than the longest sequence"):
        to_padded(sequence_to_graph([[1, 2, 3]]), max_len=2)
    with pytest.raises(ValueError, match="token ids"):
        sequence_to_graph(torch.tensor([0.5, 1.5]))
