"""Prepared edge sets (``tgattn.prepare`` -> ``tgattn.EdgeSet``): every function and layer gives the
same outputs and gradients on a prepared set as on its ``edge_index`` (and the dense oracle's), the
set cannot change, PyG's sorted ``EdgeIndex`` converts without a sort, and an edge set is validated
once per call path: where it is prepared."""
import pickle
import sys

import pytest
import torch
from torch_geometric import EdgeIndex

import tgattn
from tgattn import builders
from tgattn.engine import native
from tgattn.functional import graph_attention
from tgattn.verify import random_edges

from engine_helpers import TOL, inputs, max_err, oracle


def _shuffled_with_repeat(n=10, p=0.35, seed=3):
    """A random edge set, shuffled (the engine keeps a permutation), one edge twice."""
    ei = random_edges(n, n, p, seed=seed)
    ei = torch.cat([ei, ei[:, :1]], dim=1)
    return ei[:, torch.randperm(ei.shape[1], generator=torch.Generator().manual_seed(seed))]


CASES = {
    "shuffled_repeat": _shuffled_with_repeat,
    "causal": lambda: builders.causal(10),
    "window": lambda: builders.window(10, 2),
    "packed": lambda: builders.full([4, 6]),
}


def _grads(out, tensors, seed=0):
    g = torch.Generator().manual_seed(seed)
    weights = torch.randn(out.shape, generator=g, dtype=out.dtype)
    return torch.autograd.grad((out * weights).sum(), [t for t in tensors if t is not None and t.requires_grad])


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("backend", ["auto", "dense", "tile", "fused", "csr", "gather"])
def test_graph_attention_on_a_prepared_set_equals_its_tensor(case, backend):
    ei = CASES[case]()
    es = tgattn.prepare(ei, 10, 10)
    q, k, v, _ = inputs(10, 10, heads=2, dk=4)
    bias = torch.randn(ei.shape[1], 2, dtype=torch.float64, requires_grad=True)
    for weights in (False, True):
        got = graph_attention(q, k, v, es, bias=bias, backend=backend, return_weights=weights)
        want = graph_attention(q, k, v, ei, bias=bias, backend=backend, return_weights=weights)
        if weights:
            torch.testing.assert_close(got[1], want[1], atol=TOL[torch.float64], rtol=0)  # the caller's edge order
            got, want = got[0], want[0]
        assert max_err(got, oracle(q, k, v, ei, bias)) <= TOL[torch.float64]
        torch.testing.assert_close(got, want, atol=TOL[torch.float64], rtol=0)
        for a, b in zip(_grads(got, (q, k, v, bias)), _grads(want, (q, k, v, bias))):
            torch.testing.assert_close(a, b, atol=TOL[torch.float64], rtol=0)


@pytest.mark.parametrize("options", [
    dict(softcap=2.0), dict(sinks=torch.tensor([0.3, -1.0], dtype=torch.float64)), dict(edge_terms=True),
    dict(edge_terms=True, return_weights=True), dict(edge_scale=True),
], ids=["softcap", "sinks", "edge_terms", "edge_terms_weights", "edge_scale"])
def test_call_options_on_a_prepared_set_equal_its_tensor(options):
    ei = _shuffled_with_repeat()
    es = tgattn.prepare(ei, 10, 10)
    q, k, v, _ = inputs(10, 10, heads=2, dk=4)
    options = dict(options)
    if options.pop("edge_terms", False):
        g = torch.Generator().manual_seed(5)
        term = (torch.randn(ei.shape[1], 3, dtype=torch.float64, generator=g),
                torch.randn(2 * 4, 3, dtype=torch.float64, generator=g, requires_grad=True))
        options.update(edge_key=term, edge_value=term)
    if options.pop("edge_scale", False):
        options["edge_scale"] = torch.rand(ei.shape[1], dtype=torch.float64, requires_grad=True)
    got, want = graph_attention(q, k, v, es, **options), graph_attention(q, k, v, ei, **options)
    if options.get("return_weights"):
        torch.testing.assert_close(got[1], want[1], atol=TOL[torch.float64], rtol=0)
        got, want = got[0], want[0]
    torch.testing.assert_close(got, want, atol=TOL[torch.float64], rtol=0)
    leaves = [q, k, v] + [t for t in options.get("edge_key") or () if t.requires_grad]
    leaves += [options["edge_scale"]] if "edge_scale" in options else []
    for a, b in zip(_grads(got, leaves), _grads(want, leaves)):
        torch.testing.assert_close(a, b, atol=TOL[torch.float64], rtol=0)


