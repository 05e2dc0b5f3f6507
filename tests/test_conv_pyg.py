"""GraphAttentionConv on the roads PyG's own tests take with TransformerConv (issue 21).

Written after the cases of PyG's ``test/nn/conv/test_transformer_conv.py``,
``test/nn/test_compile_conv.py`` and ``test/explain/algorithm/test_{attention,gnn}_explainer.py``
(PyG 2.8), on ``GraphAttentionConv``, which takes ``TransformerConv``'s constructor; results are
compared with PyG's ``TransformerConv`` holding the same weights (every option combination:
tests/test_conv_transformer.py).
"""
import pytest
import torch
from torch import nn
from torch_geometric import EdgeIndex
from torch_geometric.explain import Explainer, HeteroExplanation
from torch_geometric.explain.algorithm import AttentionExplainer, GNNExplainer
from torch_geometric.nn import GATConv, GATv2Conv, TransformerConv, global_add_pool, to_hetero
from torch_geometric.typing import WITH_TORCH_SPARSE
from torch_geometric.utils import (
    add_self_loops,
    remove_self_loops,
    to_torch_coo_tensor,
    to_torch_csc_tensor,
    to_torch_sparse_tensor,
)

from tgattn import GraphAttentionConv
from tgattn.reference import dense_attention


def twin(conv: GraphAttentionConv) -> TransformerConv:
    """PyG's TransformerConv with the weights of ``conv``."""
    ref = TransformerConv(conv.in_channels, conv.out_channels, conv.heads, conv.concat, conv.beta, conv.dropout,
                          conv.edge_dim, conv.lin_query.bias is not None, conv.root_weight)
    ref.load_state_dict(conv.state_dict())
    return ref.to(conv.lin_query.weight.dtype)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny graphs, many small ops (explainers train masks): one thread is the fastest, and two
    threads on a loaded 2-core machine make these tests several times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


X1, X2 = torch.randn(4, 8), torch.randn(2, 16)
EI = torch.tensor([[0, 1, 2, 3], [0, 0, 1, 1]])


# test_transformer_conv.py ------------------------------------------------------------------------

@pytest.mark.parametrize("edge_dim", [None, 8])
@pytest.mark.parametrize("concat", [True, False])
def test_transformer_conv_cases(edge_dim, concat):
    edge_attr = None if edge_dim is None else torch.randn(4, edge_dim)
    adj1 = to_torch_csc_tensor(EI, size=(4, 4))
    conv = GraphAttentionConv(8, 32, heads=2, edge_dim=edge_dim, concat=concat)
    assert str(conv) == "GraphAttentionConv(8, 32, heads=2)"
    out = conv(X1, EI, edge_attr)
    assert out.size() == (4, 64 if concat else 32)
    torch.testing.assert_close(conv(X1, adj1.t(), edge_attr), out, rtol=0, atol=1e-6)
    torch.testing.assert_close(twin(conv)(X1, EI, edge_attr), out, rtol=0, atol=1e-6)

    out_w, (ei, alpha) = conv(X1, EI, edge_attr, return_attention_weights=True)
    torch.testing.assert_close(out_w, out)
    assert ei.size() == (2, 4) and alpha.size() == (4, 2)
    assert alpha.min() >= 0 and alpha.max() <= 1

    # bipartite
    adj1 = to_torch_csc_tensor(EI, size=(4, 2))
    conv = GraphAttentionConv((8, 16), 32, heads=2, edge_dim=edge_dim, concat=concat)
    assert str(conv) == "GraphAttentionConv((8, 16), 32, heads=2)"
    out = conv((X1, X2), EI, edge_attr)
    assert out.size() == (2, 64 if concat else 32)
    torch.testing.assert_close(conv((X1, X2), adj1.t(), edge_attr), out, rtol=0, atol=1e-6)
    torch.testing.assert_close(twin(conv)((X1, X2), EI, edge_attr), out, rtol=0, atol=1e-6)


