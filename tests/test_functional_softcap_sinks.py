"""Logit soft-capping (softcap=, Gemma 2) and attention sinks (sinks=, gpt-oss's s_aux) against a dense oracle.

    s_ij = c tanh(scale <q_i, k_j> / c) + b_ij,     a_ij = exp(s_ij) / (exp(t_h) + sum_l exp(s_il))
"""
import pytest
import torch

from tgattn import builders
from tgattn.engine.recompute import dropout_factor
from tgattn.functional import eager_graph_attention, graph_attention
from tgattn.verify import random_edges

BACKENDS = ["auto", "gather", "dense", "tile", "fused", "csr", "triton"]
TOL64 = dict(rtol=1e-10, atol=1e-10)
HEADS, DK, DV, CAP = 2, 4, 3, 1.5
MODS = {"softcap": dict(softcap=CAP), "sinks": dict(sinks=True), "both": dict(softcap=CAP, sinks=True)}


def oracle(q, k, v, edge_index, scale, *, softcap=None, bias=None, sinks=None, mult=None):
    """Dense arithmetic over one column per edge (duplicates included) and one sink column.

    Column e of query i holds edge e's score when edge e ends at i, else -inf; the last column is
    the sink logit (value 0). Without sinks, a query whose edges are all absent or -inf gets a 0
    logit there instead: it outputs 0 and its edges have weight 0. Returns ``(out, weights [E, H])``.
    """
    src, dst = edge_index
    n_q, num_edges = q.shape[0], edge_index.shape[1]
    s = torch.einsum("ihd,ehd->hie", q, k[src]) * scale  # [H, Nq, E]
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias.T.unsqueeze(1)  # bias [E, 1 or H]
    on_row = dst.view(1, -1) == torch.arange(n_q).view(-1, 1)  # [Nq, E]
    s = s.masked_fill(~on_row, float("-inf"))
    if sinks is None:
        empty = (s.detach() == float("-inf")).all(-1)  # [H, Nq]: no edge, or every edge's bias -inf
        sink = torch.zeros(empty.shape, dtype=q.dtype).masked_fill(~empty, float("-inf"))
    else:
        sink = sinks.to(q.dtype).view(-1, 1).expand(-1, n_q)  # [H, Nq]
    p = torch.cat([s, sink.unsqueeze(-1)], dim=-1).softmax(-1)[..., :num_edges]  # [H, Nq, E], sink dropped
    weights = p[:, dst, torch.arange(num_edges)].T  # [E, H]
    used = p if mult is None else p * mult.T.unsqueeze(1)
    return torch.einsum("hie,ehd->ihd", used, v[src]), weights


def _duplicates(n):
    ei = builders.window(n, 2)
    extra = ei[:, ::4]
    both = torch.cat([ei, extra], dim=1)
    return both[:, torch.randperm(both.shape[1], generator=torch.Generator().manual_seed(3))]  # unsorted


PATTERNS = {  # name: (edge_index, n_q, n_k)
    "window": lambda: (builders.window(12, 2), 12, 12),
    "causal": lambda: (builders.causal(12), 12, 12),
    "random_empty_rows": lambda: (random_edges(12, 12, 0.2, seed=5), 12, 12),
    "duplicates": lambda: (_duplicates(12), 12, 12),
    "cross": lambda: (random_edges(7, 12, 0.4, seed=2), 7, 12),
}


