import pytest
import torch
from torch_geometric.nn import TransformerConv
from torch_geometric.utils import add_self_loops
from torch.utils._python_dispatch import TorchDispatchMode

from tgattn import GraphAttentionConv, builders
from tgattn.nn.conv import STACK_WIDTH
from tgattn.reference import dense_attention

TOL = dict(rtol=1e-10, atol=1e-10)


def random_graph(n_src, n_dst, e, seed=0):
    g = torch.Generator().manual_seed(seed)
    ei = torch.stack([torch.randint(n_src, (e,), generator=g), torch.randint(n_dst, (e,), generator=g)])
    return builders.from_mask(builders.to_mask(ei, n_dst, n_src))  # unique, sorted


def copy_into_transformer(conv: GraphAttentionConv, ref: TransformerConv) -> None:
    with torch.no_grad():
        for name in ("lin_query", "lin_key", "lin_value", "lin_skip"):
            mine, theirs = getattr(conv, name), getattr(ref, name)
            if mine is None:
                continue
            theirs.weight.copy_(mine.weight)
            if mine.bias is not None:
                theirs.bias.copy_(mine.bias)


@pytest.mark.parametrize("concat", [True, False])
@pytest.mark.parametrize("root_weight", [True, False])
@pytest.mark.parametrize("heads", [1, 3])
def test_equals_transformer_conv(concat, root_weight, heads):
    x = torch.randn(9, 6, dtype=torch.float64)
    ei = random_graph(9, 9, 30)
    conv = GraphAttentionConv(6, 4, heads, concat=concat, root_weight=root_weight).double().eval()
    ref = TransformerConv(6, 4, heads=heads, concat=concat, root_weight=root_weight).double().eval()
    copy_into_transformer(conv, ref)
    out, (ei_out, alpha) = conv(x, ei, return_attention_weights=True)
    ref_out, (_, ref_alpha) = ref(x, ei, return_attention_weights=True)
    assert out.shape == (9, 4 * heads if concat else 4)
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(alpha, ref_alpha, **TOL)
    assert torch.equal(ei_out, ei)