@pytest.mark.parametrize("layout", [torch.sparse_coo, torch.sparse_csr, torch.sparse_csc])
@pytest.mark.parametrize("bipartite", [False, True])
def test_torch_sparse_adjacency_and_its_weights(layout, bipartite):
    n_src, n_dst = (7, 5) if bipartite else (7, 7)
    g = torch.Generator().manual_seed(3)
    ei = torch.stack([torch.randint(n_src, (20,), generator=g), torch.randint(n_dst, (20,), generator=g)])
    ei = torch.unique(ei, dim=1)
    x = (torch.randn(n_src, 6, dtype=torch.float64), torch.randn(n_dst, 5, dtype=torch.float64))
    conv = GraphAttentionConv((6, 5), 3, 2).double()
    out, (_, alpha) = conv(x, ei, return_attention_weights=True)
    adj_t = to_torch_coo_tensor(ei.flip(0), size=(n_dst, n_src))  # adj_t[i, j]: edge j -> i
    adj_t = adj_t if layout == torch.sparse_coo else adj_t.to_sparse(layout=layout)
    out_s, (weights, alpha_s) = conv(x, adj_t, return_attention_weights=True)
    torch.testing.assert_close(out_s, out, rtol=1e-12, atol=1e-12)
    assert weights.layout == layout and weights.shape == (n_dst, n_src, 2)
    dense = torch.zeros(n_dst, n_src, 2, dtype=torch.float64)
    dense[ei[1], ei[0]] = alpha
    torch.testing.assert_close(weights.to_dense(), dense, rtol=1e-12, atol=1e-12)
    assert torch.equal(alpha_s.sort(0).values, alpha.sort(0).values)


def test_sparse_adjacency_edge_features_and_self_loops():
    """adj_t values [E, F] serve as edge features; add_self_loops works on an adj_t too."""
    ei = torch.tensor([[0, 1, 2, 3, 3], [1, 2, 3, 0, 3]])  # sorted by target: the order of a CSR adj_t
    e = torch.randn(5, 3, dtype=torch.float64)
    x = torch.randn(4, 6, dtype=torch.float64)
    conv = GraphAttentionConv(6, 2, 2, edge_dim=3, add_self_loops=True).double()
    out, (ei_used, alpha) = conv(x, ei, e, return_attention_weights=True)
    dense = torch.zeros(4, 4, 2, dtype=torch.float64)
    dense[ei_used[1], ei_used[0]] = alpha
    for layout in (torch.sparse_coo, torch.sparse_csr):
        adj_t = to_torch_sparse_tensor(ei.flip(0), e, size=(4, 4), layout=layout)  # values [E, 3]
        out_s, (weights, _) = conv(x, adj_t, return_attention_weights=True)
        torch.testing.assert_close(out_s, out, rtol=1e-12, atol=1e-12)
        assert weights.layout == layout and weights._nnz() == 4 + 4  # 4 non-loop edges + one loop per node
        torch.testing.assert_close(weights.to_dense(), dense, rtol=1e-12, atol=1e-12)


def test_sparse_tensor_adjacency():
    """torch_sparse.SparseTensor (PyG's cases; runs only where torch_sparse is installed)."""
    if not WITH_TORCH_SPARSE:
        pytest.skip("torch_sparse is not installed (no wheel for this torch)")
    from torch_geometric.typing import SparseTensor

    edge_attr = torch.randn(4, 8)
    conv = GraphAttentionConv(8, 32, heads=2, edge_dim=8)
    out = conv(X1, EI, edge_attr)
    adj2 = SparseTensor.from_edge_index(EI, edge_attr, sparse_sizes=(4, 4))
    torch.testing.assert_close(conv(X1, adj2.t()), out, rtol=0, atol=1e-6)
    result = conv(X1, adj2.t(), return_attention_weights=True)
    torch.testing.assert_close(result[0], out, rtol=0, atol=1e-6)
    assert result[1].sizes() == [4, 4, 2] and result[1].nnz() == 4
    adj3 = SparseTensor.from_edge_index(EI, sparse_sizes=(4, 2))
    conv = GraphAttentionConv((8, 16), 32, heads=2)
    torch.testing.assert_close(conv((X1, X2), adj3.t()), conv((X1, X2), EI), rtol=0, atol=1e-6)


