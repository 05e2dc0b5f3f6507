"""GraphAttentionConv is TransformerConv (issue 30): constructor, parameters, state_dict, results.

Every option combination is compared with PyG's ``TransformerConv`` holding the same weights
(its state_dict loaded with ``strict=True``): outputs, returned attention weights (edge order
included) and the gradients of every parameter and input, on both paths of the conv.
"""
import itertools

import pytest
import torch
from torch_geometric.nn import TransformerConv

from tgattn import GraphAttentionConv, builders
from tgattn.reference import dense_attention

TOL = {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=1e-5, atol=1e-5)}
H, C, F_EDGE = 2, 3, 4


def graph(n_src, n_dst, dtype, seed=0):
    """Unsorted edges with a duplicated edge and a target without edges; features; edge features."""
    g = torch.Generator().manual_seed(seed)
    ei = torch.stack([torch.randint(n_src, (18,), generator=g), torch.randint(n_dst - 1, (18,), generator=g)])
    ei = torch.cat([ei, ei[:, :1]], dim=1)  # the first edge twice; target n_dst - 1 has no edge
    x_src = torch.randn(n_src, 5, generator=g, dtype=dtype).requires_grad_()
    x_dst = torch.randn(n_dst, 3, generator=g, dtype=dtype).requires_grad_()
    e = torch.randn(ei.shape[1], F_EDGE, generator=g, dtype=dtype).requires_grad_()
    return ei, x_src, x_dst, e


OPTIONS = list(itertools.product([True, False], [False, True], [None, F_EDGE], [True, False], [True, False]))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("bipartite", [False, True], ids=["homogeneous", "bipartite"])
@pytest.mark.parametrize("concat, beta, edge_dim, bias, root_weight", OPTIONS)
def test_equals_transformer_conv(concat, beta, edge_dim, bias, root_weight, bipartite, dtype):
    args = ((5, 3) if bipartite else 5, C, H, concat, beta, 0.0, edge_dim, bias, root_weight)  # positional
    ref = TransformerConv(*args).to(dtype)
    conv = GraphAttentionConv(*args).to(dtype)
    conv.load_state_dict(ref.state_dict(), strict=True)
    shapes = {name: p.shape for name, p in ref.named_parameters() if root_weight or not name.startswith("lin_skip")}
    assert {name: p.shape for name, p in conv.named_parameters()} == shapes
    ei, x_src, x_dst, e = graph(7, 6 if bipartite else 7, dtype)
    x = (x_src, x_dst) if bipartite else x_src
    inputs = [x_src] + ([x_dst] if bipartite else []) + ([e] if edge_dim else [])
    e = e if edge_dim else None
    ref_out, (ref_ei, ref_alpha) = ref(x, ei, e, return_attention_weights=True)
    grad = torch.randn_like(ref_out)
    ref_params = [p for name, p in ref.named_parameters() if name in shapes]
    ref_grads = torch.autograd.grad(ref_out, ref_params + inputs, grad)
    for backend in ("auto", "message_passing"):
        out, (used, alpha) = conv(x, ei, e, return_attention_weights=True, backend=backend)
        torch.testing.assert_close(out, ref_out, **TOL[dtype])
        assert torch.equal(used, ref_ei)
        torch.testing.assert_close(alpha, ref_alpha, **TOL[dtype])  # in the order of edge_index
        grads = torch.autograd.grad(out, list(conv.parameters()) + inputs, grad)
        for a, b in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(a, b, **TOL[dtype])


@pytest.mark.parametrize("beta, edge_dim", [(False, None), (True, F_EDGE)])
def test_dropout_in_training_equals_transformer_conv_on_the_message_path(beta, edge_dim):
    """Both draw one F.dropout mask over [E, H] per call: the same seed gives the same result."""
    ref = TransformerConv(5, C, H, True, beta, 0.4, edge_dim).double().train()
    conv = GraphAttentionConv(5, C, H, True, beta, 0.4, edge_dim).double().train()
    conv.load_state_dict(ref.state_dict())
    ei, x, _, e = graph(7, 7, torch.float64, seed=1)
    e = e if edge_dim else None
    torch.manual_seed(3)
    ref_out = ref(x, ei, e)
    torch.manual_seed(3)
    out = conv(x, ei, e, backend="message_passing")
    torch.testing.assert_close(out, ref_out, **TOL[torch.float64])
    torch.manual_seed(3)
    assert not torch.allclose(conv(x, ei, e), conv.eval()(x, ei, e))  # the fast path drops weights too


