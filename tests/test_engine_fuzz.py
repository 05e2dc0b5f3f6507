"""Every backend against the float64 dense oracle on inputs that Hypothesis draws.

Each example draws an edge set (random with empty rows and self-loops, full, causal, packed,
window), then perhaps duplicates some edges, shuffles them, empties some queries, and hands
``edge_index`` over as int64 or int32, contiguous or strided; q, k, v of float64 or float32
with any strides; a bias ``[E]`` or ``[E, H]`` (q's dtype or float32) with ``-inf`` entries
and queries whose edges are all ``-inf``; any finite scale (0, negative and below float32's range included); logits
of ~1e4 (float64); returned weights. Forward, the returned weights and the gradients of q,
k, v and the bias are compared with the oracle's: :func:`tgattn.reference.dense_attention`
over the dense twin of the edge set (``engine_helpers.dense_twin``: m copies of an edge weigh
like one cell with ``log(m)`` added). Examples are derandomized: every run draws the same ones.
"""
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from tgattn import builders
from tgattn.functional import graph_attention
from tgattn.reference import dense_attention

from engine_helpers import dense_twin

BACKENDS = ["auto", "gather", "dense", "tile", "fused", "csr"]
EXAMPLES = 170  # per backend: 1,020 in all
TOL = {torch.float64: 1e-9, torch.float32: 1e-4}  # relative to the largest value compared


@st.composite
def edge_sets(draw):
    """``(edge_index [2, E] long, n_q, n_k)`` before the changes of :func:`cases`."""
    family = draw(st.sampled_from(["random", "full", "causal", "packed_full", "packed_causal", "window"]))
    if family == "random":
        n_q, n_k = draw(st.integers(1, 9)), draw(st.integers(1, 9))
        g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
        mask = torch.rand(n_q, n_k, generator=g) < draw(st.sampled_from([0.0, 0.15, 0.4, 0.8]))
        if draw(st.booleans()):  # self-loops
            mask.diagonal().fill_(True)
        return builders.from_mask(mask), n_q, n_k
    if family.startswith("packed"):
        lengths = draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))
        make = builders.full if family == "packed_full" else builders.causal
        return make(lengths), sum(lengths), sum(lengths)
    n = draw(st.integers(1, 9))
    if family == "window":
        return builders.window(n, draw(st.integers(0, 3)), causal=draw(st.booleans())), n, n
    return (builders.full(n) if family == "full" else builders.causal(n)), n, n


@st.composite
def cases(draw):
    ei, n_q, n_k = draw(edge_sets())
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    sometimes = lambda: draw(st.integers(0, 3)) == 0  # noqa: E731  (most sets keep their kind: dense runs them)
    if sometimes() and n_q > 1:  # queries without edges
        ei = ei[:, torch.rand(n_q, generator=g)[ei[1]] >= 0.3]
    if sometimes() and ei.shape[1]:  # some edges two or three times
        extra = ei[:, torch.rand(ei.shape[1], generator=g) < 0.4]
        ei = torch.cat([ei, extra, extra[:, ::2]], dim=1)
    if draw(st.booleans()):
        ei = ei[:, torch.randperm(ei.shape[1], generator=g)]
    dtype = draw(st.sampled_from([torch.float64, torch.float32]))
    heads, dk, dv = draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.integers(1, 4))
    big = dtype == torch.float64 and draw(st.booleans())  # logits ~1e4
    return dict(
        edge_index=ei, n_q=n_q, n_k=n_k, dtype=dtype, heads=heads, dk=dk, dv=dv, big=big, seed=draw(st.integers(0, 2**16)),
        index_as=draw(st.sampled_from(["long", "int32", "strided", "strided-int32"])),
        strided=draw(st.sampled_from(["none", "q", "k", "v", "all"])),
        scale=draw(st.one_of(st.sampled_from([None, 0.0, -0.0, -0.5, 1.0, 1e-50]), st.floats(-2.0, 2.0, allow_nan=False))),
        bias=draw(st.one_of(st.none(), st.sampled_from(["shared", "per-head"]))),
        bias_dtype=draw(st.sampled_from(["q", "float32"])),
        minus_inf=draw(st.sampled_from(["none", "edges", "rows", "both"])),
        weights=sometimes(),
    )


def _leaf(shape, strided: bool, dtype, g, factor=1.0):
    """``(tensor [N, H, d], leaf)``: with ``strided``, a transposed view whose last dimension is not contiguous."""
    n, h, d = shape
    base = torch.randn(n, d, h, generator=g, dtype=dtype) if strided else torch.randn(n, h, d, generator=g, dtype=dtype)
    leaf = (base * factor).requires_grad_()
    return (leaf.transpose(1, 2) if strided else leaf), leaf


