"""tgattn.nn.GPSConv equals PyG's GPSConv (multi-head attention) on the same weights."""
import pytest
import torch
from torch import nn
from torch_geometric.data import Batch, Data
from torch_geometric.nn import GINEConv
from torch_geometric.nn import GPSConv as PyGGPSConv

from tgattn import GraphAttention, builders
from tgattn.nn import GPSConv, check_gps, full_per_graph

TOL = dict(rtol=1e-5, atol=1e-5)  # float32
D, H = 16, 4


def molecule_batch(lengths, seed=0):
    """Chains with random chords: graphs of unequal sizes, edge features of size D."""
    g = torch.Generator().manual_seed(seed)
    graphs = []
    for n in lengths:
        src = torch.arange(n - 1)
        ei = torch.stack([src, src + 1])
        ei = torch.cat([ei, ei.flip(0)], 1)
        graphs.append(Data(x=torch.randn(n, D, generator=g), edge_index=ei, edge_attr=torch.randn(ei.shape[1], D, generator=g)))
    return Batch.from_data_list(graphs)


def pyg_layer(seed=0, **kwargs):
    torch.manual_seed(seed)
    mlp = nn.Sequential(nn.Linear(D, D), nn.ReLU(), nn.Linear(D, D))
    return PyGGPSConv(D, GINEConv(mlp, edge_dim=D), heads=H, **kwargs)


def grads(layer, batch, **kwargs):
    x = batch.x.clone().requires_grad_()
    out = layer(x, batch.edge_index, batch.batch, edge_attr=batch.edge_attr, **kwargs)
    out.sin().sum().backward()
    return out, x.grad


def attn_grads(layer):
    """Gradients of W_Q, W_K, W_V, their biases and W_O, whatever the attention module."""
    attn = layer.attn
    if isinstance(attn, nn.MultiheadAttention):
        return [*attn.in_proj_weight.grad.split(D), *attn.in_proj_bias.grad.split(D), attn.out_proj.weight.grad]
    lins = (attn.q_proj, attn.k_proj, attn.v_proj)
    return [lin.weight.grad for lin in lins] + [lin.bias.grad for lin in lins] + [attn.out_proj.weight.grad]


@pytest.mark.parametrize("backend", ["auto", "fused", "csr"])
@pytest.mark.parametrize("training", [True, False])
def test_equals_pyg_gpsconv_outputs_and_gradients(backend, training):
    batch = molecule_batch([7, 3, 12, 1, 9, 5])  # unequal sizes: PyG pads to 12
    ref_layer = pyg_layer().train(training)
    layer = GPSConv.from_pyg(ref_layer, backend=backend)
    ref, ref_dx = grads(ref_layer, batch)
    out, dx = grads(layer, batch)
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(dx, ref_dx, **TOL)
    for a, b in zip(attn_grads(layer), attn_grads(ref_layer)):
        torch.testing.assert_close(a, b, **TOL)
    ref_params = dict(ref_layer.named_parameters())
    for name, p in layer.named_parameters():
        if not name.startswith("attn."):
            torch.testing.assert_close(p.grad, ref_params[name].grad, **TOL)


def test_explicit_edge_set_equals_default_and_is_used():
    batch = molecule_batch([4, 6])
    layer = GPSConv.from_pyg(pyg_layer()).eval()
    out = layer(batch.x, batch.edge_index, batch.batch, edge_attr=batch.edge_attr)
    pairs = builders.full([4, 6])
    torch.testing.assert_close(
        layer(batch.x, batch.edge_index, batch.batch, edge_attr=batch.edge_attr, attn_edge_index=pairs), out, **TOL
    )
    local = layer(batch.x, batch.edge_index, batch.batch, edge_attr=batch.edge_attr, attn_edge_index=builders.window([4, 6], 1))
    assert (local - out).abs().max() > 1e-3


def test_same_interface_and_instance_as_pyg():
    layer = GPSConv(D, None, heads=2, norm="layer_norm")
    assert isinstance(layer, PyGGPSConv) and isinstance(layer.attn, GraphAttention)
    assert repr(layer) == f"GPSConv({D}, conv=None, heads=2, attn_type=multihead)"
    layer.reset_parameters()
    out = layer(torch.randn(5, D), torch.empty(2, 0, dtype=torch.long), torch.tensor([0, 0, 1, 1, 1]))
    assert out.shape == (5, D)


def test_silent_skip_of_pyg_gpsconv_is_caught():
    layer = PyGGPSConv(D, None, heads=2, norm=None)
    x = torch.randn(3, D)
    plain = layer.mlp(2 * x) + 2 * x  # what PyG computes when attn is not an MHA: no attention
    layer.attn = GraphAttention(D, 2)
    torch.testing.assert_close(layer(x, torch.empty(2, 0, dtype=torch.long)), plain)
    with pytest.raises(TypeError, match="silently skips global attention"):
        check_gps(nn.ModuleList([nn.Linear(2, 2), layer]))
    fine = nn.ModuleList([pyg_layer(), GPSConv(D, None, heads=2)])
    assert check_gps(fine) is fine


@pytest.mark.parametrize("call,word", [
    (lambda: GPSConv(D, None, attn_type="performer"), "attn_type must be 'multihead'"),
    (lambda: GPSConv(D, None, attn_kwargs={"kdim": 3}), r"attn_kwargs takes 'dropout' and 'bias' \(got \['kdim'\]\)"),
    (lambda: full_per_graph(torch.tensor([1, 0]), 2), "batch must be sorted"),
    (lambda: full_per_graph(torch.tensor([0, 0]), 3), "batch has 2 entries, but x has 3 nodes"),
    (lambda: GPSConv.from_pyg(PyGGPSConv(D, None, attn_type="performer")), "must be an nn.MultiheadAttention"),
])
def test_errors_name_the_value(call, word):
    with pytest.raises((ValueError, TypeError), match=word):
        call()


@pytest.mark.parametrize("batch", [[0, 0, 1, 1, 1, 2], [0] * 5, [0, 1, 1, 3, 3], [0], [0, 1, 2], []],
                         ids=["three", "one_graph", "an_empty_graph", "one_node", "single_nodes", "no_nodes"])
def test_all_pairs_per_graph_is_what_the_analysis_of_full_per_graph_finds(batch):
    """GPS's default set, made without an analysis (no read back on a GPU), against the analysis of its edges."""
    from tgattn.edgeset import all_pairs_per_graph
    from tgattn.engine.analysis import analyse, row_spans

    batch = torch.tensor(batch, dtype=torch.long)
    n = batch.numel()
    made = all_pairs_per_graph(batch, torch.bincount(batch).tolist()).structure
    found = analyse(full_per_graph(batch, n), n, n)
    for field in ("n_q", "n_k", "num_edges", "perm", "duplicates", "kind", "lengths", "intervals"):
        assert getattr(made, field) == getattr(found, field), field
    for field in ("src", "dst", "rowptr"):
        assert torch.equal(getattr(made, field), getattr(found, field)), field
    if n:  # (an empty set has no row spans)
        assert made.extras["row_spans"] == row_spans(found)