def test_same_seed_gives_transformer_convs_weights():
    for args in ((5, C, H, True, True, 0.0, F_EDGE), ((5, 3), C, H, False, True, 0.0, None, False)):
        torch.manual_seed(0)
        ref = TransformerConv(*args)
        torch.manual_seed(0)
        conv = GraphAttentionConv(*args)
        assert list(conv.state_dict()) == list(ref.state_dict())
        for a, b in zip(conv.state_dict().values(), ref.state_dict().values()):
            assert torch.equal(a, b)


def test_positional_constructor_and_keyword_only_extras():
    conv = GraphAttentionConv(16, 8, 2, False, True, 0.1, 3, False, True)
    assert (conv.concat, conv.beta, conv.dropout, conv.edge_dim, conv.root_weight) == (False, True, 0.1, 3, True)
    assert conv.lin_query.bias is None and conv.lin_beta.weight.shape == (1, 3 * 8)
    assert conv.lin_edge.weight.shape == (2 * 8, 3)
    assert not GraphAttentionConv(16, 8, 2, True, True, root_weight=False).beta  # TransformerConv's rule
    with pytest.raises(TypeError):
        GraphAttentionConv(16, 8, 2, True, False, 0.0, None, True, True, False)  # add_self_loops is keyword-only


def test_root_weight_false_drops_transformer_convs_unused_root_weights():
    ref = TransformerConv(5, C, H, root_weight=False)
    conv = GraphAttentionConv(5, C, H, root_weight=False)
    assert conv.lin_skip is None and "lin_skip.weight" in ref.state_dict()
    conv.load_state_dict(ref.state_dict(), strict=True)
    ei, x, _, _ = graph(7, 7, torch.float32)
    torch.testing.assert_close(conv(x, ei), ref(x, ei), **TOL[torch.float32])


# the score-bias variant (edge_bias_dim), what edge_dim meant here before -------------------------------

def test_edge_bias_dim_is_a_per_head_score_bias():
    n = 8
    ei, x, _, _ = graph(n, n, torch.float64, seed=2)
    ei_unique = builders.from_mask(builders.to_mask(ei, n, n))  # a dense bias holds one value per pair
    e = torch.randn(ei_unique.shape[1], F_EDGE, dtype=torch.float64)
    conv = GraphAttentionConv(5, C, H, edge_bias_dim=F_EDGE).double()
    assert conv.lin_edge is None and conv.lin_edge_bias.weight.shape == (H, F_EDGE)
    q, k, v = (lin(x).view(n, H, C) for lin in (conv.lin_query, conv.lin_key, conv.lin_value))
    bias = torch.zeros(H, n, n, dtype=torch.float64)
    bias[:, ei_unique[1], ei_unique[0]] = conv.lin_edge_bias(e).T  # [H, E] placed at (i, j)
    ref = dense_attention(q, k, v, builders.to_mask(ei_unique, n, n), bias=bias).reshape(n, H * C) + conv.lin_skip(x)
    torch.testing.assert_close(conv(x, ei_unique, e), ref, **TOL[torch.float64])


def test_edge_dim_and_edge_bias_dim_together_read_one_edge_attr():
    ei, x, _, e = graph(7, 7, torch.float64, seed=4)
    both = GraphAttentionConv(5, C, H, edge_dim=F_EDGE, edge_bias_dim=F_EDGE).double()
    keys_values = GraphAttentionConv(5, C, H, edge_dim=F_EDGE).double()
    keys_values.load_state_dict({k: v for k, v in both.state_dict().items() if not k.startswith("lin_edge_bias")})
    extra = both.lin_edge_bias(e)  # [E, H]
    torch.testing.assert_close(both(x, ei, e), keys_values(x, ei, e, edge_bias=extra), **TOL[torch.float64])