def _layer_cases():
    from tgattn import ExphormerConv, GPSConv, GraphAttention, GraphAttentionConv

    return {
        "attention": lambda: GraphAttention(8, 2),
        "attention_message_passing": lambda: GraphAttention(8, 2),
        "conv": lambda: GraphAttentionConv(8, 4, heads=2),
        "conv_self_loops": lambda: GraphAttentionConv(8, 4, heads=2, add_self_loops=True),
        "conv_self_loops_dropout": lambda: GraphAttentionConv(8, 4, heads=2, add_self_loops=True, dropout=0.3),
        "conv_edge_dim_beta": lambda: GraphAttentionConv(8, 4, heads=2, edge_dim=3, beta=True),
        "conv_message_passing": lambda: GraphAttentionConv(8, 4, heads=2, add_self_loops=True),
        "conv_shared_projection": lambda: GraphAttentionConv(8, 4, heads=2, shared_projection=True),
        "gps": lambda: GPSConv(8, None, heads=2),
        "exphormer": lambda: ExphormerConv(8, None, heads=2),
    }


def _sparse_rows(n=12):
    """A NeighborLoader-like set: most rows with at most one edge (the conv splits its rows)."""
    dst = torch.tensor([0, 0, 0, 1, 1, 2, 4, 6, 8, 10])
    src = (dst * 5 + torch.arange(10) + 1) % n
    return torch.stack([src, dst])[:, torch.randperm(10, generator=torch.Generator().manual_seed(1))]


@pytest.mark.parametrize("name", sorted(_layer_cases()))
@pytest.mark.parametrize("graph", ["shuffled_repeat", "sparse_rows"])
def test_layers_on_a_prepared_set_equal_their_tensor(name, graph):
    ei = _sparse_rows() if graph == "sparse_rows" else _shuffled_with_repeat(12)
    n = 12
    es = tgattn.prepare(ei, n, n)
    torch.manual_seed(0)
    layer = _layer_cases()[name]().double()
    x = torch.randn(n, 8, dtype=torch.float64, requires_grad=True)
    args, kwargs = (), {}
    if "edge_dim" in name:
        args = (torch.randn(ei.shape[1], 3, dtype=torch.float64),)
    if "message_passing" in name:
        kwargs["backend"] = "message_passing"
    if name in ("gps", "exphormer"):
        kwargs["attn_edge_index"] = None  # set below
        if name == "exphormer":
            kwargs["attn_edge_kind"] = torch.randint(0, 4, (ei.shape[1],), generator=torch.Generator().manual_seed(2))
    outs = []
    for edges in (es, ei):
        torch.manual_seed(7)  # the same dropout draws for both
        if name in ("gps", "exphormer"):
            out = layer(x, ei, **dict(kwargs, attn_edge_index=edges))
        else:
            out = layer(x, edges, *args, **kwargs)
        params = [x] + [p for p in layer.parameters() if p.requires_grad]
        outs.append((out, torch.autograd.grad(out.square().sum(), params, allow_unused=True)))
    (got, got_grads), (want, want_grads) = outs
    torch.testing.assert_close(got, want, atol=TOL[torch.float64], rtol=0)
    for a, b in zip(got_grads, want_grads):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, atol=TOL[torch.float64], rtol=0)


@pytest.mark.parametrize("layer_name", ["attention", "conv_self_loops"])
def test_layers_return_the_weights_of_a_prepared_set_in_its_edge_order(layer_name):
    ei = _shuffled_with_repeat(12)
    es = tgattn.prepare(ei, 12, 12)
    torch.manual_seed(0)
    layer = _layer_cases()[layer_name]().double()
    x = torch.randn(12, 8, dtype=torch.float64)
    (_, (edges_a, alpha_a)), (_, (edges_b, alpha_b)) = (layer(x, e, return_attention_weights=True) for e in (es, ei))
    assert torch.equal(edges_a, edges_b)
    torch.testing.assert_close(alpha_a, alpha_b, atol=TOL[torch.float64], rtol=0)


