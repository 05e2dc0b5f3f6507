"""Logit soft-capping (softcap=, Gemma 2) and attention sinks (sinks=, gpt-oss's s_aux) against a dense oracle.

    s_ij = c tanh(scale <q_i, k_j> / c) + b_ij,     a_ij = exp(s_ij) / (exp(t_h) + sum_l exp(s_il))
"""
import pytest
import torch

from engine_helpers import checked_losses, fused_mask

from tgattn import builders, engine
from tgattn.engine import fused
from tgattn.engine import triton as triton_backend
from tgattn.engine.recompute import dropout_factor
from tgattn.functional import eager_graph_attention, graph_attention
from tgattn.verify import random_edges

BACKENDS = ["auto", "gather", "dense", "tile", "fused", "csr", "triton"]
# On CPU tensors every engine name but csr runs the fused kernel (SDPA and the tiles take neither a cap
# nor a sink), triton too where Triton's interpreter cannot run it.
ON_FUSED = {"auto", "dense", "tile", "fused"}
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


ENGINE_NAMES = set(BACKENDS) - {"gather"}
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


class _Ops:
    """``torch.ops.tgattn_fused`` with some ops replaced (the rest read through)."""

    def __init__(self, ops, **replaced):
        self._ops = ops
        self.__dict__.update(replaced)

    def __getattr__(self, name):
        return getattr(self._ops, name)


class KernelCalls:
    """Counts the fused kernel's forward and backward calls (the engine reaches them through ``torch.ops``)."""

    def __init__(self, monkeypatch):
        self.calls = {"forward": 0, "backward": 0}
        ops = torch.ops.tgattn_fused

        def counted(name):
            def call(*args):
                self.calls[name] += 1
                return getattr(ops, name)(*args)

            return call

        monkeypatch.setattr(torch.ops, "tgattn_fused", _Ops(ops, **{name: counted(name) for name in self.calls}))


def _expect_fused(backend, q):
    named_triton = backend == "triton" and not triton_backend.usable(q, named=True)
    return (backend in ON_FUSED or named_triton) and fused.available()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("mods", list(MODS))
def test_forward_weights_and_gradients_equal_the_oracle(mods, pattern, backend, monkeypatch):
    ei, n_q, n_k = PATTERNS[pattern]()
    assert pattern != "random_empty_rows" or len(set(ei[1].tolist())) < n_q  # the pattern has empty rows
    q, k, v, bias, sinks = _inputs(n_q, n_k, ei.shape[1])
    with torch.no_grad():
        bias[::7] = float("-inf")  # some edges removed by their bias
    kw = dict(MODS[mods], sinks=sinks if "sinks" in MODS[mods] else None)
    if backend in ENGINE_NAMES:
        chosen = engine.plan(engine.structure_of(ei, n_q, n_k), backend, weights=True, softcap="softcap" in kw,
                             sinks=kw["sinks"] is not None, triton=triton_backend.usable(q, named=backend == "triton"))
        assert chosen == ("fused" if _expect_fused(backend, q) else "triton" if backend == "triton" else "csr")
    counter = KernelCalls(monkeypatch)
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
    calls = 1 if _expect_fused(backend, q) else 0
    assert counter.calls == {"forward": calls, "backward": calls}


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


@pytest.mark.skipif(not fused.available(), reason="no C++ toolchain here")
@pytest.mark.parametrize("weights", [False, True])
def test_fused_dropout_with_the_kernels_mask_equals_the_oracle(weights):
    """Dropout inside the fused kernel with a cap and sinks: the oracle applies the kernel's own mask
    (fused.dropout_keep, replaying torch's generator for the seed), forward and gradients."""
    ei, n_q, n_k, p = builders.window(12, 3), 12, 12, 0.4  # sorted: the kernel's edge order is the caller's
    assert engine.structure_of(ei, n_q, n_k).perm is None
    q, k, v, bias, sinks = _inputs(n_q, n_k, ei.shape[1])
    torch.manual_seed(11)
    result = graph_attention(q, k, v, ei, bias=bias, softcap=CAP, sinks=sinks, dropout_p=p, return_weights=weights,
                             backend="fused")
    out, w = result if weights else (result, None)
    torch.manual_seed(11)
    keep = fused.dropout_keep(HEADS, ei.shape[1], p, int(torch.randint(0, 2**62, ())))  # [H, E]
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, bias, sinks)]
    ref, ref_w = oracle(*leaves[:3], ei, DK ** -0.5, softcap=CAP, bias=leaves[3], sinks=leaves[4],
                        mult=keep.T.double() / (1 - p))
    torch.testing.assert_close(out, ref, **TOL64)
    probe = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)
    loss, ref_loss = (out * probe).sum(), (ref * probe).sum()
    if weights:
        torch.testing.assert_close(w, ref_w, **TOL64)
        loss, ref_loss = loss + w.pow(2).sum(), ref_loss + ref_w.pow(2).sum()
    loss.backward()
    ref_loss.backward()
    for name, t, leaf in zip("q k v bias sinks".split(), (q, k, v, bias, sinks), leaves):
        torch.testing.assert_close(t.grad, leaf.grad, **TOL64, msg=name)


