"""graph_attention's per-edge key and value terms (edge_key= / edge_value=) against a per-query oracle.

    s_ij = scale <q_i, k_j + ek_ij> + b_ij,     o_i = sum_j a_ij (v_j + ev_ij)

The fused C++ kernel takes (features, weight) pairs over one features tensor natively (the tests
from test_native_terms_equal_the_oracle on count its calls and refuse the composition's helpers).
"""
import pytest
import torch

from engine_helpers import checked_losses, fused_mask
from test_functional_softcap_sinks import KernelCalls, _short_and_long_rows
from tgattn import builders, engine
from tgattn.engine import edge_terms, fused
from tgattn.engine.recompute import dropout_factor
from tgattn.functional import attention_with_edge_terms, graph_attention
from tgattn.verify import random_edges

TOL = dict(rtol=1e-10, atol=1e-10)
HEADS, DK, DV = 2, 4, 5


def oracle(q, k, v, edge_index, ek, ev, scale, bias=None, mult=None, *, softcap=None, sinks=None):
    """One query at a time: its edges' scores, their softmax (with the head's sink logit, without a
    value), the weighted sum. A query without edges, or whose edges all have bias -inf, outputs 0
    (without sinks)."""
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[2])
    weights = q.new_zeros(edge_index.shape[1], q.shape[1])
    for i in range(q.shape[0]):
        edges = (edge_index[1] == i).nonzero().flatten()
        if edges.numel() == 0:
            continue
        src = edge_index[0, edges]
        scores = (q[i] * (k[src] + ek[edges])).sum(-1) * scale  # [e_i, H]
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        if bias is not None:
            scores = scores + bias[edges]
        if sinks is not None:
            a = torch.cat([scores, sinks.unsqueeze(0)]).softmax(0)[:-1]
        else:
            dead = (scores.detach() == float("-inf")).all(0)  # [H]: heads where the row has no finite score
            a = scores.masked_fill(dead, 0.0).softmax(0).masked_fill(dead, 0.0)
        weights[edges] = a
        used = a if mult is None else a * mult[edges]
        out[i] = (used.unsqueeze(-1) * (v[src] + ev[edges])).sum(0)
    return out, weights


def _with_duplicates(n):
    ei = builders.window(n, 2)
    return torch.cat([ei, ei[:, ::5]], dim=1)[:, torch.randperm(ei.shape[1] + ei[:, ::5].shape[1])]  # unsorted


PATTERNS = {  # (edge_index, n_q, n_k)
    "window": lambda: (builders.window(12, 2), 12, 12),
    "random-with-empty-rows": lambda: (random_edges(14, 14, 0.12, 1), 14, 14),
    "duplicates-unsorted": lambda: (_with_duplicates(10), 10, 10),
    "cross": lambda: (random_edges(6, 9, 0.4, 0), 6, 9),
    "full": lambda: (builders.full(7), 7, 7),
}


def _leaf(*shape):
    return torch.randn(*shape, dtype=torch.float64, requires_grad=True)