def test_edge_index_and_size():
    x = torch.randn(6, 4, dtype=torch.float64)
    ei = torch.tensor([[0, 1, 2, 4, 5], [1, 2, 3, 3, 0]])
    conv = GraphAttentionConv(4, 3, 2).double()
    out = conv(x, ei)
    torch.testing.assert_close(conv(x, EdgeIndex(ei, sparse_size=(6, 6))), out, rtol=0, atol=0)
    torch.testing.assert_close(conv(x, EdgeIndex(ei, sparse_size=(6, 6)).sort_by("col")[0]), out, rtol=0, atol=0)
    with pytest.raises(ValueError, match="size gives 4 target nodes, but x has 6"):  # as PyG's convs do
        conv(x, EdgeIndex(ei).sort_by("col")[0])  # sorting infers num_cols = max + 1 = 4
    torch.testing.assert_close(conv(x, ei, size=(6, 6)), out, rtol=0, atol=0)
    torch.testing.assert_close(conv(x, ei, size=(None, 6)), out, rtol=0, atol=0)
    with pytest.raises(ValueError, match="size gives 5 source nodes, but x has 6 source rows"):
        conv(x, ei, size=(5, 6))
    with pytest.raises(ValueError, match=r"size must be \(num_sources, num_targets\) = \(6, 6\)"):
        conv(x, EdgeIndex(ei, sparse_size=(6, 6)), size=(6, 7))


def test_missing_target_features():
    """(x_j, None): queries of all-zero features (q_i = b_Q), no root term; size sets Nq."""
    x_j = torch.randn(6, 4, dtype=torch.float64)
    ei = torch.tensor([[0, 1, 2, 4, 5, 3], [1, 2, 3, 3, 0, 7]])
    conv = GraphAttentionConv((4, 5), 3, 2).double()
    out = conv((x_j, None), ei, size=(6, 8))
    assert out.shape == (8, 6)
    q = conv.lin_query.bias.view(1, 2, 3).expand(8, 2, 3)
    k, v = (lin(x_j).view(6, 2, 3) for lin in (conv.lin_key, conv.lin_value))
    mask = torch.zeros(8, 6, dtype=torch.bool)
    mask[ei[1], ei[0]] = True
    torch.testing.assert_close(out, dense_attention(q, k, v, mask).reshape(8, 6), rtol=1e-12, atol=1e-12)
    square = GraphAttentionConv(4, 3, 2).double()
    assert square((x_j, None), ei[:, :5]).shape == (6, 6)  # Nq defaults to Nk, as in PyG
    with pytest.raises(ValueError, match="needs the target size"):
        GraphAttentionConv(-1, 3)((x_j.float(), None), ei[:, :5])


# lazy sizes, meta device, to_hetero ---------------------------------------------------------------

def test_lazy_in_channels_equal_transformer_conv():
    for in_channels, x, target_size in ((-1, X1, 8), ((-1, -1), (X1, X2), 16)):
        conv, ref = GraphAttentionConv(in_channels, 32, heads=2), TransformerConv(in_channels, 32, heads=2)
        assert str(conv) == f"GraphAttentionConv({in_channels}, 32, heads=2)"
        out = conv(x, EI)  # materializes the weights
        assert conv.lin_key.weight.shape == (64, 8) and conv.lin_query.weight.shape == (64, target_size)
        ref(x, EI)
        ref.load_state_dict(conv.state_dict())
        torch.testing.assert_close(ref(x, EI), out, rtol=0, atol=1e-6)