def _bias(c, ei, g):
    """``[E]`` or ``[E, H]``, with ``-inf`` on some edges and on every edge of some queries."""
    e, heads = ei.shape[1], c["heads"]
    bias = 2 * torch.randn(e, heads if c["bias"] == "per-head" else 1, generator=g, dtype=torch.float64)
    if c["minus_inf"] in ("edges", "both"):
        bias[torch.rand(e, generator=g) < 0.2] = float("-inf")
    if c["minus_inf"] in ("rows", "both"):
        dead = torch.rand(c["n_q"], generator=g) < 0.3  # [n_q]
        bias[dead[ei[1]], torch.randint(bias.shape[1], (), generator=g)] = float("-inf")
    bias = bias.squeeze(1) if c["bias"] == "shared" else bias
    dtype = c["dtype"] if c["bias_dtype"] == "q" else torch.float32
    return bias.to(dtype).requires_grad_()


def _as_index(ei, how):
    if how.startswith("strided"):
        ei = torch.stack([ei[0], ei[1]], dim=1).T  # [2, E] with strides (1, 2)
    return ei.int() if how.endswith("int32") else ei


def _edge_weights(weights, ei, bias, dense_bias):
    """Each edge's weight ``[E, H]`` from the oracle's cell weights ``[H, Nq, Nk]``: copy c of a
    cell with bias log(sum_c' exp b_c') gets the cell's weight times exp(b_c) / sum_c' exp b_c'."""
    src, dst = ei
    cell = weights[:, dst, src].T  # [E, H]
    if dense_bias is None:
        return cell
    b = torch.zeros_like(cell) if bias is None else (bias if bias.dim() == 2 else bias.unsqueeze(-1))
    total = dense_bias[:, dst, src].T
    total = torch.where(torch.isfinite(total), total, torch.zeros_like(total))  # no inf - inf (nor its NaN gradient)
    return cell * torch.exp(b - total)


def _close(got, want, tol):
    assert got.shape == want.shape and got.dtype == want.dtype
    bound = tol * max(1.0, want.abs().max().item() if want.numel() else 0.0)
    torch.testing.assert_close(got, want, rtol=tol, atol=bound, equal_nan=False)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(c=cases())
def test_backend_matches_oracle(backend, c):
    ei, n_q, n_k, dtype, heads = c["edge_index"], c["n_q"], c["n_k"], c["dtype"], c["heads"]
    g = torch.Generator().manual_seed(c["seed"])
    factor = 100.0 if c["big"] else 1.0
    q, q_leaf = _leaf((n_q, heads, c["dk"]), c["strided"] in ("q", "all"), dtype, g, factor)
    k, k_leaf = _leaf((n_k, heads, c["dk"]), c["strided"] in ("k", "all"), dtype, g, factor)
    v, v_leaf = _leaf((n_k, heads, c["dv"]), c["strided"] in ("v", "all"), dtype, g)
    bias = None if c["bias"] is None else _bias(c, ei, g)
    leaves = [t for t in (q_leaf, k_leaf, v_leaf, bias) if t is not None]

    got = graph_attention(q, k, v, _as_index(ei, c["index_as"]), bias=bias, scale=c["scale"],
                          return_weights=c["weights"], backend=backend)
    out, w = got if c["weights"] else (got, None)

    wide = [None if t is None else t.double() for t in (q, k, v, bias)]
    mask, dense_bias = dense_twin(ei, n_q, n_k, heads, wide[3], torch.float64)
    ref, cells = dense_attention(*wide[:3], mask, bias=dense_bias, scale=c["scale"], return_weights=True)
    tol = TOL[dtype]
    _close(out.double(), ref, tol)
    grad_out = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    loss, ref_loss = (out.double() * grad_out).sum(), (ref * grad_out).sum()
    if w is not None:
        ref_w = _edge_weights(cells, ei, wide[3], dense_bias)
        _close(w.double(), ref_w, tol)
        grad_w = torch.randn(ref_w.shape, generator=g, dtype=torch.float64)
        loss, ref_loss = loss + (w.double() * grad_w).sum(), ref_loss + (ref_w * grad_w).sum()
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    ref_grads = torch.autograd.grad(ref_loss, leaves, allow_unused=True)
    for leaf, a, b in zip(leaves, grads, ref_grads):
        a = torch.zeros_like(leaf) if a is None else a
        b = torch.zeros_like(leaf) if b is None else b
        _close(a.double(), b.double(), max(tol, TOL[leaf.dtype]))