def test_bipartite_equals_transformer_conv():
    x_src, x_dst = torch.randn(7, 5, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    ei = random_graph(7, 4, 15, seed=1)
    conv = GraphAttentionConv((5, 3), 2, 2).double()
    ref = TransformerConv((5, 3), 2, heads=2).double()
    copy_into_transformer(conv, ref)
    out = conv((x_src, x_dst), ei)
    assert out.shape == (4, 4)
    torch.testing.assert_close(out, ref((x_src, x_dst), ei), **TOL)


@pytest.mark.parametrize("concat", [True, False])
def test_edge_bias_dim_equals_dense_attention_with_bias(concat):
    n, h, c = 8, 2, 3
    x = torch.randn(n, 5, dtype=torch.float64)
    ei = random_graph(n, n, 25, seed=2)
    e = torch.randn(ei.shape[1], 4, dtype=torch.float64)
    conv = GraphAttentionConv(5, c, h, concat=concat, edge_bias_dim=4).double()
    out = conv(x, ei, e)
    q, k, v = (lin(x).view(n, h, c) for lin in (conv.lin_query, conv.lin_key, conv.lin_value))
    bias = torch.zeros(h, n, n, dtype=torch.float64)
    bias[:, ei[1], ei[0]] = conv.lin_edge_bias(e).T  # [H, E] placed at (i, j)
    ref = dense_attention(q, k, v, builders.to_mask(ei, n, n), bias=bias)  # [N, H, C]
    ref = ref.reshape(n, h * c) if concat else ref.mean(1)
    torch.testing.assert_close(out, ref + conv.lin_skip(x), **TOL)


def test_edge_features_change_only_scores():
    x = torch.randn(6, 4, dtype=torch.float64)
    ei = random_graph(6, 6, 14, seed=3)
    conv = GraphAttentionConv(4, 2, 2, edge_dim=1, root_weight=False).double()
    with torch.no_grad():
        conv.lin_edge.weight.zero_()
    plain = GraphAttentionConv(4, 2, 2, root_weight=False).double()
    plain.load_state_dict({k: v for k, v in conv.state_dict().items() if not k.startswith("lin_edge")})
    e = torch.randn(ei.shape[1], dtype=torch.float64)
    torch.testing.assert_close(conv(x, ei, e), plain(x, ei), **TOL)


def test_add_self_loops_flag_equals_explicit_loops():
    x = torch.randn(6, 4, dtype=torch.float64)
    ei = torch.tensor([[0, 1, 1, 2, 5], [1, 2, 1, 3, 4]])  # holds the self-loop (1, 1)
    e = torch.randn(5, 2, dtype=torch.float64)
    conv = GraphAttentionConv(4, 3, 2, edge_dim=2, add_self_loops=True).double()
    out, (ei_used, alpha) = conv(x, ei, e, return_attention_weights=True)
    assert ei_used.shape[1] == 4 + 6  # 4 non-loop edges + one loop per node
    keep = ei[0] != ei[1]
    loops, e_loops = add_self_loops(ei[:, keep], e[keep], fill_value="mean", num_nodes=6)
    manual = GraphAttentionConv(4, 3, 2, edge_dim=2).double()
    manual.load_state_dict(conv.state_dict())
    torch.testing.assert_close(out, manual(x, loops, e_loops), **TOL)
    # every node attends at least to itself: weights sum to 1 at every target
    sums = torch.zeros(6, 2, dtype=torch.float64).index_add_(0, ei_used[1], alpha)
    torch.testing.assert_close(sums, torch.ones(6, 2, dtype=torch.float64), **TOL)


def test_node_without_edges_gets_root_term_only():
    x = torch.randn(4, 3)
    ei = torch.tensor([[0, 1], [1, 2]])  # nodes 0 and 3 have no incoming edge
    conv = GraphAttentionConv(3, 2, 2)
    out = conv(x, ei)
    torch.testing.assert_close(out[[0, 3]], conv.lin_skip(x[[0, 3]]), rtol=1e-5, atol=1e-5)
    assert not GraphAttentionConv(3, 2, 2, root_weight=False)(x, ei)[[0, 3]].any()


def test_attention_dropout_only_in_training():
    x = torch.randn(10, 4)
    ei = builders.full(10)
    conv = GraphAttentionConv(4, 4, 2, dropout=0.5, root_weight=False)
    conv.eval()
    a, b = conv(x, ei), conv(x, ei)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    conv.train()
    torch.manual_seed(1)
    assert (conv(x, ei) - a).abs().max() > 1e-3


def test_gradients_match_transformer_conv():
    x = torch.randn(7, 4, dtype=torch.float64)
    ei = random_graph(7, 7, 20, seed=4)
    conv = GraphAttentionConv(4, 3, 2).double()
    ref = TransformerConv(4, 3, heads=2).double()
    copy_into_transformer(conv, ref)
    conv(x, ei).pow(2).sum().backward()
    ref(x, ei).pow(2).sum().backward()
    for name in ("lin_query", "lin_key", "lin_value", "lin_skip"):
        torch.testing.assert_close(getattr(conv, name).weight.grad, getattr(ref, name).weight.grad, **TOL)


def test_repr_and_reset_parameters():
    conv = GraphAttentionConv((5, 3), 2, 4, concat=False)
    assert repr(conv) == "GraphAttentionConv((5, 3), 2, heads=4)"
    before = conv.lin_key.weight.clone()
    conv.reset_parameters()
    assert not torch.equal(before, conv.lin_key.weight)
    assert conv.lin_skip.weight.shape == (2, 3)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(in_channels=0, out_channels=2), "in_channels"),
        (dict(in_channels=(-2, 3), out_channels=2), "in_channels"),
        (dict(in_channels=(3, 4, 5), out_channels=2), "in_channels"),
        (dict(in_channels=3, out_channels=-1), "out_channels"),
        (dict(in_channels=3, out_channels=2, heads=0), "heads"),
        (dict(in_channels=3, out_channels=2, dropout=1.0), "dropout"),
        (dict(in_channels=3, out_channels=2, edge_dim=0), "edge_dim"),
    ],
)
def test_bad_constructor_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GraphAttentionConv(**kwargs)


def test_bad_forward_arguments():
    x, ei = torch.randn(4, 3), torch.tensor([[0, 1], [1, 2]])
    with pytest.raises(ValueError, match="edge_attr must be given"):
        GraphAttentionConv(3, 2, edge_dim=2)(x, ei)
    with pytest.raises(ValueError, match="edge_attr must be given"):
        GraphAttentionConv(3, 2)(x, ei, torch.randn(2, 2))
    with pytest.raises(ValueError, match=r"\[2, 2\] \(got \[2, 3\]\)"):
        GraphAttentionConv(3, 2, edge_dim=2)(x, ei, torch.randn(2, 3))
    with pytest.raises(ValueError, match="as many source as target nodes"):
        GraphAttentionConv((3, 3), 2, add_self_loops=True)((x, x[:2]), ei[:, :1])
    with pytest.raises(ValueError, match="node 7"):
        GraphAttentionConv(3, 2)(x, torch.tensor([[7], [0]]))