def test_construction_on_the_meta_device():
    with torch.device("meta"):
        conv = GraphAttentionConv(8, 4, heads=2, edge_dim=3)
    assert all(p.is_meta for p in conv.parameters())
    conv.to_empty(device="cpu")
    conv.reset_parameters()
    ref = GraphAttentionConv(8, 4, heads=2, edge_dim=3)
    ref.load_state_dict(conv.state_dict())
    e = torch.randn(4, 3)
    torch.testing.assert_close(conv(X1, EI, e), ref(X1, EI, e), rtol=0, atol=0)
    assert conv.lin_query.weight.abs().max() > 0


class TwoLayer(nn.Module):
    def __init__(self, conv_cls, out_channels=7):
        super().__init__()
        self.conv1 = conv_cls((-1, -1), 8, heads=2)
        self.conv2 = conv_cls((-1, -1), out_channels, heads=1)

    def forward(self, x, edge_index):
        return self.conv2(self.conv1(x, edge_index).relu(), edge_index)


def hetero_data():
    g = torch.Generator().manual_seed(5)
    x = {"paper": torch.randn(8, 6, generator=g), "author": torch.randn(5, 3, generator=g)}
    cites = torch.stack([torch.randint(8, (14,), generator=g), torch.randint(8, (14,), generator=g)])
    writes = torch.stack([torch.randint(5, (10,), generator=g), torch.randint(8, (10,), generator=g)])
    edges = {("paper", "cites", "paper"): cites, ("author", "writes", "paper"): writes,
             ("paper", "rev_writes", "author"): writes.flip(0)}
    return x, edges


class HeteroNet(nn.Module):
    def __init__(self, conv_cls, metadata):
        super().__init__()
        self.gnn = to_hetero(TwoLayer(conv_cls), metadata, aggr="sum")

    def forward(self, x_dict, edge_index_dict):
        return self.gnn(x_dict, edge_index_dict)["paper"]


def hetero_twins():
    """A to_hetero model of lazy GraphAttentionConv, and one of TransformerConv with its weights."""
    x, edges = hetero_data()
    metadata = (list(x), list(edges))
    ours, theirs = HeteroNet(GraphAttentionConv, metadata), HeteroNet(TransformerConv, metadata)
    with torch.no_grad():
        ours(x, edges), theirs(x, edges)  # materialize the lazy sizes
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs, x, edges


def test_to_hetero_with_lazy_sizes():
    ours, theirs, x, edges = hetero_twins()
    conv = ours.gnn.conv1["author__writes__paper"]
    assert conv.lin_key.weight.shape == (16, 3) and conv.lin_query.weight.shape == (16, 6)
    torch.testing.assert_close(ours(x, edges), theirs(x, edges), rtol=0, atol=1e-5)


# AttentionExplainer ---------------------------------------------------------------------------------

X = torch.randn(8, 3)
EDGE_INDEX = torch.tensor([[0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7], [1, 0, 2, 1, 3, 2, 4, 3, 5, 4, 6, 5, 7, 6]])


class AttentionGNN(nn.Module):
    """PyG's test model: GATConv, GATv2Conv and (here) tgattn in place of TransformerConv."""

    def __init__(self):
        super().__init__()
        self.conv1 = GATConv(3, 16, heads=4)
        self.conv2 = GATv2Conv(4 * 16, 16, heads=2)
        self.conv3 = GraphAttentionConv(2 * 16, 7, heads=1)

    def forward(self, x, edge_index):
        return self.conv3(self.conv2(self.conv1(x, edge_index).relu(), edge_index).relu(), edge_index)


def attention_explainer(model, edge_mask_type="object"):
    config = dict(mode="multiclass_classification", task_level="node", return_type="raw")
    return Explainer(model, AttentionExplainer(), explanation_type="model", edge_mask_type=edge_mask_type,
                     model_config=config)


@pytest.mark.parametrize("index", [None, 2, torch.arange(3)])
def test_attention_explainer_mixed_model(index):
    explanation = attention_explainer(AttentionGNN())(X, EDGE_INDEX, index=index)
    assert explanation.edge_mask.shape == (14,)
    assert explanation.edge_mask.min() >= 0 and explanation.edge_mask.max() <= 1


