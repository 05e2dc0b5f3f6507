"""Edge features inside the Triton kernels (tgattn.engine.triton.edge_features) against the per-query float64
oracle of tests/test_functional_edge_terms.py: outputs, returned weights and the gradients of q, k, v, bias,
features, both maps and the sinks, with -inf biases, empty rows, duplicates, cross attention, dropout (the
kernels' own mask), float32 and bfloat16. The calls are named ``backend="triton"`` on CPU tensors (Triton's
interpreter; the CUDA tensors a GPU would run) with the fused C++ route and the composition's helpers refused,
so only the kernels' own edge-feature path can answer.
"""
import pytest
import torch

from engine_helpers import checked_losses
from test_functional_edge_terms import DK, HEADS, KINDS, PATTERNS, _native_inputs, _oracle_terms, oracle
from tgattn import builders, engine
from tgattn.engine import dispatch, edge_terms
from tgattn.functional import graph_attention

pytest.importorskip("triton")
from tgattn.engine.triton.attention import dropout_keep, draw_seed, interpreter_ready  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(
    DEVICE.type == "cpu" and not interpreter_ready(),
    reason="TRITON_INTERPRET=1 must be set before triton is first imported (tests/conftest.py does it)",
)
TOL = dict(rtol=1e-10, atol=1e-10)
NAMES = "q k v bias e wk wv sinks".split()


@pytest.fixture(autouse=True)
def _kernels_only(monkeypatch):
    """Neither the fused kernel's route nor the composition's helpers may run the terms."""
    def refuse(*args, **kwargs):
        raise AssertionError("the edge terms did not run in the Triton kernels")

    monkeypatch.delenv("TGATTN_NO_TRITON", raising=False)
    monkeypatch.setattr(dispatch, "edge_terms_on_fused", lambda *args, **kwargs: False)
    monkeypatch.setattr(edge_terms, "key_scores", refuse)
    monkeypatch.setattr(edge_terms, "value_sum", refuse)


def _on_device(leaves):
    return [t.detach().to(DEVICE).requires_grad_() for t in leaves]


def _callers_keep(seed, edge_index, n_q, n_k, p):
    """The kernels' dropout factor ``[E, H]`` (0 or 1 / (1 - p)) of ``seed`` in the caller's edge order."""
    s = engine.analyse(edge_index, n_q, n_k)
    keep = dropout_keep(seed, s.num_edges, HEADS, p).double() / (1 - p)  # sorted order
    return keep if s.perm is None else torch.empty_like(keep).index_copy(0, s.perm, keep)


# (pattern, kind, mods, weights): every pattern and every kind, each option on some of them
CASES = [
    ("window", "shared", "plain", True), ("window", "two-maps", "dropout", False), ("window", "key", "sinks", True),
    ("random-with-empty-rows", "shared", "sinks", False), ("random-with-empty-rows", "value", "plain", True),
    ("random-with-empty-rows", "two-maps", "plain", True), ("duplicates-unsorted", "shared", "dropout", True),
    ("duplicates-unsorted", "key", "plain", False), ("duplicates-unsorted", "value", "sinks", True),
    ("cross", "two-maps", "sinks", True), ("cross", "key", "dropout", True), ("cross", "shared", "plain", False),
    ("full", "value", "dropout", False), ("full", "shared", "plain", True),
]