@pytest.mark.parametrize("form", ["vectors", "features-factored", "features-expanded"])
@pytest.mark.parametrize("backend", ["auto", "gather", "dense", "tile", "fused", "csr"])
@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_equals_oracle(pattern, backend, form):
    torch.manual_seed(0)
    edge_index, nq, nk = PATTERNS[pattern]()
    num_edges = edge_index.shape[1]
    q, k, v = _leaf(nq, HEADS, DK), _leaf(nk, HEADS, DK), _leaf(nk, HEADS, DV)
    bias = _leaf(num_edges, HEADS)
    if form == "vectors":
        ek, ev = _leaf(num_edges, HEADS, DK), _leaf(num_edges, HEADS, DV)
        leaves, terms = [ek, ev], (ek, ev)
    else:  # F = 3 < d (applied to the features) or F = 7 > d (applied to the edges)
        f = 3 if form == "features-factored" else 7
        e, wk, wv = _leaf(num_edges, f), _leaf(HEADS * DK, f), _leaf(HEADS * DV, f)
        leaves, terms = [e, wk, wv], ((e, wk), (e, wv))
    out, weights = graph_attention(
        q, k, v, edge_index, bias=bias, edge_key=terms[0], edge_value=terms[1], return_weights=True, backend=backend
    )
    if form == "vectors":
        ek, ev = terms
    else:
        ek, ev = ((e @ w.T).view(num_edges, HEADS, -1) for w in (wk, wv))
    ref, ref_weights = oracle(q, k, v, edge_index, ek, ev, DK**-0.5, bias)
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(weights, ref_weights, **TOL)
    grad_out, grad_weights = torch.randn_like(out), torch.randn_like(weights)
    inputs = [q, k, v, bias] + leaves
    grads = torch.autograd.grad((out, weights), inputs, (grad_out, grad_weights))
    ref_grads = torch.autograd.grad((ref, ref_weights), inputs, (grad_out, grad_weights))
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("backend", ["auto", "gather", "csr"])
def test_dropout_and_edge_scale_apply_to_both_value_terms(backend):
    """One mask on a_ij for v_j and ev_ij alike: the oracle with dropout_factor's mask of the same seed."""
    torch.manual_seed(0)
    edge_index, n, _ = PATTERNS["duplicates-unsorted"]()
    num_edges = edge_index.shape[1]
    q, k, v = _leaf(n, HEADS, DK), _leaf(n, HEADS, DK), _leaf(n, HEADS, DV)
    ek, ev, edge_scale = _leaf(num_edges, HEADS, DK), _leaf(num_edges, HEADS, DV), _leaf(num_edges, 1)
    out, weights = attention_with_edge_terms(
        q, k, v, edge_index, None, edge_scale, None, 0.3, True, backend, ek, ev,
        generator=torch.Generator().manual_seed(5),
    )
    dropped = dropout_factor(num_edges, HEADS, 0.3, q, torch.Generator().manual_seed(5))  # [E, H]
    assert (dropped == 0).any()
    ref, ref_weights = oracle(q, k, v, edge_index, ek, ev, DK**-0.5, mult=edge_scale * dropped)
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(weights, ref_weights, **TOL)  # before dropout, as without edge terms
    grad = torch.randn_like(out)
    inputs = [q, k, v, ek, ev, edge_scale]
    for a, b in zip(torch.autograd.grad(out, inputs, grad), torch.autograd.grad(ref, inputs, grad), strict=True):
        torch.testing.assert_close(a, b, **TOL)


def test_only_one_term_and_no_edges():
    edge_index, n, _ = PATTERNS["window"]()
    q, k, v = _leaf(n, HEADS, DK), _leaf(n, HEADS, DK), _leaf(n, HEADS, DV)
    ek, ev = _leaf(edge_index.shape[1], HEADS, DK), _leaf(edge_index.shape[1], HEADS, DV)
    zero_k, zero_v = torch.zeros_like(ek), torch.zeros_like(ev)
    torch.testing.assert_close(graph_attention(q, k, v, edge_index, edge_key=ek),
                               oracle(q, k, v, edge_index, ek, zero_v, DK**-0.5)[0], **TOL)
    torch.testing.assert_close(graph_attention(q, k, v, edge_index, edge_value=ev),
                               oracle(q, k, v, edge_index, zero_k, ev, DK**-0.5)[0], **TOL)
    empty = torch.zeros(2, 0, dtype=torch.long)
    out = graph_attention(q, k, v, empty, edge_key=ek[:0], edge_value=ev[:0])
    assert out.shape == (n, HEADS, DV) and not out.any()


def test_half_precision_is_computed_in_float32():
    edge_index, n, _ = PATTERNS["window"]()
    q, k, v = (torch.randn(n, HEADS, DK, dtype=torch.float64) for _ in range(3))
    ek, ev = (torch.randn(edge_index.shape[1], HEADS, DK, dtype=torch.float64) for _ in range(2))
    ref = oracle(q, k, v, edge_index, ek, ev, DK**-0.5)[0]
    out = graph_attention(*(t.bfloat16() for t in (q, k, v)), edge_index, edge_key=ek.bfloat16(), edge_value=ev.bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref, rtol=5e-2, atol=5e-2)