class Net(nn.Module):
    """Two attention convs (``conv_cls``) and PyG's explainer-test heads for every task level."""

    def __init__(self, conv_cls, out_channels=7, task_level="node", mode="multiclass_classification",
                 return_type="raw", **forward_kw):
        super().__init__()
        self.conv1, self.conv2 = conv_cls(3, 8, heads=2), conv_cls(16, out_channels, heads=1)
        self.task_level, self.mode, self.return_type, self.forward_kw = task_level, mode, return_type, forward_kw

    def forward(self, x, edge_index, batch=None, edge_label_index=None):
        x = self.conv2(self.conv1(x, edge_index, **self.forward_kw).relu(), edge_index, **self.forward_kw)
        if self.task_level == "graph":
            x = global_add_pool(x, batch)
        elif self.task_level == "edge":
            x = x[edge_label_index[0]] * x[edge_label_index[1]]
        if self.mode == "binary_classification" and self.return_type == "probs":
            x = x.sigmoid()
        elif self.mode == "multiclass_classification" and self.return_type == "probs":
            x = x.softmax(dim=-1)
        elif self.mode == "multiclass_classification" and self.return_type == "log_probs":
            x = x.log_softmax(dim=-1)
        return x


def net_twins(**kw):
    """Net of GraphAttentionConv, the same through message passing, and Net of TransformerConv."""
    ours, theirs = Net(GraphAttentionConv, **kw), Net(TransformerConv, **kw)
    mp = Net(GraphAttentionConv, **kw, backend="message_passing")
    mp.load_state_dict(ours.state_dict())
    theirs.load_state_dict(ours.state_dict())
    return ours, mp, theirs


@pytest.mark.parametrize("index", [None, 2, torch.arange(3)])
def test_attention_explainer_on_tgattn_only_equals_transformer_conv(index):
    ours, mp, theirs = net_twins()
    masks = [attention_explainer(m)(X, EDGE_INDEX, index=index).edge_mask for m in (ours, mp, theirs)]
    torch.testing.assert_close(masks[0], masks[1], rtol=0, atol=0)
    torch.testing.assert_close(masks[0], masks[2], rtol=0, atol=1e-6)
    if index is None:  # the max over layers and heads of the weights the fast path returns
        _, (_, a1) = ours.conv1(X, EDGE_INDEX, return_attention_weights=True)
        h = ours.conv1(X, EDGE_INDEX).relu()
        _, (_, a2) = ours.conv2(h, EDGE_INDEX, return_attention_weights=True)
        torch.testing.assert_close(masks[0], torch.maximum(a1.max(1).values, a2.max(1).values), rtol=0, atol=1e-6)


def test_hooks_see_the_message_passing_steps():
    """A hook on any step runs the message-passing path; message hooks see the weights."""
    conv = GraphAttentionConv(3, 4, heads=2)
    _, (_, alpha) = conv(X, EDGE_INDEX, return_attention_weights=True)
    seen = []
    handles = [
        conv.register_message_forward_hook(lambda module, inputs, out: seen.append(inputs[0]["alpha"])),
        conv.register_propagate_forward_hook(lambda module, inputs, out: seen.append(out)),
    ]
    out = conv(X, EDGE_INDEX)
    for handle in handles:
        handle.remove()
    assert len(seen) == 2
    torch.testing.assert_close(seen[0], alpha, rtol=0, atol=1e-6)
    torch.testing.assert_close(seen[1].reshape(8, 8) + conv.lin_skip(X), out, rtol=0, atol=1e-6)
    torch.testing.assert_close(out, conv(X, EDGE_INDEX), rtol=0, atol=1e-6)


