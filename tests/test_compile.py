"""``torch.compile`` of tgattn layers: no graph break at the attention, eager numbers, forward and gradients."""
from __future__ import annotations

import pytest
import torch

from tgattn import GraphAttention, GraphAttentionConv, builders



def _grads(model, x, ei):
    out = model(x, ei)
    loss = (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum()
    return out, torch.autograd.grad(loss, [x] + [p for p in model.parameters() if p.requires_grad])


def _compare(model, compiled, x, ei):
    out, grads = _grads(model, x, ei)
    out_c, grads_c = _grads(compiled, x, ei)
    torch.testing.assert_close(out_c, out, atol=1e-5, rtol=1e-5)
    for g_c, g in zip(grads_c, grads):
        torch.testing.assert_close(g_c, g, atol=1e-5, rtol=1e-5)


@pytest.mark.slow  # compiles a model (10-20 s on 2 cores)
def test_graph_attention_compiles_with_fullgraph():
    torch.manual_seed(0)
    layer = GraphAttention(16, 4)
    x = torch.randn(40, 16, requires_grad=True)
    compiled = torch.compile(layer, fullgraph=True)  # fullgraph: any graph break raises
    for ei in (builders.window(40, 3), builders.causal(40)):  # fused and dense SDPA inside the op
        _compare(layer, compiled, x, ei)


@pytest.mark.slow
def test_two_layer_conv_network_compiles_with_fullgraph():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = GraphAttentionConv(12, 8, heads=2)
            self.conv2 = GraphAttentionConv(16, 4, heads=1)

        def forward(self, x, edge_index):
            return self.conv2(torch.relu(self.conv1(x, edge_index)), edge_index)

    torch.manual_seed(1)
    net = Net()
    x = torch.randn(30, 12, requires_grad=True)
    ei = builders.from_mask(torch.rand(30, 30, generator=torch.Generator().manual_seed(2)) < 0.2)
    _compare(net, torch.compile(net, fullgraph=True), x, ei)


def test_the_custom_op_backward_sees_the_dropout_mask_of_its_forward():
    """The op compiled models call: a fixed seed fixes the mask, so gradcheck (which reruns the
    forward many times) only passes if the backward recomputes with the forward's mask."""
    from tgattn.engine.custom_op import graph_attention_op

    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(6, 1, 2, dtype=torch.float64, generator=g, requires_grad=True) for _ in range(3))
    ei = builders.from_mask(torch.rand(6, 6, generator=g) < 0.6)
    seed = torch.tensor(1234)
    for backend in ("csr", "gather"):
        def f(q, k, v):
            return graph_attention_op(q, k, v, ei, None, None, seed, None, 0.5, False, backend)[0]

        assert not torch.equal(f(q, k, v), graph_attention_op(q, k, v, ei, None, None, None, None, 0.0, False, backend)[0])
        assert torch.autograd.gradcheck(f, (q, k, v))


def test_the_custom_ops_are_kept_out_of_cuda_graphs():
    # A replayed CUDA graph would skip the per-edge-set analysis (Python) and reuse the captured one.
    import tgattn.engine.custom_op  # noqa: F401  (registers the ops)

    for op in (torch.ops.tgattn.graph_attention.default, torch.ops.tgattn.graph_attention_backward.default):
        assert torch.Tag.cudagraph_unsafe in op.tags


@pytest.mark.slow
def test_layers_compile_with_fullgraph_over_a_prepared_set():
    """A prepared set goes into the compiled graph as its edges (the op takes tensors), with no graph break."""
    import tgattn

    torch.manual_seed(0)
    x = torch.randn(30, 12, requires_grad=True)
    es = tgattn.prepare(builders.from_mask(torch.rand(30, 30, generator=torch.Generator().manual_seed(2)) < 0.2), 30, 30)
    for layer in (GraphAttention(12, 4), GraphAttentionConv(12, 4, heads=2)):
        _compare(layer, torch.compile(layer, fullgraph=True), x, es)