def test_bad_terms_are_named():
    edge_index = builders.window(6, 1)
    num_edges = edge_index.shape[1]
    q = k = v = torch.randn(6, HEADS, DK)
    with pytest.raises(ValueError, match=rf"edge_key must have shape \[E, H, d\] = \[{num_edges}, 2, 4\] \(got \[{num_edges}, 2, 3\]\)"):
        graph_attention(q, k, v, edge_index, edge_key=torch.randn(num_edges, HEADS, 3))
    with pytest.raises(ValueError, match=r"edge_value must have q's dtype torch.float32 \(got torch.float64\)"):
        graph_attention(q, k, v, edge_index, edge_value=torch.randn(num_edges, HEADS, DK, dtype=torch.float64))
    with pytest.raises(ValueError, match=rf"edge_key weight must have shape \[H \* d, F\] = \[8, 3\] \(got \[6, 3\]\)"):
        graph_attention(q, k, v, edge_index, edge_key=(torch.randn(num_edges, 3), torch.randn(6, 3)))
    with pytest.raises(ValueError, match=rf"edge_value features must have shape \[E, F\] with E = {num_edges}"):
        graph_attention(q, k, v, edge_index, edge_value=(torch.randn(num_edges - 1, 3), torch.randn(8, 3)))
    with pytest.raises(TypeError, match="edge_key must be a tensor"):
        graph_attention(q, k, v, edge_index, edge_key=(torch.randn(num_edges, 3),))
    with pytest.raises(ValueError, match="refers to key/source node 9"):
        graph_attention(q, k, v, torch.tensor([[9], [0]]), edge_key=torch.randn(1, HEADS, DK))


@pytest.mark.parametrize("call", ["kernel", "csr", "gather", "vectors"])
def test_bad_node_ids_are_named_on_every_path(call):
    """A node id out of range raises naming it, where the terms run in the kernel (structure_of checks the ids
    as it sorts the edges) and where they are composed around the engine (checked before the first gather)."""
    q = k = v = torch.randn(6, HEADS, DK, dtype=torch.float64)
    features, weight = torch.randn(1, 3, dtype=torch.float64), torch.randn(HEADS * DK, 3, dtype=torch.float64)
    term = torch.randn(1, HEADS, DK, dtype=torch.float64) if call == "vectors" else (features, weight)
    backend = call if call in ("csr", "gather") else "auto"
    for edges, named in (([[9], [0]], "key/source node 9"), ([[0], [7]], "query/target node 7"),
                         ([[-1], [0]], "negative node id -1")):
        with pytest.raises(ValueError, match=named):
            graph_attention(q, k, v, torch.tensor(edges), edge_key=term, edge_value=term, backend=backend)


def test_one_pair_for_keys_and_values_of_different_widths_is_refused():
    """The same (features, weight) object for both terms is shared only when dk == dv."""
    edge_index = builders.window(6, 1)
    q, k, v = torch.randn(6, HEADS, DK), torch.randn(6, HEADS, DK), torch.randn(6, HEADS, DV)
    term = (torch.randn(edge_index.shape[1], 9), torch.randn(HEADS * DK, 9))
    with pytest.raises(ValueError, match=r"edge_value weight must have shape \[H \* d, F\] = \[10, 9\]"):
        graph_attention(q, k, v, edge_index, edge_key=term, edge_value=term)