def _short_and_long_rows(n, seed):
    """Queries of 1-8 keys and keys of 1-8 queries (the float32 kernels' eight-lane groups), a few of
    11-20 keys (the general path, a vector of eight and a tail), queries without keys, and a key seen
    by a third of the queries (a general key pass among the short ones)."""
    g = torch.Generator().manual_seed(seed)
    degrees = torch.randint(1, 9, (n,), generator=g)
    degrees[torch.randperm(n, generator=g)[:5]] = torch.tensor([0, 0, 11, 17, 20])
    pairs = [torch.stack([torch.randperm(n, generator=g)[:d], torch.full((int(d),), i)]) for i, d in enumerate(degrees)]
    hub = torch.arange(0, n, 3)
    pairs.append(torch.stack([torch.full_like(hub, 5), hub]))
    return torch.unique(torch.cat(pairs, 1), dim=1)


@pytest.mark.skipif(not fused.available(), reason="no C++ toolchain here")
@pytest.mark.parametrize("weights", [False, True])  # with returned weights the backward leaves the eight-lane keys
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_fused_short_rows_float_with_cap_sinks_dropout(dtype, weights):
    """float32 (and bfloat16, computed in float32) on the fused kernel's eight-rows-at-a-time forward
    and eight-keys-at-a-time backward, and on its general rows: the vectorised float tanh on both
    sides of its two branches, a sink per head, dropout with the kernel's mask, a bias with -inf (a
    query whose edges are all -inf in head 0: only its sink is left), against the float64 oracle."""
    n, p = 64, 0.3
    ei = _short_and_long_rows(n, seed=3)
    q, k, v, bias, sinks = _inputs(n, n, ei.shape[1], seed=1)
    with torch.no_grad():
        removed = torch.rand(bias.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64) < 0.1
        bias[removed] = float("-inf")
        bias[ei[1] == 7, 0] = float("-inf")
    cast = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)] + [
        t.detach().float().requires_grad_() for t in (bias, sinks)]
    torch.manual_seed(5)
    result = graph_attention(*cast[:3], ei, bias=cast[3], softcap=CAP, sinks=cast[4], dropout_p=p,
                             return_weights=weights, backend="fused")
    out, w = result if weights else (result, None)
    torch.manual_seed(5)
    mult = fused_mask(ei, n, n, p, HEADS)  # the caller's order
    leaves = [t.detach().double().requires_grad_() for t in cast]
    ref, ref_w = oracle(*leaves[:3], ei, DK ** -0.5, softcap=CAP, bias=leaves[3], sinks=leaves[4], mult=mult)
    tol = dict(rtol=2e-5, atol=2e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    loss, ref_loss = checked_losses(out, ref, w, ref_w, tol)
    loss.backward()
    ref_loss.backward()
    for name, t, leaf in zip("q k v bias sinks".split(), cast, leaves):
        assert bool(t.grad.isfinite().all()), name
        torch.testing.assert_close(t.grad.double(), leaf.grad, **{key: 4 * x for key, x in tol.items()}, msg=name)


@pytest.mark.skipif(not fused.available(), reason="no C++ toolchain here")
def test_fused_sink_of_minus_infinity_is_no_sink():
    """A head whose sink is -inf has none: equal to csr, rows without edges output 0, no NaN in any gradient."""
    ei, n_q, n_k = PATTERNS["random_empty_rows"]()
    q, k, v, bias, sinks = _inputs(n_q, n_k, ei.shape[1])
    with torch.no_grad():
        sinks[0] = float("-inf")
    results = []
    for backend in ("fused", "csr"):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, bias, sinks)]
        out, w = graph_attention(*leaves[:3], ei, bias=leaves[3], softcap=CAP, sinks=leaves[4], return_weights=True,
                                 backend=backend)
        (out.sum() + w.pow(2).sum()).backward()
        results.append([out, w] + [t.grad for t in leaves])
    for got, want in zip(*results):
        assert not bool(got.isnan().any())
        torch.testing.assert_close(got, want, **TOL64)


@pytest.mark.skipif(not fused.available(), reason="no C++ toolchain here")
def test_fused_float32_cap_adds_no_more_than_the_scores_rounding():
    """Gemma 2's cap of 50 on scores of a few units (tanh's argument near 0, the kernel's polynomial
    branch): float32 weights are as close to the float64 oracle as without the cap (the float tanh's
    error relative to a small argument, not to 1: 1 - 2 e / (1 + e) alone was off by c * 6e-8)."""
    ei, n = random_edges(40, 40, 0.5, seed=4), 40
    q, k, v, _, _ = (t.detach() for t in _inputs(n, n, ei.shape[1], seed=3))
    q = q / 4  # scores of about one unit: their own float32 rounding is small
    errors = {}
    for cap in (None, 50.0):
        _, w = graph_attention(*(t.float() for t in (q, k, v)), ei, softcap=cap, return_weights=True, backend="fused")
        _, ref = oracle(q, k, v, ei, DK ** -0.5, softcap=cap)
        errors[cap] = ((w.double() - ref).abs() / ref).max().item()
    assert errors[None] < 1e-6
    assert errors[50.0] <= 3 * errors[None]