def _inputs(n_q, n_k, num_edges, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n_q, HEADS, DK, generator=g, dtype=torch.float64) * 2  # scores of a few units: the cap bites
    k = torch.randn(n_k, HEADS, DK, generator=g, dtype=torch.float64) * 2
    v = torch.randn(n_k, HEADS, DV, generator=g, dtype=torch.float64)
    bias = torch.randn(num_edges, HEADS, generator=g, dtype=torch.float64)
    sinks = torch.randn(HEADS, generator=g, dtype=torch.float64)
    return [t.to(dtype).requires_grad_() for t in (q, k, v, bias, sinks)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("mods", list(MODS))
def test_forward_weights_and_gradients_equal_the_oracle(mods, pattern, backend):
    ei, n_q, n_k = PATTERNS[pattern]()
    assert pattern != "random_empty_rows" or len(set(ei[1].tolist())) < n_q  # the pattern has empty rows
    q, k, v, bias, sinks = _inputs(n_q, n_k, ei.shape[1])
    with torch.no_grad():
        bias[::7] = float("-inf")  # some edges removed by their bias
    kw = dict(MODS[mods], sinks=sinks if "sinks" in MODS[mods] else None)
    out, weights = graph_attention(q, k, v, ei, bias=bias, return_weights=True, backend=backend, **kw)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, bias, sinks)]
    ref, ref_weights = oracle(*leaves[:3], ei, DK ** -0.5, softcap=kw["softcap"] if "softcap" in kw else None,
                              bias=leaves[3], sinks=leaves[4] if kw["sinks"] is not None else None)
    torch.testing.assert_close(out, ref, **TOL64)
    torch.testing.assert_close(weights, ref_weights, **TOL64)
    g = torch.Generator().manual_seed(9)
    probe_out, probe_w = torch.randn(out.shape, generator=g, dtype=out.dtype), torch.randn(weights.shape, generator=g,
                                                                                            dtype=out.dtype)
    ((out * probe_out).sum() + (weights * probe_w).sum()).backward()
    ((ref * probe_out).sum() + (ref_weights * probe_w).sum()).backward()
    for name, t, leaf in zip("q k v bias sinks".split(), (q, k, v, bias, sinks), leaves):
        if name == "sinks" and kw["sinks"] is None:
            assert t.grad is None
            continue
        torch.testing.assert_close(t.grad, leaf.grad, **TOL64, msg=name)


def test_sinks_take_the_weight_the_edges_leave():
    """With a sink, a query's weights sum to 1 - exp(t) / (exp(t) + sum_j exp(s_ij)); one without edges outputs 0."""
    ei = builders.from_mask(torch.tensor([[True, True, False], [False, False, False], [True, True, True]]))
    q = k = v = torch.zeros(3, 1, 2, dtype=torch.float64)  # every score 0: each edge weighs exp(0)
    sinks = torch.tensor([0.5], dtype=torch.float64)
    for backend in BACKENDS:
        out, weights = graph_attention(q, k, v + 1, ei, sinks=sinks, return_weights=True, backend=backend)
        expected = torch.ones(5, dtype=torch.float64)
        expected[:2] /= 2 + torch.exp(sinks)  # query 0: two edges and the sink
        expected[2:] /= 3 + torch.exp(sinks)  # query 2: three edges and the sink
        torch.testing.assert_close(weights[:, 0], expected, **TOL64)
        assert torch.equal(out[1], torch.zeros(1, 2, dtype=torch.float64)), backend


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype, backend):
    ei, n_q, n_k = PATTERNS["duplicates"]()
    q, k, v, bias, sinks = _inputs(n_q, n_k, ei.shape[1], dtype)
    sinks32 = sinks.detach().float().requires_grad_()  # float32 is allowed with half q, as for a bias
    out, weights = graph_attention(q, k, v, ei, bias=bias, softcap=CAP, sinks=sinks32, return_weights=True,
                                   backend=backend)
    assert out.dtype == weights.dtype == dtype
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, bias, sinks32)]
    ref, ref_weights = oracle(*leaves[:3], ei, DK ** -0.5, softcap=CAP, bias=leaves[3], sinks=leaves[4])
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(weights.double(), ref_weights, rtol=2e-2, atol=2e-2)
    (out.double().sum() + weights.double().sum()).backward()
    (ref.sum() + ref_weights.sum()).backward()
    assert sinks32.grad.dtype == torch.float32 and q.grad.dtype == dtype
    for name, t, leaf in zip("q k v bias sinks".split(), (q, k, v, bias, sinks32), leaves):
        torch.testing.assert_close(t.grad.double(), leaf.grad, rtol=2e-2, atol=2e-2, msg=name)


