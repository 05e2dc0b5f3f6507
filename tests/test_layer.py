"""GraphAttention against nn.MultiheadAttention and the dense oracle."""
import pytest
import torch
from torch import nn
from torch_geometric.data import Batch, Data

from tgattn import GraphAttention, builders
from tgattn.reference import dense_attention

TOL = dict(rtol=1e-10, atol=1e-10)


@pytest.fixture(autouse=True)
def _float64():
    """This module compares at 1e-10, so layers and inputs are built in float64."""
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(torch.float32)


def _mha_inputs(mha, x, batch_first):
    """x is [B, T, D]; MHA wants [T, B, D] unless batch_first."""
    return x if batch_first else x.transpose(0, 1)


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("heads", [1, 2, 8])
def test_from_multihead_with_attn_mask(batch_first, heads):
    B, T, D = 3, 7, 16
    mha = nn.MultiheadAttention(D, heads, batch_first=batch_first).eval()
    layer = GraphAttention.from_multihead(mha)
    x = torch.randn(B, T, D)
    allowed = torch.rand(T, T) < 0.5
    allowed |= torch.eye(T, dtype=torch.bool)  # no empty rows: MHA would return NaN there
    ref, ref_w = mha(*(_mha_inputs(mha, x, batch_first),) * 3, attn_mask=~allowed, average_attn_weights=False)
    ref = ref if batch_first else ref.transpose(0, 1)  # [B, T, D]
    edge_index = builders.from_mask(allowed.expand(B, T, T))
    out, (_, alpha) = layer(x.reshape(B * T, D), edge_index, return_attention_weights=True)
    torch.testing.assert_close(out.view(B, T, D), ref, **TOL)
    b, i = edge_index[1] // T, edge_index[1] % T
    torch.testing.assert_close(alpha, ref_w[b, :, i, edge_index[0] % T], **TOL)  # [E, H]


@pytest.mark.parametrize("batch_first", [False, True])
def test_from_multihead_with_key_padding_mask_and_causal(batch_first):
    B, T, D = 3, 6, 8
    mha = nn.MultiheadAttention(D, 2, batch_first=batch_first).eval()
    layer = GraphAttention.from_multihead(mha)
    x = torch.randn(B, T, D)
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[1, 4:] = True
    pad[2, 2:] = True  # lengths 6, 4, 2
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    ref, _ = mha(*(_mha_inputs(mha, x, batch_first),) * 3, attn_mask=~causal, key_padding_mask=pad)
    ref = ref if batch_first else ref.transpose(0, 1)
    allowed = causal & ~pad[:, None, :]  # [B, T(query), T(key)]
    out = layer(x.reshape(B * T, D), builders.from_mask(allowed))
    torch.testing.assert_close(out.view(B, T, D), ref, **TOL)
    # The same queries, packed without padding: the causal builder on the lengths.
    lengths = (~pad).sum(1).tolist()
    packed_x = x[~pad]
    torch.testing.assert_close(layer(packed_x, builders.causal(lengths)), ref[~pad], **TOL)


def test_from_multihead_cross_attention_with_kdim_vdim():
    D, kdim, vdim, S, T = 8, 5, 3, 9, 4
    mha = nn.MultiheadAttention(D, 2, kdim=kdim, vdim=vdim).eval()
    layer = GraphAttention.from_multihead(mha)
    query, key, value = torch.randn(T, 1, D), torch.randn(S, 1, kdim), torch.randn(S, 1, vdim)
    allowed = torch.rand(T, S) < 0.5
    allowed[:, 0] = True
    ref, _ = mha(query, key, value, attn_mask=~allowed)
    # The layer's input pair (x_kv, x_q) shares one tensor for keys and values; with separate
    # key and value features, check the copied projections through the oracle instead.
    h, d = layer.num_heads, layer.head_dim
    q = layer.q_proj(query[:, 0]).view(T, h, d)
    k = layer.k_proj(key[:, 0]).view(S, h, d)
    v = layer.v_proj(value[:, 0]).view(S, h, d)
    out = layer.out_proj(dense_attention(q, k, v, allowed).reshape(T, D))
    torch.testing.assert_close(out, ref[:, 0], **TOL)


def test_cross_attention_pair_input_equals_mha():
    D, S, T = 8, 9, 4
    mha = nn.MultiheadAttention(D, 4).eval()
    layer = GraphAttention.from_multihead(mha)
    x_q, x_kv = torch.randn(T, D), torch.randn(S, D)
    allowed = torch.rand(T, S) < 0.6
    allowed[:, 2] = True
    ref, _ = mha(x_q[:, None], x_kv[:, None], x_kv[:, None], attn_mask=~allowed)
    torch.testing.assert_close(layer((x_kv, x_q), builders.from_mask(allowed)), ref[:, 0], **TOL)