@pytest.mark.parametrize("index", [None, 2])
def test_attention_explainer_hetero_lazy_transformer_conv(index):
    ours, theirs, x, edges = hetero_twins()
    explanations = [attention_explainer(m)(x, edges, index=index) for m in (ours, theirs)]
    assert isinstance(explanations[0], HeteroExplanation)
    for edge_type, ei in edges.items():
        mask = explanations[0][edge_type].edge_mask
        assert mask.shape == (ei.shape[1],) and mask.min() >= 0 and mask.max() <= 1
        torch.testing.assert_close(mask, explanations[1][edge_type].edge_mask, rtol=0, atol=1e-6)


# GNNExplainer ---------------------------------------------------------------------------------------

BATCH = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])
EDGE_LABEL_INDEX = torch.tensor([[0, 1, 2], [3, 4, 5]])
GNN_CASES = [  # (mode, task_level, return_type, explanation_type, node_mask_type, index): every branch once
    ("multiclass_classification", "node", "log_probs", "model", None, 2),
    ("multiclass_classification", "node", "raw", "phenomenon", "attributes", torch.arange(3)),
    ("multiclass_classification", "edge", "probs", "model", "object", None),
    ("multiclass_classification", "graph", "raw", "phenomenon", "common_attributes", 1),
    ("binary_classification", "node", "probs", "phenomenon", None, torch.arange(3)),
    ("binary_classification", "edge", "raw", "model", "attributes", 0),
    ("binary_classification", "graph", "probs", "model", None, None),
    ("regression", "node", "raw", "model", "object", 2),
    ("regression", "edge", "raw", "phenomenon", None, None),
    ("regression", "graph", "raw", "phenomenon", "attributes", torch.arange(2)),
]


def explain_gnn(model, mode, task_level, return_type, explanation_type, node_mask_type, index):
    config = dict(mode=mode, task_level=task_level, return_type=return_type)
    kwargs = dict(batch=BATCH, edge_label_index=EDGE_LABEL_INDEX)
    target = None
    if explanation_type == "phenomenon":
        with torch.no_grad():
            target = model(X, EDGE_INDEX, **kwargs)
            target = target.argmax(-1) if mode == "multiclass_classification" else target
            if mode == "binary_classification":
                target = (target > (0.5 if return_type == "probs" else 0)).float()
    explainer = Explainer(model, GNNExplainer(epochs=8), explanation_type=explanation_type,
                          node_mask_type=node_mask_type, edge_mask_type="object", model_config=config)
    torch.manual_seed(12)  # the same initial masks for every model
    return explainer(X, EDGE_INDEX, target=target, index=index, **kwargs)


@pytest.mark.parametrize("mode, task_level, return_type, explanation_type, node_mask_type, index", GNN_CASES)
def test_gnn_explainer_equals_message_passing_and_transformer_conv(
    mode, task_level, return_type, explanation_type, node_mask_type, index
):
    case = (mode, task_level, return_type, explanation_type, node_mask_type, index)
    models = net_twins(out_channels=7 if mode == "multiclass_classification" else 1, task_level=task_level,
                       mode=mode, return_type=return_type)
    ours, mp, theirs = (explain_gnn(m, *case) for m in models)
    edge_mask = ours.edge_mask
    assert edge_mask.shape == (14,) and edge_mask.min() >= 0 and edge_mask.max() <= 1
    assert (edge_mask > 0).any()
    for other in (mp, theirs):
        torch.testing.assert_close(edge_mask, other.edge_mask, rtol=0, atol=1e-5)
        if node_mask_type is not None:
            torch.testing.assert_close(ours.node_mask, other.node_mask, rtol=0, atol=1e-5)
    shape = {"attributes": (8, 3), "object": (8, 1), "common_attributes": (1, 3), None: None}[node_mask_type]
    assert (ours.get("node_mask") is None) == (shape is None)
    assert shape is None or ours.node_mask.shape == shape


