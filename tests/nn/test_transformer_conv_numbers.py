"""tgattn.nn.TransformerConv is PyG's TransformerConv in its numbers too (PyG's own test file,
tests/nn/test_transformer_conv.py, checks the interface only)."""
import torch
import torch_geometric.nn

from tgattn.nn import GraphAttentionConv, TransformerConv


def test_loads_pyg_weights_and_gives_its_numbers():
    torch.manual_seed(0)
    pyg = torch_geometric.nn.TransformerConv(8, 4, heads=2, beta=True, edge_dim=3)
    ours = TransformerConv(8, 4, heads=2, beta=True, edge_dim=3)
    ours.load_state_dict(pyg.state_dict(), strict=True)
    x, edge_index, edge_attr = torch.randn(5, 8), torch.tensor([[0, 1, 2, 3, 4], [1, 2, 3, 4, 0]]), torch.randn(5, 3)
    out, (edges, alpha) = ours(x, edge_index, edge_attr, return_attention_weights=True)
    ref, (ref_edges, ref_alpha) = pyg(x, edge_index, edge_attr, return_attention_weights=True)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(alpha, ref_alpha)
    assert torch.equal(edges, ref_edges) and ours._alpha is None and isinstance(ours, GraphAttentionConv)
    assert repr(ours) == repr(pyg) == "TransformerConv(8, 4, heads=2)"