@pytest.mark.parametrize("bias_heads", [1, 2])
def test_edge_bias_adds_to_edge_feature_bias_on_the_dense_backend(bias_heads):
    """A global (all pairs) set with edge_bias and edge features, gradients into the bias too."""
    n, h, c = 6, 2, 3
    x = torch.randn(n, 5, dtype=torch.float64)
    ei = builders.full(n)
    e = torch.randn(ei.shape[1], 1, dtype=torch.float64)
    extra = torch.randn(ei.shape[1], bias_heads, dtype=torch.float64)
    extra[ei[1] == 3] = float("-inf")  # node 3 attends to nothing: root term only
    extra.requires_grad_()
    conv = GraphAttentionConv(5, c, h, edge_bias_dim=1).double()
    out = conv(x, ei, e, edge_bias=extra.squeeze(1) if bias_heads == 1 else extra)
    q, k, v = (lin(x).view(n, h, c) for lin in (conv.lin_query, conv.lin_key, conv.lin_value))
    bias = torch.zeros(h, n, n, dtype=torch.float64)
    bias[:, ei[1], ei[0]] = (conv.lin_edge_bias(e) + extra).T  # [H, E] placed at (i, j)
    ref = dense_attention(q, k, v, builders.to_mask(ei, n, n), bias=bias).reshape(n, h * c) + conv.lin_skip(x)
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(out[3], conv.lin_skip(x[3]), **TOL)
    grad, ref_grad = (torch.autograd.grad(o.pow(2).sum(), extra)[0] for o in (out, ref))
    torch.testing.assert_close(grad, ref_grad, **TOL)


def test_edge_bias_errors():
    x, ei = torch.randn(4, 3), builders.full(4)
    with pytest.raises(ValueError, match="add_self_loops=False"):
        GraphAttentionConv(3, 2, add_self_loops=True)(x, ei, edge_bias=torch.zeros(16))
    with pytest.raises(ValueError, match=r"bias must have shape \[E\] or \[E, H\] = \[16, 1\]"):
        GraphAttentionConv(3, 2)(x, ei, edge_bias=torch.zeros(15))


def test_shared_projection_equals_one_weight_for_queries_keys_and_values():
    n, h, c = 7, 2, 3
    x = torch.randn(n, 4, dtype=torch.float64)
    ei = random_graph(n, n, 18, seed=5)
    conv = GraphAttentionConv(4, c, h, shared_projection=True, root_weight=False).double()
    assert conv.lin_key is None and conv.lin_value is None
    assert sum(p.numel() for p in conv.parameters()) == 4 * h * c + h * c
    full = GraphAttentionConv(4, c, h, root_weight=False).double()
    for lin in (full.lin_query, full.lin_key, full.lin_value):
        lin.load_state_dict(conv.lin_query.state_dict())
    torch.testing.assert_close(conv(x, ei), full(x, ei), **TOL)
    torch.testing.assert_close(conv((x, x.clone()), ei), full(x, ei), **TOL)  # bipartite input, same sizes
    with pytest.raises(ValueError, match="shared_projection=True needs equal source and target sizes"):
        GraphAttentionConv((4, 5), 2, shared_projection=True)


def test_projection_hooks_still_run_and_agree_with_the_stacked_product():
    x = torch.randn(6, 4, dtype=torch.float64).to_sparse_csr()  # sparse features: one stacked product
    ei = random_graph(6, 6, 14, seed=6)
    conv = GraphAttentionConv(4, 3, 2).double()
    stacked = conv(x, ei)  # queries, keys, values and root term from one product
    seen = []
    handle = conv.lin_value.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    torch.testing.assert_close(conv(x, ei), stacked, **TOL)
    handle.remove()
    assert seen == [torch.Size([6, 6])]