@pytest.mark.parametrize("pattern,kind,mods,weights", CASES)
def test_kernels_equal_the_oracle(pattern, kind, mods, weights):
    edge_index, nq, nk = PATTERNS[pattern]()
    num_edges = edge_index.shape[1]
    leaves, _ = _native_inputs(kind, nq, nk, num_edges)
    with torch.no_grad():
        leaves[3][edge_index[1] == 1, 0] = float("-inf")  # query 1 of head 0 without a finite score
    mine = _on_device(leaves)
    key, value = {"shared": ((mine[4], mine[5]),) * 2, "two-maps": ((mine[4], mine[5]), (mine[4], mine[6])),
                  "key": ((mine[4], mine[5]), None), "value": (None, (mine[4], mine[6]))}[kind]
    extra = dict(sinks=mine[7]) if mods == "sinks" else {}
    p = 0.4 if mods == "dropout" else 0.0
    torch.manual_seed(7)
    result = graph_attention(*mine[:3], edge_index.to(DEVICE), bias=mine[3], edge_key=key, edge_value=value,
                             return_weights=weights, dropout_p=p, backend="triton", **extra)
    out, w = result if weights else (result, None)
    mult = None
    if p > 0:
        torch.manual_seed(7)
        mult = _callers_keep(draw_seed(), edge_index, nq, nk, p)
        assert (mult == 0).any()
    ek, ev = _oracle_terms(kind, *leaves[4:7], num_edges)
    ref, ref_w = oracle(*leaves[:3], edge_index, ek, ev, DK**-0.5, leaves[3], mult,
                        sinks=leaves[7] if mods == "sinks" else None)
    loss, ref_loss = checked_losses(out.cpu(), ref, None if w is None else w.cpu(), ref_w, TOL)
    grads = torch.autograd.grad(loss, mine, allow_unused=True)
    ref_grads = torch.autograd.grad(ref_loss, leaves, allow_unused=True)
    for name, a, b in zip(NAMES, grads, ref_grads, strict=True):
        assert (a is None) == (b is None), name
        if a is not None:
            torch.testing.assert_close(a.cpu(), b, **TOL, msg=name)


# float32 accumulation; inputs, outputs and the products around the kernels rounded (as tests/test_engine_triton.py)
DTYPE_TOL = {torch.float32: 2e-6, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("dtype", list(DTYPE_TOL), ids=["f32", "bf16"])
def test_low_precision_dtypes(dtype):
    """TransformerConv's one pair for keys and values, F = 4 < d = 16, a window set with every row longer than
    one chunk of the kernels, against the float64 oracle of the rounded inputs."""
    edge_index = builders.window(32, 9)
    num_edges = edge_index.shape[1]
    g = torch.Generator().manual_seed(4)
    shapes = ((32, HEADS, 16), (32, HEADS, 16), (32, HEADS, 16), (num_edges, HEADS), (num_edges, 4), (HEADS * 16, 4))
    rounded = [torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype) for shape in shapes]
    mine = _on_device(rounded)
    out = graph_attention(*mine[:3], edge_index.to(DEVICE), bias=mine[3], edge_key=(mine[4], mine[5]),
                          edge_value=(mine[4], mine[5]), backend="triton")
    assert out.dtype == dtype
    exact = [t.double().requires_grad_() for t in rounded]
    vectors = (exact[4] @ exact[5].T).view(num_edges, HEADS, 16)
    ref, _ = oracle(*exact[:3], edge_index, vectors, vectors, 16**-0.5, exact[3])
    tol = DTYPE_TOL[dtype]
    probe = torch.randn(out.shape, generator=g, dtype=torch.float64)
    assert (out.cpu().double() - ref).abs().max() <= 4 * tol * max(1.0, ref.abs().max().item())
    grads = torch.autograd.grad((out.double() * probe.to(DEVICE)).sum(), mine)
    for name, a, b in zip("q k v bias e w".split(), grads, torch.autograd.grad((ref * probe).sum(), exact)):
        assert a.dtype == dtype, name
        assert (a.cpu().double() - b).abs().max() <= 4 * tol * max(1.0, b.abs().max().item()), name


def test_which_calls_take_the_kernels_path():
    """Named triton / tc and auto where the kernels take q; an edge_scale, a softcap or no edges compose."""
    s = engine.analyse(builders.window(8, 1), 8, 8)
    q = torch.zeros(8, HEADS, DK, device=DEVICE)
    assert dispatch.edge_terms_on_triton(s, "triton", q, edge_scale=False, softcap=False)
    assert dispatch.edge_terms_on_triton(s, "tc", q, edge_scale=False, softcap=False)
    assert dispatch.edge_terms_on_triton(s, "auto", q, edge_scale=False, softcap=False) == (DEVICE.type == "cuda")
    assert not dispatch.edge_terms_on_triton(s, "csr", q, edge_scale=False, softcap=False)
    assert not dispatch.edge_terms_on_triton(s, "triton", q, edge_scale=True, softcap=False)
    assert not dispatch.edge_terms_on_triton(s, "triton", q, edge_scale=False, softcap=True)
    empty = engine.analyse(torch.zeros(2, 0, dtype=torch.long), 8, 8)
    assert not dispatch.edge_terms_on_triton(empty, "triton", q, edge_scale=False, softcap=False)