def test_dropout_with_a_generator_csr_equals_gather_and_the_oracle():
    ei = builders.window(12, 3)  # sorted: csr and gather draw the same mask in the same edge order
    q, k, v, bias, sinks = _inputs(12, 12, ei.shape[1])
    mult = dropout_factor(ei.shape[1], HEADS, 0.3, q, torch.Generator().manual_seed(4))
    ref, _ = oracle(q, k, v, ei, DK ** -0.5, softcap=CAP, bias=bias, sinks=sinks, mult=mult)
    for backend in ("csr", "gather"):
        out, _ = eager_graph_attention(q, k, v, ei, bias, None, None, 0.3, False, backend,
                                       generator=torch.Generator().manual_seed(4), softcap=CAP, sinks=sinks)
        torch.testing.assert_close(out, ref, **TOL64)


@pytest.mark.parametrize("backend", ["csr", "gather"])
def test_double_backward_is_exact(backend):
    ei, n_q, n_k = PATTERNS["random_empty_rows"]()
    q, k, v, bias, sinks = _inputs(n_q, n_k, ei.shape[1])

    def f(q, k, v, bias, sinks):
        out, w = graph_attention(q, k, v, ei, bias=bias, softcap=CAP, sinks=sinks, return_weights=True, backend=backend)
        return out, w

    assert torch.autograd.gradgradcheck(f, (q, k, v, bias, sinks))


def test_torch_compile_fullgraph():
    ei, n_q, n_k = PATTERNS["window"]()
    q, k, v, bias, sinks = _inputs(n_q, n_k, ei.shape[1])

    def f(q, k, v, bias, sinks):
        return graph_attention(q, k, v, ei, bias=bias, softcap=CAP, sinks=sinks, return_weights=True)

    torch._dynamo.reset()
    out, weights = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v, bias, sinks)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, bias, sinks)]
    ref, ref_weights = oracle(*leaves[:3], ei, DK ** -0.5, softcap=CAP, bias=leaves[3], sinks=leaves[4])
    torch.testing.assert_close(out, ref, **TOL64)
    torch.testing.assert_close(weights, ref_weights, **TOL64)
    (out.sum() + weights.pow(2).sum()).backward()
    (ref.sum() + ref_weights.pow(2).sum()).backward()
    for name, t, leaf in zip("q k v bias sinks".split(), (q, k, v, bias, sinks), leaves):
        torch.testing.assert_close(t.grad, leaf.grad, **TOL64, msg=name)


def test_bad_softcap_and_sinks_name_the_value():
    ei = builders.causal(4)
    q = k = v = torch.randn(4, HEADS, DK, dtype=torch.float64)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=f"softcap must be a positive finite number \\(got {bad}\\)"):
            graph_attention(q, k, v, ei, softcap=bad)
    for bad in ("2", True):
        with pytest.raises(TypeError, match="softcap must be a positive finite number"):
            graph_attention(q, k, v, ei, softcap=bad)
    with pytest.raises(ValueError, match=r"sinks must have shape \[H\] = \[2\] \(got \[3\]\)"):
        graph_attention(q, k, v, ei, sinks=torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"sinks must have shape \[H\] = \[2\] \(got \[1, 2\]\)"):
        graph_attention(q, k, v, ei, sinks=torch.zeros(1, 2, dtype=torch.float64))
    for dtype in (torch.float16, torch.int64):
        with pytest.raises(ValueError, match=f"sinks must have q's dtype or float32 \\(got sinks {dtype}"):
            graph_attention(q, k, v, ei, sinks=torch.zeros(2, dtype=dtype))
    with pytest.raises(TypeError, match="sinks must be a torch.Tensor \\(got list\\)"):
        graph_attention(q, k, v, ei, sinks=[0.0, 0.0])
    with pytest.raises(ValueError, match="sinks holds \\+inf"):
        graph_attention(q, k, v, ei, sinks=torch.tensor([0.0, float("inf")], dtype=torch.float64))
    with pytest.raises(ValueError, match="softcap cannot be combined with edge_key"):
        graph_attention(q, k, v, ei, softcap=2.0, edge_key=torch.zeros(ei.shape[1], HEADS, DK, dtype=torch.float64))