class _Products(TorchDispatchMode):
    """Counts the matrix products (``mm`` / ``addmm``) dispatched under it, and the ``addmm`` apart."""

    def __init__(self):
        super().__init__()
        self.count = self.addmm = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm)
        self.addmm += func.overloadpacket is torch.ops.aten.addmm
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("root_weight", [True, False])
def test_dense_features_with_a_gradient_take_one_stacked_product(root_weight):
    # With x's gradient wanted, queries, keys, values (and root term) come from one product, whose
    # backward gives x's gradient in one product; a hook on a projection makes them run one by one.
    x = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    ei = random_graph(7, 7, 18, seed=8)
    conv = GraphAttentionConv(5, 3, 2, root_weight=root_weight).double()
    params = [x, *conv.parameters()]
    with _Products() as products:
        stacked = conv(x, ei)
    assert products.count == 1
    grads = torch.autograd.grad(stacked.square().sum(), params)
    handle = conv.lin_key.register_forward_hook(lambda module, args, out: None)
    with _Products() as products:
        separate = conv(x, ei)
    handle.remove()
    assert products.count == 3 + root_weight
    torch.testing.assert_close(stacked, separate, **TOL)
    for got, want in zip(grads, torch.autograd.grad(separate.square().sum(), params)):
        torch.testing.assert_close(got, want, **TOL)
    with _Products() as products:  # dense x without a gradient: one product each (the concatenated
        conv(x.detach(), ei)      # output gradients would cost more than three products save)
    assert products.count == 3 + root_weight
    assert products.addmm == 0  # on the CPU the biases are added after the products (_affine)
    wide = GraphAttentionConv(5, STACK_WIDTH + 1, 1, root_weight=root_weight).double()  # wide enough alone
    with _Products() as products:
        wide(x, ei)
    assert products.count == 3 + root_weight


def test_add_self_loops_without_edge_features_equals_pyg_loops():
    from torch_geometric.utils import remove_self_loops

    x = torch.randn(6, 4, dtype=torch.float64)
    ei = torch.cat([random_graph(6, 6, 14, seed=7), torch.tensor([[2, 4], [2, 4]])], dim=1)  # two self-loops
    conv = GraphAttentionConv(4, 3, 2, add_self_loops=True).double()
    out, (used, alpha) = conv(x, ei, return_attention_weights=True)
    expected = add_self_loops(remove_self_loops(ei)[0], num_nodes=6)[0]
    assert torch.equal(used, expected)
    conv.add_self_loops = False
    torch.testing.assert_close(out, conv(x, expected), **TOL)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_self_loops_in_one_pass_equal_pyg_remove_then_add(dtype, monkeypatch):
    """The extension's ``self_loops`` (the conv's looped edge set in one pass) gives PyG's
    remove_self_loops then add_self_loops, edge for edge, with and without loops of the input's own,
    and without edges; a node id out of range is named as without the extension."""
    from torch_geometric.utils import remove_self_loops

    from tgattn.engine import edgeset, native

    ei = torch.cat([random_graph(9, 9, 30, seed=2), torch.tensor([[3, 8], [3, 8]])], dim=1)
    for edges in (ei, ei[:, ei[0] != ei[1]], ei[:, :0]):
        looped = edgeset.self_looped(edges.to(dtype), 9).edge_index
        assert looped.dtype == torch.int64
        assert torch.equal(looped, add_self_loops(remove_self_loops(edges)[0], num_nodes=9)[0])
    bad = ei.clone()
    bad[1, 4] = 9
    with pytest.raises(ValueError, match="query/target node 9"):
        edgeset.self_looped(bad.to(dtype), 9)
    monkeypatch.setattr(native, "available", lambda: False)  # the PyTorch-ops path names it alike
    with pytest.raises(ValueError, match="query/target node 9"):
        edgeset.self_looped(bad.to(dtype), 9)


def sampled_graph(n_src, n_dst, attended, seed=0, one_edge=True):
    """A NeighborLoader-like edge set: targets 0 .. attended - 1 have 2-4 edges, every other even
    target one edge (none with ``one_edge=False``), the odd ones none; unsorted, a duplicated
    edge, no self-loop."""
    g = torch.Generator().manual_seed(seed)
    many = torch.repeat_interleave(torch.arange(attended), torch.randint(2, 5, (attended,), generator=g))
    one = torch.arange(attended + attended % 2, n_dst, 2)[: None if one_edge else 0]
    dst = torch.cat([many, one, many[:1]])
    src = (dst + 1 + torch.randint(n_src - 1, (len(dst),), generator=g)) % n_src
    src[-1] = src[0]
    order = torch.randperm(len(dst), generator=g)
    return torch.stack([src, dst])[:, order]


def attended_rows(monkeypatch):
    """The query rows each attention call of the conv gets."""
    from tgattn import functional

    seen, attend = [], functional.graph_attention

    def spy(q, *args, **kwargs):
        seen.append(q.shape[0])
        return attend(q, *args, **kwargs)

    monkeypatch.setattr(functional, "graph_attention", spy)
    return seen