def test_a_prepared_set_is_immutable_and_keeps_no_tie_to_its_tensor():
    ei = _shuffled_with_repeat()
    es = tgattn.prepare(ei, 10, 10)
    for name in ("num_edges", "kind", "edge_index", "anything"):
        with pytest.raises(AttributeError, match="immutable"):
            setattr(es, name, 1)
    with pytest.raises(AttributeError, match="immutable"):
        del es.kind
    q, k, v, _ = inputs(10, 10, heads=2, dk=4)
    before = graph_attention(q, k, v, es)
    original = ei.clone()
    ei[0] = (ei[0] + 1) % 10  # the caller reuses its tensor: the prepared set holds its own edges
    assert torch.equal(es.edge_index, original)
    assert torch.equal(graph_attention(q, k, v, es), before)
    assert max_err(before, oracle(q, k, v, original)) <= TOL[torch.float64]


def test_a_prepared_set_pickles_as_the_edges_it_holds():
    ei = _shuffled_with_repeat()
    es = tgattn.prepare(ei, 10, 11)
    back = pickle.loads(pickle.dumps(es))
    assert (back.num_queries, back.num_keys) == (10, 11) and torch.equal(back.edge_index, ei)


@pytest.mark.parametrize("extension", [True, False], ids=["counting_sort", "torch_ops"])
def test_a_sorted_edge_index_converts_without_a_sort(monkeypatch, extension):
    if extension and not native.available():
        pytest.skip("the fused extension is not built")
    if not extension:
        monkeypatch.setattr(native, "available", lambda: False)
    ei = builders.window(12, 2)  # sorted by (query, key), as every builder emits
    pyg = EdgeIndex(ei, sparse_size=(12, 12), sort_order="col")
    monkeypatch.setattr(torch, "argsort", lambda *a, **k: pytest.fail("sorted again"))
    es = tgattn.prepare(pyg)
    assert es.structure.perm is None and (es.num_queries, es.num_keys) == (12, 12)
    assert torch.equal(es.edge_index, ei) and type(es.edge_index) is torch.Tensor


def test_an_edge_index_converts_with_its_sizes_and_any_order():
    ei = _shuffled_with_repeat()
    pyg = EdgeIndex(ei, sparse_size=(10, 10)).sort_by("col")[0]  # sorted by query only: keys sorted here
    es = tgattn.prepare(pyg)
    q, k, v, _ = inputs(10, 10, heads=2, dk=4)
    torch.testing.assert_close(graph_attention(q, k, v, es), oracle(q, k, v, ei), atol=TOL[torch.float64], rtol=0)
    bipartite = EdgeIndex(torch.tensor([[0, 4], [1, 2]]), sparse_size=(5, 3))  # 5 keys (sources), 3 queries
    assert (tgattn.prepare(bipartite).num_keys, tgattn.prepare(bipartite).num_queries) == (5, 3)
    with pytest.raises(ValueError, match="num_queries=4 disagrees with the EdgeIndex's sparse size \\(3\\)"):
        tgattn.prepare(bipartite, 4)


def test_bad_input_is_named_where_the_set_is_prepared_and_where_it_is_used():
    with pytest.raises(ValueError, match="num_keys must be a node count"):
        tgattn.prepare(builders.causal(3), 3)
    with pytest.raises(ValueError, match="key/source node 5, but there are 3 key nodes"):
        tgattn.prepare(torch.tensor([[5], [0]]), 3, 3)
    with pytest.raises(ValueError, match="must have shape \\[2, E\\]"):
        tgattn.prepare(torch.zeros(3, 2, dtype=torch.long), 3, 3)
    es = tgattn.prepare(builders.causal(3), 3, 3)
    q, k, v, _ = inputs(4, 4, heads=1, dk=2)
    with pytest.raises(ValueError, match="prepared for 3 query and 3 key nodes, but the call has 4 queries and 4 keys"):
        graph_attention(q, k, v, es)
    with pytest.raises(ValueError, match="gives 3 source nodes, but x has 4 source rows"):  # the set's sizes
        tgattn.GraphAttentionConv(2, 2)(torch.randn(4, 2), es)


def _count_validations(monkeypatch):
    """Records the edge tensor of every call of ``check_edge_index``, wherever tgattn imported it."""
    from tgattn.engine import validate

    seen, original = [], validate.check_edge_index

    def counted(edge_index, *args, **kwargs):
        seen.append(edge_index)
        return original(edge_index, *args, **kwargs)

    for name, module in list(sys.modules.items()):
        if (name == "tgattn" or name.startswith("tgattn.")) and getattr(module, "check_edge_index", None) is original:
            monkeypatch.setattr(module, "check_edge_index", counted)
    return seen


