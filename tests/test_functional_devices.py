"""Tensors of a call on another device than q (the meta device here: no GPU needed) are refused naming
the argument and the device.

Before, edge features on the meta device gave "Tensor.item() cannot be called on meta tensors",
"Tensor on device meta is not on the expected device cpu!" or index_add's message, and a meta
``edge_key`` weight beside CPU features returned a CPU output from a weight that holds no values.
"""
import pytest
import torch

from tgattn import builders
from tgattn.functional import BACKENDS, graph_attention
from tgattn.nn import GraphAttentionConv

N, E = 5, 15  # causal(5)


def _meta(t):
    return t.to("meta")


CASES = {  # argument name in the message: keyword arguments of graph_attention
    "edge_key features": lambda e, w: dict(edge_key=(_meta(e), w)),
    "edge_key weight": lambda e, w: dict(edge_key=(e, _meta(w))),
    "edge_value features": lambda e, w: dict(edge_value=(_meta(e), w)),
    "edge_key": lambda e, w: dict(edge_key=_meta(torch.randn(E, 2, 4))),
    "edge_value": lambda e, w: dict(edge_value=_meta(torch.randn(E, 2, 4))),
    "bias": lambda e, w: dict(bias=_meta(torch.randn(E))),
    "edge_scale": lambda e, w: dict(edge_scale=_meta(torch.rand(E))),
    "sinks": lambda e, w: dict(sinks=_meta(torch.zeros(2))),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(CASES))
def test_an_argument_on_the_meta_device_is_named(backend, name):
    q, k, v = (torch.randn(N, 2, 4) for _ in range(3))
    kw = CASES[name](torch.randn(E, 3), torch.randn(8, 3))
    message = f"{name} is on the meta device, but q is on cpu: every tensor of the call must be on q's device"
    with pytest.raises(ValueError) as raised:
        graph_attention(q, k, v, builders.causal(N), backend=backend, **kw)
    assert str(raised.value) == message


@pytest.mark.parametrize("with_edge_terms", [False, True])
def test_inputs_and_edges_on_the_meta_device_are_named(with_edge_terms):
    q, k, v = (torch.randn(N, 2, 4) for _ in range(3))
    kw = dict(edge_value=torch.randn(E, 2, 4)) if with_edge_terms else {}
    with pytest.raises(ValueError, match=r"^edge_index is on the meta device, but q is on cpu"):
        graph_attention(q, k, v, _meta(builders.causal(N)), **kw)
    with pytest.raises(ValueError, match=r"^v is on the meta device, but q is on cpu"):
        graph_attention(q, k, _meta(v), builders.causal(N), **kw)
    with pytest.raises(ValueError, match=r"^q is on the meta device, which holds no values"):
        graph_attention(*(_meta(t) for t in (q, k, v)), _meta(builders.causal(N)), **kw)


@pytest.mark.parametrize("edges", [dict(edge_dim=3), dict(edge_bias_dim=3), dict(edge_dim=3, add_self_loops=True)])
def test_the_conv_names_edge_attr(edges):
    conv = GraphAttentionConv(4, 4, heads=2, **edges)
    with pytest.raises(ValueError, match=r"^edge_attr is on the meta device, but x is on cpu$"):
        conv(torch.randn(N, 4), builders.causal(N), _meta(torch.randn(E, 3)))