def test_compiles_without_graph_breaks():
    """Under torch.compile the terms trace around the custom op, as one graph (fullgraph=True)."""
    from torch._dynamo.testing import CompileCounter

    edge_index, n, _ = PATTERNS["duplicates-unsorted"]()
    q, k, v = (torch.randn(n, HEADS, DK) for _ in range(3))
    e, w = torch.randn(edge_index.shape[1], 3), torch.randn(HEADS * DK, 3)

    def attend(q, k, v, edge_index, e, w, p):
        return graph_attention(q, k, v, edge_index, edge_key=(e, w), edge_value=(e, w), dropout_p=p)

    counter = CompileCounter()
    compiled = torch.compile(attend, backend=counter, fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v, edge_index, e, w, 0.0), attend(q, k, v, edge_index, e, w, 0.0),
                               rtol=1e-5, atol=1e-5)
    dropped = compiled(q, k, v, edge_index, e, w, 0.5)
    assert counter.frame_count == 2 and dropped.isfinite().all()
    assert not torch.allclose(dropped, attend(q, k, v, edge_index, e, w, 0.0))


# --- The terms inside the fused kernel --------------------------------------------------------------

native = pytest.mark.skipif(not fused.available(), reason="no C++ toolchain here")
KINDS = ("shared", "two-maps", "key", "value")  # shared: TransformerConv's one (edge_attr, lin_edge.weight)


def _refuse_composition(monkeypatch):
    """The composition's helpers raise: a call that reaches them did not run its terms in the kernel."""
    def refuse(*args, **kwargs):
        raise AssertionError("the edge terms were composed around the engine, not run in the fused kernel")

    monkeypatch.setattr(edge_terms, "key_scores", refuse)
    monkeypatch.setattr(edge_terms, "value_sum", refuse)


def _native_inputs(kind, nq, nk, num_edges, dtype=torch.float64, seed=0, features=3):
    """Leaves ``q, k, v, bias, e, wk, wv, sinks`` (``dv = dk`` for one shared pair) and the terms of ``kind``.
    Some biases are -inf, and all of query 1's in head 0."""
    g = torch.Generator().manual_seed(seed)
    dv = DK if kind == "shared" else DV

    def leaf(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    q, k, v, bias = leaf(nq, HEADS, DK), leaf(nk, HEADS, DK), leaf(nk, HEADS, dv), leaf(num_edges, HEADS)
    e, wk, wv, sinks = leaf(num_edges, features), leaf(HEADS * DK, features), leaf(HEADS * dv, features), leaf(HEADS)
    bias[torch.rand(bias.shape, generator=g) < 0.1] = float("-inf")
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v, bias, e, wk, wv, sinks)]
    return leaves, _terms(kind, *leaves[4:7])


def _terms(kind, e, wk, wv):
    return {"shared": ((e, wk),) * 2, "two-maps": ((e, wk), (e, wv)), "key": ((e, wk), None), "value": (None, (e, wv))}[kind]