def _step(layer, x, edges):
    layer(x, edges).square().sum().backward()


@pytest.mark.parametrize("self_loops", [False, True])
def test_an_edge_set_is_validated_once_where_it_is_prepared(monkeypatch, self_loops):
    """Counted by patching the validator: ``prepare`` validates once, and no step of a two-layer model
    over the prepared set validates again (its self-looped set, derived from a validated set, once)."""
    from tgattn import GraphAttentionConv

    seen = _count_validations(monkeypatch)
    torch.manual_seed(0)
    layers = [GraphAttentionConv(8, 4, heads=2, add_self_loops=self_loops) for _ in range(2)]
    x = torch.randn(12, 8)
    es = tgattn.prepare(_shuffled_with_repeat(12), 12, 12)
    assert len(seen) == 1
    for _ in range(3):
        for layer in layers:
            _step(layer, x, es)
    assert len(seen) == 1 + self_loops  # the looped set: prepared once for every layer and step


@pytest.mark.parametrize("self_loops", [False, True])
def test_a_plain_edge_index_is_validated_once_per_tensor(monkeypatch, self_loops):
    """A plain tensor is prepared on the fly: each edge set (the input, its looped twin) validated
    once, on the first call; the next layers and steps find them in the cache."""
    from tgattn import GraphAttentionConv

    seen = _count_validations(monkeypatch)
    torch.manual_seed(0)
    layers = [GraphAttentionConv(8, 4, heads=2, add_self_loops=self_loops) for _ in range(2)]
    x, ei = torch.randn(12, 8), _shuffled_with_repeat(12)
    _step(layers[0], x, ei)
    first = len(seen)
    assert 1 <= first <= 1 + self_loops
    assert len({id(t) for t in seen}) == first  # no edge set twice
    for _ in range(2):
        for layer in layers:
            _step(layer, x, ei)
    assert len(seen) == first


def test_a_prepared_set_moves_once_per_device_and_is_checked_against_the_call():
    es = tgattn.prepare(_shuffled_with_repeat(), 10, 10)
    meta = es.to("meta")
    assert es.to("cpu") is es and meta is es.to(torch.device("meta")) and meta.device.type == "meta"
    assert (meta.num_edges, meta.kind, meta.structure.src.device.type) == (es.num_edges, es.kind, "meta")
    assert meta.structure.lock is not es.structure.lock and meta.structure.extras == {}
    q, k, v, _ = inputs(10, 10, heads=2, dk=4)
    with pytest.raises(ValueError, match="the edge set is on meta, the queries on cpu"):
        graph_attention(q, k, v, meta)


def test_derived_data_is_kept_per_set_and_key():
    es = tgattn.prepare(builders.window(8, 1), 8, 8)
    made = []
    first = es.derived(("probe", torch.float32), lambda: made.append(1) or torch.zeros(1))
    assert es.derived(("probe", torch.float32), lambda: made.append(1)) is first
    assert es.derived(("probe", torch.float64), lambda: made.append(1) or 2) == 2
    assert made == [1, 1]
    assert tgattn.edgeset.self_looped(es, 8) is tgattn.edgeset.self_looped(es, 8)


def test_distributed_plans_take_a_prepared_set_and_attend_over_their_own():
    from tgattn.distributed import contiguous, make_plans
    from tgattn.distributed.attention import graph_attention as distributed_attention

    ei = _shuffled_with_repeat(12)
    part = contiguous(12, 1)
    (from_set,), (from_tensor,) = make_plans(tgattn.prepare(ei, 12, 12), part), make_plans(ei, part)
    assert torch.equal(from_set.edge_index, from_tensor.edge_index)
    assert from_set.edge_set is from_set.edge_set  # prepared once per plan
    q, k, v, _ = inputs(12, 12, heads=2, dk=4)
    torch.testing.assert_close(distributed_attention(q, k, v, from_set), oracle(q, k, v, ei),
                               atol=TOL[torch.float64], rtol=0)


def test_the_package_exports_the_prepared_set():
    assert tgattn.EdgeSet is tgattn.edgeset.EdgeSet and tgattn.prepare is tgattn.edgeset.prepare
    assert isinstance(tgattn.prepare(builders.causal(2), 2, 2), tgattn.EdgeSet)