@pytest.mark.parametrize("loops", [False, True])
def test_explainer_edge_mask_on_the_fast_path(loops):
    """PyG's set_masks: the fast path scales the weights by sigmoid(mask) (added loops: 1), with
    the gradients to the mask of the message-passing path and of TransformerConv."""
    from torch_geometric.explain.algorithm.utils import clear_masks, set_masks

    edge_index = torch.cat([EDGE_INDEX, torch.tensor([[3], [3]])], dim=1)  # one existing self-loop
    x = X.double()
    conv = GraphAttentionConv(3, 4, heads=2, add_self_loops=loops).double()
    ref = (LoopedTransformerConv if loops else TransformerConv)(3, 4, heads=2).double()
    (ref.conv if loops else ref).load_state_dict(conv.state_dict())
    mask = torch.nn.Parameter(torch.randn(15, dtype=torch.float64))
    results = []
    for model, kw in ((conv, {}), (conv, dict(backend="message_passing")), (ref, {})):
        set_masks(model, mask, edge_index)
        assert not conv._wants_messages()  # the fast path, not a detour through propagate
        out = model(x, edge_index, **kw)
        results.append((out, torch.autograd.grad(out.pow(2).sum(), mask)[0]))
        clear_masks(model)
    for out, grad in results[1:]:
        torch.testing.assert_close(results[0][0], out, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(results[0][1], grad, rtol=1e-10, atol=1e-12)
    assert (results[0][1][-1] == 0) == loops  # a replaced self-loop takes no part


class LoopedTransformerConv(nn.Module):
    """TransformerConv after GATConv's self-loop handling: the oracle for add_self_loops=True."""

    def __init__(self, *args, **kwargs):
        super().__init__()
        self.conv = TransformerConv(*args, **kwargs)

    def forward(self, x, edge_index):
        edge_index, _ = add_self_loops(remove_self_loops(edge_index)[0], num_nodes=x.shape[0])
        return self.conv(x, edge_index)


class Net1(nn.Module):
    def __init__(self, conv, **forward_kw):
        super().__init__()
        self.conv, self.forward_kw = conv, forward_kw

    def forward(self, x, edge_index):
        return self.conv(x, edge_index, **self.forward_kw).sum(-1, keepdim=True)


def test_gnn_explainer_with_existing_self_loops():
    """Loops the conv replaces get no mask gradient (mask 0); the loops it adds get mask 1."""
    edge_index = torch.cat([EDGE_INDEX, torch.tensor([[3, 6], [3, 6]])], dim=1)  # two existing self-loops
    conv = GraphAttentionConv(3, 4, heads=2, add_self_loops=True).double()
    ref = LoopedTransformerConv(3, 4, heads=2).double()
    ref.conv.load_state_dict(conv.state_dict())
    config = dict(mode="regression", task_level="node", return_type="raw")
    masks = []
    for model in (Net1(conv), Net1(conv, backend="message_passing"), Net1(ref)):
        explainer = Explainer(model, GNNExplainer(epochs=8), explanation_type="model", edge_mask_type="object",
                              model_config=config)
        torch.manual_seed(12)
        masks.append(explainer(X.double(), edge_index, index=torch.arange(8)).edge_mask)
    assert masks[0].shape == (16,) and (masks[0][-2:] == 0).all() and (masks[0][:-2] > 0).all()
    torch.testing.assert_close(masks[0], masks[1], rtol=0, atol=1e-5)
    torch.testing.assert_close(masks[0], masks[2], rtol=0, atol=1e-5)


@pytest.mark.parametrize("backend", ["auto", "message_passing"])
def test_gnn_explainer_on_a_subclass_defined_after_the_conv_was_built(backend):
    """PyG compiles propagate per class on first build; a later subclass inherits the compiled one,
    which ignores edge masks (TransformerConv subclasses fail so). Ours must not."""
    GraphAttentionConv(3, 4)

    class Late(GraphAttentionConv):
        pass

    config = dict(mode="regression", task_level="node", return_type="raw")
    explainer = Explainer(Net1(Late(3, 4), backend=backend), GNNExplainer(epochs=2), explanation_type="model",
                          edge_mask_type="object", model_config=config)
    assert (explainer(X, EDGE_INDEX).edge_mask > 0).all()


def test_gnn_explainer_hetero_equals_transformer_conv():
    ours, theirs, x, edges = hetero_twins()
    config = dict(mode="multiclass_classification", task_level="node", return_type="raw")
    masks = []
    for model in (ours, theirs):
        explainer = Explainer(model, GNNExplainer(epochs=8), explanation_type="model", edge_mask_type="object",
                              model_config=config)
        torch.manual_seed(12)
        masks.append(explainer(x, edges, index=torch.arange(4)).edge_mask_dict)
    for edge_type in edges:
        assert (masks[0][edge_type] > 0).any()
        torch.testing.assert_close(masks[0][edge_type], masks[1][edge_type], rtol=0, atol=1e-4)


# message-passing path and torch.compile ----------------------------------------------------------------

@pytest.mark.parametrize("edge_dim, loops, bipartite", [(None, False, False), (2, True, False), (None, False, True)])
def test_message_passing_backend_equals_the_fast_path(edge_dim, loops, bipartite):
    g = torch.Generator().manual_seed(7)
    n_src, n_dst = (6, 4) if bipartite else (6, 6)
    ei = torch.stack([torch.randint(n_src, (15,), generator=g), torch.randint(n_dst, (15,), generator=g)])
    ei = torch.unique(ei, dim=1)
    x = (torch.randn(n_src, 5, dtype=torch.float64), torch.randn(n_dst, 5, dtype=torch.float64))
    x = x if bipartite else x[0]
    e = None if edge_dim is None else torch.randn(ei.shape[1], edge_dim, dtype=torch.float64)
    conv = GraphAttentionConv(5, 3, 2, edge_dim=edge_dim, add_self_loops=loops).double()
    results = [conv(x, ei, e, return_attention_weights=True, backend=b) for b in ("auto", "message_passing")]
    grads = [torch.autograd.grad(out.pow(2).sum(), list(conv.parameters())) for out, _ in results]
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(results[0][1][1], results[1][1][1], rtol=1e-12, atol=1e-12)
    assert torch.equal(results[0][1][0], results[1][1][0])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


class Compiled(nn.Module):
    def __init__(self, conv):
        super().__init__()
        self.conv = conv

    def forward(self, x, edge_index, edge_attr=None, size=None):
        return self.conv(x, edge_index, edge_attr, size=size).relu()


COMPILE_CASES = {  # (conv, x, edge_index, edge_attr, size); Nk = 10
    "plain": lambda x, ei: (GraphAttentionConv(16, 8, heads=4), x, ei, None, None),
    "edge_dim, mean": lambda x, ei: (
        GraphAttentionConv(16, 8, 2, edge_dim=3, concat=False), x, ei, torch.randn(40, 3), None
    ),
    "bipartite, lazy": lambda x, ei: (GraphAttentionConv((-1, -1), 8, 2), (x, torch.randn(12, 5)), ei, None, None),
    "(x, None), size": lambda x, ei: (GraphAttentionConv(16, 8, 2), (x, None), ei, None, (10, 12)),
    "EdgeIndex": lambda x, ei: (GraphAttentionConv(16, 8, 2), x, EdgeIndex(ei, sparse_size=(10, 10)), None, None),
}


@pytest.mark.parametrize("case", list(COMPILE_CASES))
def test_compile_without_graph_breaks(case):
    """test_compile_conv's check: one graph (fullgraph=True raises at a break) that computes the
    eager result; inductor: tests/test_compile.py. Graph breaks remain at PyG's own conversions
    (a sparse adj_t, add_self_loops=True)."""
    from torch._dynamo.testing import CompileCounter

    conv, x, edge_index, edge_attr, size = COMPILE_CASES[case](torch.randn(10, 16), torch.randint(0, 10, (2, 40)))
    model = Compiled(conv)
    expected = model(x, edge_index, edge_attr, size)  # also sizes the lazy projections
    counter = CompileCounter()
    out = torch.compile(model, backend=counter, fullgraph=True)(x, edge_index, edge_attr, size)
    assert counter.frame_count == 1
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