def _oracle_terms(kind, e, wk, wv, num_edges):
    """The terms as vectors ``[E, H, d]`` (zeros for a missing one)."""
    wv = wk if kind == "shared" else wv
    ek, ev = ((e @ w.T).view(num_edges, HEADS, w.shape[0] // HEADS) for w in (wk, wv))
    return ek if kind != "value" else torch.zeros_like(ek), ev if kind != "key" else torch.zeros_like(ev)


@native
@pytest.mark.parametrize("weights", [False, True], ids=["no-weights", "weights"])
# softcap only with the value term: with edge_key it is refused (test_functional_softcap_sinks).
@pytest.mark.parametrize("kind,mods", [(k, m) for k in KINDS for m in ("plain", "sinks", "softcap", "dropout")
                                       if m != "softcap" or k == "value"])
@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_native_terms_equal_the_oracle(pattern, kind, mods, weights, monkeypatch):
    """float64: outputs, weights and the gradients of q, k, v, bias, features, both maps and the sinks,
    one forward and one backward call of the kernel and nothing of the composition; dropout with the
    kernel's own mask; -inf biases (a row of head 0 without a finite score), empty rows, duplicates."""
    edge_index, nq, nk = PATTERNS[pattern]()
    num_edges = edge_index.shape[1]
    leaves, (key, value) = _native_inputs(kind, nq, nk, num_edges)
    q, k, v, bias, e, wk, wv, sinks = leaves
    with torch.no_grad():
        bias[edge_index[1] == 1, 0] = float("-inf")
    extra = dict(sinks=sinks) if mods == "sinks" else dict(softcap=1.5) if mods == "softcap" else {}
    p = 0.4 if mods == "dropout" else 0.0
    _refuse_composition(monkeypatch)
    calls = KernelCalls(monkeypatch)
    torch.manual_seed(7)
    result = graph_attention(q, k, v, edge_index, bias=bias, edge_key=key, edge_value=value, return_weights=weights,
                             dropout_p=p, **extra)
    out, w = result if weights else (result, None)
    mult = None
    if p > 0:
        torch.manual_seed(7)
        mult = fused_mask(edge_index, nq, nk, p, HEADS)
        assert (mult == 0).any()
    ek, ev = _oracle_terms(kind, e, wk, wv, num_edges)
    ref, ref_w = oracle(q, k, v, edge_index, ek, ev, DK**-0.5, bias, mult, **extra)
    torch.testing.assert_close(out, ref, **TOL)
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    loss, ref_loss = (out * probe).sum(), (ref * probe).sum()
    if weights:
        torch.testing.assert_close(w, ref_w, **TOL)
        loss, ref_loss = loss + w.pow(2).sum(), ref_loss + ref_w.pow(2).sum()
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    ref_grads = torch.autograd.grad(ref_loss, leaves, allow_unused=True)
    assert calls.calls == {"forward": 1, "backward": 1}
    for name, a, b in zip("q k v bias e wk wv sinks".split(), grads, ref_grads, strict=True):
        assert (a is None) == (b is None), name
        if a is not None:
            torch.testing.assert_close(a, b, **TOL, msg=name)


@native
@pytest.mark.parametrize("weights", [False, True], ids=["no-weights", "weights"])  # weights: general key pass
@pytest.mark.parametrize("kind", ["shared", "key", "value"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
def test_native_terms_in_float_on_short_and_long_rows(dtype, kind, weights, monkeypatch):
    """float32, bfloat16 and float16 (read in place, computed in float32) on the kernel's eight-rows /
    eight-keys paths and its general rows, with dropout, sinks and -inf biases, against the float64
    oracle of the same (rounded) inputs."""
    n, p = 64, 0.3
    edge_index = _short_and_long_rows(n, seed=3)
    num_edges = edge_index.shape[1]
    leaves, (key, value) = _native_inputs(kind, n, n, num_edges, dtype=dtype, seed=2, features=4)
    leaves[3] = leaves[3].detach().float().requires_grad_()  # bias and sinks: float32 with half q
    leaves[7] = leaves[7].detach().float().requires_grad_()
    q, k, v, bias, e, wk, wv, sinks = leaves
    _refuse_composition(monkeypatch)
    torch.manual_seed(5)
    result = graph_attention(q, k, v, edge_index, bias=bias, edge_key=key, edge_value=value, sinks=sinks,
                             dropout_p=p, return_weights=weights)
    out, w = result if weights else (result, None)
    assert out.dtype == dtype
    torch.manual_seed(5)
    mult = fused_mask(edge_index, n, n, p, HEADS)
    wide = [t.detach().double().requires_grad_() for t in leaves]
    ek, ev = _oracle_terms(kind, *wide[4:7], num_edges)
    ref, ref_w = oracle(*wide[:3], edge_index, ek, ev, DK**-0.5, wide[3], mult, sinks=wide[7])
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    loss, ref_loss = checked_losses(out, ref, w, ref_w, tol)
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    ref_grads = torch.autograd.grad(ref_loss, wide, allow_unused=True)
    for name, a, b in zip("q k v bias e wk wv sinks".split(), grads, ref_grads, strict=True):
        if a is not None:
            assert a.dtype == leaves["q k v bias e wk wv sinks".split().index(name)].dtype, name
            torch.testing.assert_close(a.double(), b, **{key: 4 * x for key, x in tol.items()}, msg=name)


@native
@pytest.mark.parametrize("call", ["auto", "fused", "dense", "tile", "triton", "csr", "gather", "edge_scale",
                                  "vectors", "two-feature-tensors", "no-edges", "nan"])
def test_which_calls_run_the_terms_in_the_kernel(call, monkeypatch):
    """(features, weight) pairs over one features tensor run in the kernel from every backend name but
    csr and gather (on the CPU the others fall back to fused for them); an edge_scale (the kernel takes
    none), vectors, two features tensors, an empty edge set and non-finite inputs compose the terms.
    Every call equals the oracle."""
    edge_index, n, _ = PATTERNS["window"]() if call != "no-edges" else (torch.zeros(2, 0, dtype=torch.long), 12, 12)
    num_edges = edge_index.shape[1]
    leaves, (key, value) = _native_inputs("shared", n, n, num_edges)
    q, k, v, bias, e, wk, _, _ = leaves
    backend = call if call in ("auto", "fused", "dense", "tile", "triton", "csr", "gather") else "auto"
    edge_scale = torch.rand(num_edges, 1, dtype=torch.float64) if call == "edge_scale" else None
    ek, ev = _oracle_terms("shared", e, wk, wk, num_edges)
    if call == "vectors":
        key = value = ek
    if call == "two-feature-tensors":
        key, value = (e, wk), (e.clone(), wk)
    if call == "nan":
        v = v.detach().clone()
        v[3, 0, 0] = float("nan")
    native_calls = []
    for name in ("run_edge_terms", "run_mapped_edge_terms"):  # the maps in the kernel's node (float64) or apart
        run = getattr(engine.dispatch, name)
        monkeypatch.setattr(engine.dispatch, name, lambda *a, run=run, **kw: native_calls.append(1) or run(*a, **kw))
    out = graph_attention(q, k, v, edge_index, bias=bias, edge_key=key, edge_value=value, backend=backend,
                          edge_scale=edge_scale)
    expected_native = call in ("auto", "fused", "dense", "tile", "triton")
    assert len(native_calls) == int(expected_native)
    ref, _ = oracle(q, k, v, edge_index, ek, ev, DK**-0.5, bias, edge_scale)
    torch.testing.assert_close(out, ref, **TOL, equal_nan=True)


@native
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=["f64", "f32", "bf16"])
@pytest.mark.parametrize("kind", KINDS)
def test_maps_run_in_the_kernels_node(kind, dtype, monkeypatch):
    """float32 / float64 on the CPU: W_h^T q_i, the kernel and W_h s_i are one autograd node (MappedAttention),
    without key_features and project; half precision keeps them apart (the maps in float32 around the kernel).
    Both equal the oracle (here float32 and bfloat16 at their precision; float64 at 1e-10 above)."""
    edge_index, n, _ = PATTERNS["duplicates-unsorted"]()
    leaves, (key, value) = _native_inputs(kind, n, n, edge_index.shape[1], dtype=dtype)
    q, k, v, bias, e, wk, wv, _ = leaves
    runs = {"run_edge_terms": 0, "run_mapped_edge_terms": 0}

    def counted(name, run):
        def call(*args, **kwargs):
            runs[name] += 1
            return run(*args, **kwargs)
        return call

    for name in runs:
        monkeypatch.setattr(engine.dispatch, name, counted(name, getattr(engine.dispatch, name)))
    if dtype != torch.bfloat16:
        _refuse_composition(monkeypatch)
        for helper in ("key_features", "project"):
            monkeypatch.setattr(edge_terms, helper, lambda *a, **kw: pytest.fail("a map ran outside the kernel's node"))
    out = graph_attention(q, k, v, edge_index, bias=bias.detach().float(), edge_key=key, edge_value=value)
    mapped = dtype != torch.bfloat16
    assert runs == {"run_edge_terms": int(not mapped), "run_mapped_edge_terms": int(mapped)}
    assert (type(out.grad_fn).__name__ == "MappedAttentionBackward") == mapped
    wide = [t.detach().double().requires_grad_() for t in leaves]
    ek, ev = _oracle_terms(kind, *wide[4:7], edge_index.shape[1])
    ref, _ = oracle(*wide[:3], edge_index, ek, ev, DK**-0.5, wide[3].detach().float().double())
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5) if mapped else \
        dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(out.double(), ref, **tol)
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    grads = torch.autograd.grad((out.double() * probe).sum(), [q, k, v, e, wk, wv], allow_unused=True)
    ref_grads = torch.autograd.grad((ref * probe).sum(), [wide[i] for i in (0, 1, 2, 4, 5, 6)], allow_unused=True)
    for name, a, b in zip("q k v e wk wv".split(), grads, ref_grads, strict=True):
        assert (a is None) == (b is None), name
        if a is not None:
            torch.testing.assert_close(a.double(), b, **{key: 4 * x for key, x in tol.items()}, msg=name)


@native
@pytest.mark.parametrize("kind", KINDS)
def test_native_terms_twice_differentiable(kind):
    """create_graph=True: the gradients recompute on the textbook path, with the terms, and their own
    gradients equal the oracle's."""
    edge_index, n, _ = PATTERNS["duplicates-unsorted"]()
    leaves, (key, value) = _native_inputs(kind, n, n, edge_index.shape[1])
    q, k, v, bias, e, wk, wv, _ = leaves
    with torch.no_grad():
        bias.clamp_(min=-3)  # finite: the oracle's second derivative of a -inf score is NaN
    torch.manual_seed(3)
    out = graph_attention(q, k, v, edge_index, bias=bias, edge_key=key, edge_value=value, dropout_p=0.3)
    torch.manual_seed(3)
    mult = fused_mask(edge_index, n, n, 0.3, HEADS)
    ek, ev = _oracle_terms(kind, e, wk, wv, edge_index.shape[1])
    ref, _ = oracle(q, k, v, edge_index, ek, ev, DK**-0.5, bias, mult)
    names = "q k v bias e wk wv".split()[: 7 if kind == "two-maps" else 6]  # one map: wk (the value term's: wv)
    inputs = leaves[:5] + ([leaves[6]] if kind == "value" else leaves[5:len(names)])
    results = []
    for o in (out, ref):
        grads = torch.autograd.grad(o.pow(2).sum(), inputs, create_graph=True)
        results.append(torch.autograd.grad(sum((g * g).sum() for g in grads), inputs))
    for name, a, b in zip(names, *results, strict=True):
        torch.testing.assert_close(a, b, **TOL, msg=name)


@native
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("d, features", [(16, 4), (8, 3), (16, 8), (5, 4), (16, 11), (24, 1)])
def test_per_head_maps_equal_einsum(dtype, d, features):
    """The extension's per-head maps (d of 8 or 16 with at most 8 features in registers, other sizes in
    general loops; rows past a group of 8) and the autograd functions over them against einsum: values,
    gradients of every input, and a second derivative."""
    g = torch.Generator().manual_seed(d * 100 + features)
    n, heads = 21, 3
    tol = TOL if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)

    def leaf(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype).requires_grad_()

    q = leaf(heads, n, d).transpose(0, 1)  # [n, H, d] with a head stride: read in place
    s, base, maps = leaf(n, heads, features), leaf(n, heads, d), leaf(heads, d, features)
    ops = torch.ops.tgattn_fused
    torch.testing.assert_close(ops.head_map(q, maps), torch.einsum("nhd,hdf->nhf", q, maps), **tol)
    torch.testing.assert_close(ops.head_map_add(base, s, maps), base + torch.einsum("nhf,hdf->nhd", s, maps), **tol)
    torch.testing.assert_close(ops.head_map_add(None, s, maps), torch.einsum("nhf,hdf->nhd", s, maps), **tol)
    into = base.detach().clone()  # in place: the sums go into base itself
    assert ops.head_map_add(into, s, maps, True).data_ptr() == into.data_ptr()
    torch.testing.assert_close(into, ops.head_map_add(base, s, maps), rtol=0, atol=0)
    torch.testing.assert_close(ops.head_outer(q, s), torch.einsum("nhd,nhf->hdf", q, s), **tol)
    assert edge_terms._native(q, maps)

    def results():
        outs = (edge_terms.key_features(q, maps), edge_terms.project(s, maps, base), edge_terms.project(s, maps))
        refs = (torch.einsum("nhd,hdf->nhf", q, maps), base + torch.einsum("nhf,hdf->nhd", s, maps),
                torch.einsum("nhf,hdf->nhd", s, maps))
        return zip(outs, refs)

    inputs = (q, s, base, maps)
    for out, ref in results():
        torch.testing.assert_close(out, ref, **tol)
        w = torch.randn(ref.shape, generator=g, dtype=dtype)
        got = torch.autograd.grad((out * w).sum(), inputs, allow_unused=True)
        want = torch.autograd.grad((ref * w).sum(), inputs, allow_unused=True)
        for a, b in zip(got, want):
            assert (a is None) == (b is None)
            if a is not None:
                torch.testing.assert_close(a, b, **tol)
    if dtype == torch.float64:  # create_graph=True: the backward's einsum path, against the oracle's
        for out, ref in results():
            results = []
            for o in (out, ref):
                grads = [x for x in torch.autograd.grad(o.pow(2).sum(), inputs, create_graph=True, allow_unused=True)
                         if x is not None]
                results.append(torch.autograd.grad(sum((x * x).sum() for x in grads), inputs, allow_unused=True))
            for a, b in zip(*results):
                assert (a is None) == (b is None)
                if a is not None:
                    torch.testing.assert_close(a, b, **tol)


def test_per_head_maps_off_the_extension_equal_it(monkeypatch):
    """Where the native maps do not run (half precision here; the GPU, torch.compile), the batched per-head
    products give the same maps, and in float64 with the extension turned off the same gradients of every input
    (the maps' included, added up over their uses in place)."""
    g = torch.Generator().manual_seed(0)
    q, s = torch.randn(7, 2, 16, generator=g), torch.randn(7, 2, 4, generator=g)
    maps = torch.randn(2, 16, 4, generator=g)
    assert not edge_terms._native(q.bfloat16(), maps.bfloat16())
    got = edge_terms.key_features(q.bfloat16(), maps.bfloat16()).float()
    torch.testing.assert_close(got, torch.einsum("nhd,hdf->nhf", q, maps), rtol=0.05, atol=0.1)
    got = edge_terms.project(s.bfloat16(), maps.bfloat16(), q.bfloat16()).float()
    torch.testing.assert_close(got, q + torch.einsum("nhf,hdf->nhd", s, maps), rtol=0.05, atol=0.2)
    monkeypatch.setattr(edge_terms, "_native", lambda *tensors: False)
    leaves = [t.double().requires_grad_() for t in (q, s, maps)]
    w = [torch.randn(7, 2, n, generator=g, dtype=torch.float64) for n in (4, 16, 16)]

    def total(key, with_out, without_out):
        return (key * w[0]).sum() + (with_out * w[1]).sum() + (without_out * w[2]).sum()

    q2, s2, maps2 = leaves
    got = total(edge_terms.key_features(q2, maps2), edge_terms.project(s2, maps2, q2), edge_terms.project(s2, maps2))
    want = total(torch.einsum("nhd,hdf->nhf", q2, maps2), q2 + torch.einsum("nhf,hdf->nhd", s2, maps2),
                 torch.einsum("nhf,hdf->nhd", s2, maps2))
    torch.testing.assert_close(got, want, **TOL)
    for a, b in zip(torch.autograd.grad(got, leaves), torch.autograd.grad(want, leaves)):
        torch.testing.assert_close(a, b, **TOL)
