"""ExphormerConv: exact softmax over the Exphormer edge set, a learned bias per edge kind."""
import torch

from tgattn import builders
from tgattn.nn import EDGE_KINDS, ExphormerConv, VirtualNodes, exphormer_edge_kinds
from tgattn.reference import dense_attention

TOL = dict(rtol=0.0, atol=1e-10)


def test_edge_kinds():
    lengths = [5, 7]
    ring = torch.cat([torch.stack([torch.arange(s, s + L), s + (torch.arange(L) + 1) % L]) for s, L in ((0, 5), (5, 7))], 1)
    exp = builders.expander(lengths, 4, generator=torch.Generator().manual_seed(0))
    e = builders.exphormer(ring, lengths, 4, num_virtual=2, generator=torch.Generator().manual_seed(0))
    kind = exphormer_edge_kinds(e, ring, 12)
    virt = builders.virtual_nodes(lengths, 2)
    loops = torch.arange(16).expand(2, 16)
    assert torch.equal(kind, builders.membership(e, ring, loops, virt, exp))  # kinds in EDGE_KINDS order
    assert len(EDGE_KINDS) == 4 and int(kind.max()) == 3


def test_global_branch_is_exact_attention_with_kind_bias():
    torch.manual_seed(0)
    n, lengths = 11, [4, 7]
    ring = torch.cat([torch.stack([torch.arange(s, s + L), s + (torch.arange(L) + 1) % L]) for s, L in ((0, 4), (4, 7))], 1)
    e = builders.exphormer(ring, lengths, 2, generator=torch.Generator().manual_seed(1))
    kind = exphormer_edge_kinds(e, ring, n)
    layer = ExphormerConv(8, None, heads=2, norm=None).double()
    torch.nn.init.normal_(layer.kind_bias.weight)
    x = VirtualNodes(1, 8).double()(torch.randn(n, 8, dtype=torch.float64), num_graphs=2).detach().requires_grad_()
    out = layer(x, ring, attn_edge_index=e, attn_edge_kind=kind)
    # reference: the GPS update around dense masked attention with the kinds' biases as a matrix
    q, k, v = layer.attn.project(x)
    size = x.shape[0]
    bias = torch.zeros(size, size, 2, dtype=torch.float64)
    bias[e[1], e[0]] = layer.kind_bias(kind)
    attn = dense_attention(q, k, v, builders.to_mask(e, size), bias=bias.permute(2, 0, 1))
    h = layer.attn.out_proj(attn.reshape(size, 8)) + x
    ref = h + layer.mlp(h)
    torch.testing.assert_close(out, ref, **TOL)
    g, g_ref = (torch.autograd.grad(t.sum(), (x, layer.kind_bias.weight)) for t in (out, ref))
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, **TOL)