def test_to_multihead_round_trip():
    layer = GraphAttention(12, 3)
    back = GraphAttention.from_multihead(layer.to_multihead(batch_first=True))
    x, ei = torch.randn(5, 12), builders.causal(5)
    torch.testing.assert_close(back(x, ei), layer(x, ei), rtol=0, atol=0)


@pytest.mark.parametrize("bias_shape", [None, "E", "EH"])
def test_message_passing_path_equals_functional_path(bias_shape):
    layer = GraphAttention(16, 4)
    x, ei = torch.randn(10, 16), builders.window(10, 2)
    bias = {None: None, "E": torch.randn(ei.shape[1]), "EH": torch.randn(ei.shape[1], 4)}[bias_shape]
    if bias is not None:
        bias[::3] = float("-inf")
    out_f, (_, a_f) = layer(x, ei, edge_bias=bias, return_attention_weights=True)
    out_m, (_, a_m) = layer(x, ei, edge_bias=bias, return_attention_weights=True, backend="message_passing")
    torch.testing.assert_close(out_m, out_f, **TOL)
    torch.testing.assert_close(a_m, a_f, **TOL)
    g_f = torch.autograd.grad(out_f.sum(), layer.q_proj.weight)
    out_m = layer(x, ei, edge_bias=bias, backend="message_passing")
    g_m = torch.autograd.grad(out_m.sum(), layer.q_proj.weight)
    torch.testing.assert_close(g_m[0], g_f[0], **TOL)


def test_layer_equals_dense_oracle_with_bias():
    layer = GraphAttention(8, 2)
    x, ei = torch.randn(6, 8), builders.causal(6)
    bias = torch.randn(ei.shape[1], 2)
    q, k, v = layer.project(x)
    dense_bias = torch.zeros(2, 6, 6)
    dense_bias[:, ei[1], ei[0]] = bias.T
    ref = layer.out_proj(dense_attention(q, k, v, builders.to_mask(ei, 6), bias=dense_bias).reshape(6, 8))
    torch.testing.assert_close(layer(x, ei, edge_bias=bias), ref, **TOL)


def test_isolated_query_outputs_projection_bias():
    layer = GraphAttention(4, 1)
    nn.init.normal_(layer.out_proj.bias)
    out = layer(torch.randn(3, 4), torch.tensor([[0, 1], [0, 0]]))  # nodes 1, 2 have no edges
    torch.testing.assert_close(out[1:], layer.out_proj.bias.expand(2, 4), rtol=0, atol=0)


def test_dropout_only_in_training():
    layer = GraphAttention(8, 2, dropout=0.5)
    x, ei = torch.randn(20, 8), builders.full(20)
    layer.eval()
    torch.testing.assert_close(layer(x, ei), layer(x, ei), rtol=0, atol=0)
    layer.train()
    assert not torch.allclose(layer(x, ei), layer(x, ei))


def test_inside_pyg_model_on_batch():
    from torch_geometric.nn import global_mean_pool

    graphs = [Data(x=torch.randn(n, 8), edge_index=builders.causal(n)) for n in (3, 5, 4)]
    batch = Batch.from_data_list(graphs)
    layer = GraphAttention(8, 2)
    pooled = global_mean_pool(layer(batch.x, batch.edge_index), batch.batch)
    expected = torch.stack([layer(g.x, g.edge_index).mean(0) for g in graphs])
    torch.testing.assert_close(pooled, expected, **TOL)


def test_reset_parameters_and_repr():
    layer = GraphAttention(8, 2, bias=True)
    nn.init.normal_(layer.q_proj.bias)
    layer.reset_parameters()
    assert torch.equal(layer.q_proj.bias, torch.zeros(8))
    assert repr(layer) == "GraphAttention(8, heads=2)"
    assert GraphAttention(8, 2, bias=False).q_proj.bias is None


@pytest.mark.parametrize(
    "args, match",
    [((10, 3), "divisible"), ((0, 1), "positive"), ((8, 2, 1.0), "dropout")],
)
def test_bad_constructor_arguments(args, match):
    kwargs = {"dropout": args[2]} if len(args) == 3 else {}
    with pytest.raises(ValueError, match=match):
        GraphAttention(args[0], args[1], **kwargs)


def test_from_multihead_rejects_bias_kv():
    with pytest.raises(ValueError, match="add_bias_kv"):
        GraphAttention.from_multihead(nn.MultiheadAttention(8, 2, add_bias_kv=True))


def test_float32_matches_mha():
    mha = nn.MultiheadAttention(32, 4).float().eval()
    layer = GraphAttention.from_multihead(mha)
    assert layer.q_proj.weight.dtype == torch.float32
    x = torch.randn(12, 32, dtype=torch.float32)
    mask = torch.ones(12, 12, dtype=torch.bool).tril()
    ref, _ = mha(x[:, None], x[:, None], x[:, None], attn_mask=~mask)
    torch.testing.assert_close(layer(x, builders.causal(12)), ref[:, 0], rtol=1e-5, atol=1e-5)