def test_checkpoint_of_the_old_score_bias_loads_into_edge_bias_dim():
    """Before issue 30, GraphAttentionConv(edge_dim=F) learned lin_edge = Linear(F, H) as a score bias."""
    new = GraphAttentionConv(5, C, H, edge_bias_dim=F_EDGE).double()
    old = {("lin_edge.weight" if k == "lin_edge_bias.weight" else k): v.clone() for k, v in new.state_dict().items()}
    fresh = GraphAttentionConv(5, C, H, edge_bias_dim=F_EDGE).double()
    fresh.load_state_dict(old, strict=True)
    ei, x, _, e = graph(7, 7, torch.float64, seed=5)
    torch.testing.assert_close(fresh(x, ei, e), new(x, ei, e), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="build the conv with edge_bias_dim=4 instead of edge_dim"):
        GraphAttentionConv(5, C, H, edge_dim=F_EDGE).load_state_dict(old)


# bad input ---------------------------------------------------------------------------------------

def test_edge_attr_errors_name_the_option():
    ei, x, _, e = graph(7, 7, torch.float32)
    with pytest.raises(ValueError, match=r"edge_attr must have shape \[E, edge_dim\] = \[19, 4\] \(got \[19, 3\]\)"):
        GraphAttentionConv(5, C, H, edge_dim=F_EDGE)(x, ei, e[:, :3])
    with pytest.raises(ValueError, match=r"edge_attr must have shape \[E, edge_bias_dim\] = \[19, 4\]"):
        GraphAttentionConv(5, C, H, edge_bias_dim=F_EDGE)(x, ei, e[:-1])
    with pytest.raises(ValueError, match=r"edge_dim=None, edge_bias_dim=None; edge_attr given"):
        GraphAttentionConv(5, C, H)(x, ei, e)  # TransformerConv ignores it silently
    with pytest.raises(ValueError, match=r"edge_dim=4, edge_bias_dim=None; edge_attr missing"):
        GraphAttentionConv(5, C, H, edge_dim=F_EDGE)(x, ei)
    with pytest.raises(ValueError, match="edge_dim and edge_bias_dim read the same edge_attr"):
        GraphAttentionConv(5, C, H, edge_dim=4, edge_bias_dim=3)
    with pytest.raises(ValueError, match="edge_bias_dim must be None or a positive int"):
        GraphAttentionConv(5, C, H, edge_bias_dim=0)


@pytest.mark.parametrize(
    "theirs, ours, match",
    [
        (dict(edge_dim=3), dict(edge_dim=4), r"lin_edge.weight has shape \[6, 3\].*edge_dim=4"),
        (dict(concat=False), dict(), r"lin_skip.weight has shape \[3, 5\].*concat=True"),
        (dict(beta=True, concat=False), dict(beta=True), r"lin_beta.weight has shape \[1, 9\].*concat=True"),
        (dict(beta=True), dict(), r'Unexpected key\(s\) in state_dict: "lin_beta.weight"'),
        (dict(), dict(beta=True), r'Missing key\(s\) in state_dict: "lin_beta.weight"'),
        (dict(edge_dim=4), dict(), r'Unexpected key\(s\) in state_dict: "lin_edge.weight"'),
    ],
)
def test_state_dict_of_other_options_is_refused_naming_them(theirs, ours, match):
    state = TransformerConv(5, C, H, **theirs).state_dict()
    with pytest.raises(RuntimeError, match=match):
        GraphAttentionConv(5, C, H, **ours).load_state_dict(state)


def test_messagepassing_kwargs_are_refused_by_name():
    """TransformerConv passes **kwargs to MessagePassing (aggr, flow, ...); the attention core sums."""
    with pytest.raises(TypeError, match="unexpected keyword argument 'aggr'"):
        GraphAttentionConv(5, C, H, aggr="mean")


def test_return_attention_weights_false_returns_the_output_only():
    """TransformerConv returns the weights for any bool, False included; here only for True."""
    ei, x, _, _ = graph(7, 7, torch.float32)
    conv = GraphAttentionConv(5, C, H)
    assert isinstance(conv(x, ei, return_attention_weights=False), torch.Tensor)
    assert isinstance(TransformerConv(5, C, H)(x, ei, return_attention_weights=False), tuple)


def test_torch_jit_script_is_not_supported():
    """TorchScript is deprecated by PyTorch; torch.compile traces the conv (tests/test_conv_pyg.py)."""
    with pytest.raises(torch.jit.frontend.NotSupportedError):
        torch.jit.script(GraphAttentionConv(5, C, H))