@pytest.mark.parametrize("bipartite", [False, True], ids=["homogeneous", "bipartite"])
@pytest.mark.parametrize("concat, beta, root_weight", [(True, False, True), (False, True, True), (True, False, False)])
def test_rows_with_at_most_one_edge_skip_the_attention_and_equal_transformer_conv(monkeypatch, concat, beta,
                                                                                   root_weight, bipartite):
    n_src, n_dst = (12, 10) if bipartite else (12, 12)
    ei = sampled_graph(n_src, n_dst, attended=3)
    x_src = torch.randn(n_src, 5, dtype=torch.float64, requires_grad=True)
    x_dst = torch.randn(n_dst, 4, dtype=torch.float64, requires_grad=True) if bipartite else x_src
    x = (x_src, x_dst) if bipartite else x_src
    sizes = (5, 4) if bipartite else 5
    ref = TransformerConv(sizes, 3, 2, concat, beta, root_weight=root_weight).double()
    conv = GraphAttentionConv(sizes, 3, 2, concat, beta, root_weight=root_weight).double()
    conv.load_state_dict(ref.state_dict(), strict=False)
    seen = attended_rows(monkeypatch)
    out, ref_out = conv(x, ei), ref(x, ei)
    assert seen == [3]  # the rows with two edges or more only
    torch.testing.assert_close(out, ref_out, **TOL)
    inputs = [x_src] + ([x_dst] if bipartite else [])
    grad = torch.randn_like(out)
    params = [p for name, p in ref.named_parameters() if root_weight or not name.startswith("lin_skip")]
    for a, b in zip(torch.autograd.grad(out, list(conv.parameters()) + inputs, grad),
                    torch.autograd.grad(ref_out, params + inputs, grad), strict=True):
        torch.testing.assert_close(a, b, **TOL)


def test_rows_with_one_edge_with_self_loops_and_shared_projection(monkeypatch):
    """The sampled nodes of a batch's last hop have only their self-loop: they output their value."""
    n = 14
    ei = sampled_graph(n, n, attended=4, seed=1, one_edge=False)
    x = torch.randn(n, 5, dtype=torch.float64)
    for shared in (False, True):
        conv = GraphAttentionConv(5, 3, 2, add_self_loops=True, root_weight=False, shared_projection=shared).double()
        seen = attended_rows(monkeypatch)
        out = conv(x, ei)
        assert seen == [4]
        _, (looped, _) = conv(x, ei, return_attention_weights=True)  # weights: every row attended
        assert seen == [4, n]
        conv.add_self_loops = False
        torch.testing.assert_close(out, conv(x, looped, return_attention_weights=True)[0], **TOL)
        one = torch.arange(4, n)  # rows with their self-loop only
        torch.testing.assert_close(out[one], conv.lin_value(x[one]) if not shared else conv.lin_query(x[one]), **TOL)


def test_rows_split_only_where_most_rows_have_at_most_one_edge(monkeypatch):
    x = torch.randn(12, 5, dtype=torch.float64)
    conv = GraphAttentionConv(5, 3, 2).double()
    seen = attended_rows(monkeypatch)
    conv(x, sampled_graph(12, 12, attended=7))  # 7 of 12 rows have two edges or more
    conv(x, sampled_graph(12, 12, attended=6))
    conv(x, torch.tensor([[1, 2, 3], [0, 5, 9]]))  # no row with two edges: no attention call
    conv.train()
    conv.dropout = 0.5  # dropout can drop a one-edge row's weight: every row attended
    conv(x, sampled_graph(12, 12, attended=6))
    assert seen == [12, 6, 12]
    out = GraphAttentionConv(5, 3, 2, root_weight=False).double()(x, torch.tensor([[1, 2, 3], [0, 5, 9]]))
    assert not out[[1, 2, 3, 4, 6, 7, 8, 10, 11]].any()



@pytest.mark.parametrize("own_loop", [False, True])
def test_self_looped_edges_are_made_again_when_the_input_changes_in_place(own_loop):
    """The cached self-looped set is checked against its own first E columns where the input has no
    loops of its own (no copy of the input kept), against a copy where it has."""
    from tgattn.engine import CACHE

    x = torch.randn(8, 4, dtype=torch.float64)
    ei = torch.tensor([[0, 1, 2, 3, 5] + [7] * own_loop, [1, 2, 3, 4, 6] + [7] * own_loop])
    conv = GraphAttentionConv(4, 3, 2, add_self_loops=True).double()
    first = conv(x, ei)
    copy, looped, _ = CACHE.lookup(ei, ("self_loops", 8), lambda *_: True)
    assert (copy is None) != own_loop
    conv(x, ei)
    assert CACHE.lookup(ei, ("self_loops", 8), lambda *_: True)[1] is looped  # made once
    ei[1, 0] = 5  # changed in place: 0 -> 5 instead of 0 -> 1
    torch.testing.assert_close(conv(x, ei), conv(x, ei.clone()), **TOL)
    assert not torch.allclose(conv(x, ei), first)
