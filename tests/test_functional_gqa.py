"""Grouped-query heads through graph_attention: ``k``, ``v`` with ``H / G`` heads, query head ``h`` on key head
``h // G``, against SDPA's own ``enable_gqa`` on the dense mask in float64 (forward, and the gradients of q, k,
v: a key head's gradient sums over its group)."""
import pytest
import torch
import torch.nn.functional as F

import tgattn
from tgattn import builders
from tgattn.functional import graph_attention
from tgattn.verify import random_edges

from engine_helpers import max_err
from test_functional_softcap_sinks import oracle as edge_oracle

CPU_BACKENDS = ("dense", "csr", "fused", "tile", "auto", "gather")
N = 24
# (edge set over N queries and keys): causal runs on SDPA, the window on the tiles, random edges on the kernels.
SETS = {
    "causal": lambda: builders.causal(N),
    "window": lambda: builders.window(N, 6),
    "random": lambda: random_edges(N, N, 0.3, seed=3),
}


def _inputs(heads, kv_heads, d=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(N, heads, d, generator=g, dtype=dtype)
    k, v = (torch.randn(N, kv_heads, d, generator=g, dtype=dtype) for _ in range(2))
    return q, k, v, torch.randn(N, heads, d, generator=g, dtype=dtype)


def _sdpa_oracle(q, k, v, edge_index):
    """SDPA with the dense boolean mask and ``enable_gqa``, heads first, as its own grouping reads them."""
    mask = builders.to_mask(edge_index, q.shape[0], k.shape[0])  # [Nq, Nk], True = attended
    out = F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in (q, k, v)), attn_mask=mask, enable_gqa=True)
    return torch.nan_to_num(out.transpose(0, 1))  # a query without edges: NaN there, 0 in tgattn


def _check(out, leaves, ref, exact, grad_out, tol, grad_tol):
    assert out.shape == ref.shape and max_err(out.detach().double(), ref) <= tol
    got = torch.autograd.grad(out, leaves, grad_out.to(out.dtype))
    want = torch.autograd.grad(ref, exact, grad_out)
    for a, b, t in zip(got, want, leaves):
        assert a.shape == t.shape  # k and v keep their H / G heads
        assert max_err(a.double(), b) <= grad_tol * max(1.0, b.abs().max().item())


@pytest.mark.parametrize("prepared", [False, True], ids=["edge_index", "EdgeSet"])
@pytest.mark.parametrize("edges", list(SETS))
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_grouped_heads_equal_sdpa_enable_gqa(backend, edges, prepared):
    ei = SETS[edges]()
    q, k, v, grad_out = _inputs(heads=6, kv_heads=2)
    exact = [t.clone().requires_grad_() for t in (q, k, v)]
    mine = [t.clone().requires_grad_() for t in (q, k, v)]
    out = graph_attention(*mine, tgattn.prepare(ei, N, N) if prepared else ei, backend=backend)
    _check(out, mine, _sdpa_oracle(*exact, ei), exact, grad_out, 1e-12, 1e-11)


@pytest.mark.parametrize("backend", ["csr", "fused", "gather"])
def test_per_query_head_bias_sinks_and_weights_with_grouped_heads(backend):
    # bias [E, H] and sinks [H] are per query head; the weights [E, H] too.
    ei = SETS["random"]()
    q, k, v, grad_out = _inputs(heads=4, kv_heads=1)
    g = torch.Generator().manual_seed(1)
    bias, sinks = torch.randn(ei.shape[1], 4, generator=g, dtype=torch.float64), torch.randn(4, generator=g,
                                                                                            dtype=torch.float64)
    exact = [t.clone().requires_grad_() for t in (q, k, v)]
    mine = [t.clone().requires_grad_() for t in (q, k, v)]
    out, weights = graph_attention(*mine, ei, bias=bias, sinks=sinks, softcap=3.0, return_weights=True,
                                   backend=backend)
    ref, ref_weights = edge_oracle(exact[0], *(t.repeat_interleave(4, 1) for t in exact[1:]), ei, 8 ** -0.5,
                                   softcap=3.0, bias=bias, sinks=sinks)
    assert weights.shape == (ei.shape[1], 4) and max_err(weights, ref_weights) <= 1e-12
    _check(out, mine, ref, exact, grad_out, 1e-12, 1e-11)


def test_edge_terms_with_grouped_heads_equal_the_call_on_repeated_keys():
    ei = SETS["window"]()
    q, k, v, _ = _inputs(heads=4, kv_heads=2)
    g = torch.Generator().manual_seed(2)
    features, weight = torch.randn(ei.shape[1], 3, generator=g, dtype=torch.float64), torch.randn(
        4 * 8, 3, generator=g, dtype=torch.float64)
    terms = dict(edge_key=(features, weight), edge_value=(features, weight))
    out = graph_attention(q, k, v, ei, **terms)
    assert max_err(out, graph_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), ei, **terms)) \
        <= 1e-12


@pytest.mark.parametrize(
    "heads, match",
    [((3, 2, 2), r"multiple of k's.*got q 3, k 2 and v 2 heads"),
     ((4, 2, 1), r"v must have k's.*got q 4, k 2 and v 1")],
)
def test_a_bad_head_ratio_is_one_error_naming_the_counts(heads, match):
    q, k, v = (torch.randn(N, h, 8) for h in heads)
    for backend in ("auto", "gather"):
        with pytest.raises(ValueError, match=match):
            graph_attention(q, k, v, builders.causal(N), backend=backend)


def test_grouped_heads_under_torch_compile():
    # The custom op takes k, v of their own heads and gives their gradients in those shapes.
    ei = SETS["window"]()
    q, k, v, grad_out = _inputs(heads=4, kv_heads=2)
    exact = [t.clone().requires_grad_() for t in (q, k, v)]
    mine = [t.clone().requires_grad_() for t in (q, k, v)]
    compiled = torch.compile(lambda q, k, v: graph_attention(q, k, v, ei), backend="aot_eager", fullgraph=True)
    _check(compiled(*mine), mine, _sdpa_oracle(*exact, ei), exact, grad_out, 1e-12, 1e-11)


def test_a_nan_key_reaches_the_heads_of_its_group_and_the_queries_that_see_it():
    ei = SETS["window"]()
    q, k, v, _ = _inputs(heads=4, kv_heads=2)
    k[3, 1] = float("nan")  # key 3 of key head 1: query heads 2 and 3
    out = graph_attention(q, k, v, ei)
    sees = torch.zeros(N, dtype=torch.bool).index_fill_(0, ei[1][ei[0] == 3], True)
    bad = out.isnan().any(-1)  # [N, H]
    assert torch.equal(bad, sees.view(-1, 1) & torch.tensor([False, False, True, True]))