def test_beta_gate_runs_lin_beta_as_a_module_under_a_hook():
    """The gate is computed from lin_beta's weight without the [N, 3 * width] concatenation; a hook
    on lin_beta sees the module called on that concatenation, with the same result."""
    ei, x, _, _ = graph(7, 7, torch.float64)
    conv = GraphAttentionConv(5, C, H, True, True).double()
    fast = conv(x, ei)
    seen = []
    handle = conv.lin_beta.register_forward_hook(lambda module, args, out: seen.append(args[0].shape))
    torch.testing.assert_close(conv(x, ei), fast, **TOL[torch.float64])
    handle.remove()
    assert seen == [torch.Size([7, 3 * H * C])]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_beta_gate_one_pass_equals_its_ops_twice_differentiable(dtype):
    """The fused extension's gate (forward and backward one pass each, ``beta_gate``) equals the gate in
    PyTorch ops (``_mix``): output and the three gradients, with rows of a width that is no multiple
    of a vector (a scalar tail), non-contiguous rows, more rows than a block of the weight gradient's
    sums; and it is twice differentiable (gradgradcheck, float64)."""
    from tgattn.engine.native import available
    from tgattn.engine.gate import _mix, beta_mix

    if not available():
        pytest.skip("the fused extension is not built")
    g = torch.Generator().manual_seed(0)
    out = torch.randn(13, 700, generator=g, dtype=dtype).T.requires_grad_()  # [700, 13], strided
    root = torch.randn(700, 13, generator=g, dtype=dtype).requires_grad_()
    w = (torch.randn(1, 39, generator=g, dtype=dtype) / 4).requires_grad_()
    grad = torch.randn(700, 13, generator=g, dtype=dtype)
    calls = []
    op = torch.ops.tgattn_fused.beta_gate
    with pytest.MonkeyPatch.context() as mp:  # the one-pass op must be what runs
        mp.setattr(torch.ops.tgattn_fused, "beta_gate", lambda *a: calls.append(1) or op(*a), raising=False)
        y = beta_mix(out, root, w)
    assert calls == [1]
    ref = _mix(out, root, w.view(-1))
    torch.testing.assert_close(y, ref, **TOL[dtype])
    for a, b in zip(torch.autograd.grad(y, (out, root, w), grad), torch.autograd.grad(ref, (out, root, w), grad)):
        torch.testing.assert_close(a, b, **TOL[dtype])
    if dtype == torch.float64:
        small = [t.detach()[:20, :5].clone().requires_grad_() for t in (out, root)] + [w.detach()[:, :15].clone().requires_grad_()]
        assert torch.autograd.gradgradcheck(beta_mix, small)


def test_beta_gate_gradients_do_not_depend_on_the_thread_count():
    """The weight gradient is summed per block of rows and the blocks added in one order: one thread and
    two give the same bits (several blocks, so that two threads split them)."""
    from tgattn.engine.native import available
    from tgattn.engine.gate import beta_mix

    if not available():
        pytest.skip("the fused extension is not built")
    g = torch.Generator().manual_seed(1)
    out, root = (torch.randn(1500, 16, generator=g).requires_grad_() for _ in range(2))
    w = torch.randn(1, 48, generator=g).requires_grad_()
    grad = torch.randn(1500, 16, generator=g)
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(torch.autograd.grad(beta_mix(out, root, w), (out, root, w), grad))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_explainer_edge_mask_scales_the_edge_values_too():
    """PyG's explain path multiplies the whole message a_ij (v_j + W_E e_ij) by the mask: so do
    the fast path (edge_scale on both value terms) and the message path, gradients included."""
    from torch_geometric.explain.algorithm.utils import clear_masks, set_masks

    ei, x, _, e = graph(7, 7, torch.float64, seed=6)
    ref = TransformerConv(5, C, H, True, True, 0.0, F_EDGE).double()
    conv = GraphAttentionConv(5, C, H, True, True, 0.0, F_EDGE).double()
    conv.load_state_dict(ref.state_dict())
    mask = torch.nn.Parameter(torch.randn(ei.shape[1], dtype=torch.float64))
    results = []
    for model, kw in ((ref, {}), (conv, {}), (conv, dict(backend="message_passing"))):
        set_masks(model, mask, ei)
        out = model(x, ei, e, **kw)
        results.append((out, torch.autograd.grad(out.pow(2).sum(), mask)[0]))
        clear_masks(model)
    for out, grad in results[1:]:
        torch.testing.assert_close(out, results[0][0], **TOL[torch.float64])
        torch.testing.assert_close(grad, results[0][1], **TOL[torch.float64])
