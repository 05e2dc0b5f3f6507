"""The Triton backend under ``torch.compile``: the custom op ``tgattn::graph_attention`` runs it.

Without a GPU the kernels run through Triton's interpreter on CPU tensors. ``opcheck`` checks
the op's schema, fake kernel and autograd registration against real runs; ``fullgraph=True``
with the ``aot_eager`` backend traces the op (Dynamo, fake shapes, AOT autograd with the
registered backward) without Inductor's C++ build, which adds nothing for an opaque op.
"""
import pytest
import torch

from tgattn import builders, engine
from tgattn.functional import graph_attention

from engine_helpers import inputs, max_err, oracle

pytest.importorskip("triton")
from tgattn.engine.custom_op import graph_attention_op  # noqa: E402
from tgattn.engine.triton.attention import interpreter_ready  # noqa: E402

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() or not interpreter_ready(),
    reason="runs the Triton kernels on CPU tensors through Triton's interpreter (TRITON_INTERPRET=1, no GPU)",
)


@pytest.fixture(autouse=True)
def _triton_on(monkeypatch):
    monkeypatch.delenv("TGATTN_NO_TRITON", raising=False)


def test_opcheck_of_the_custom_op_on_the_triton_backend():
    ei = builders.window(16, 1)
    q, k, v, _ = inputs(16, 16, heads=2, dk=4)
    bias = torch.randn(ei.shape[1], 2, dtype=torch.float64, requires_grad=True)
    torch.library.opcheck(graph_attention_op, (q, k, v, ei, bias, None, None, None, 0.0, True, "triton"))


def test_fullgraph_compile_runs_the_triton_kernels_and_keeps_the_analysis_cached():
    ei = torch.cat([builders.window(24, 2), torch.tensor([[23], [0]])], dim=1)
    q, k, v, grad_out = inputs(24, 24, heads=2, dk=8)
    bias = torch.randn(ei.shape[1], dtype=torch.float64, requires_grad=True)

    def attend(q, k, v, bias, ei):
        out, w = graph_attention(q, k, v, ei, bias=bias, backend="triton", return_weights=True)
        return out, w

    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)  # any graph break raises
    ref = oracle(q, k, v, ei, bias)
    ref_grads = torch.autograd.grad(ref, (q, k, v, bias), grad_out)
    engine.CACHE.clear()
    for _ in range(2):
        out, w = compiled(q, k, v, bias, ei)
        grads = torch.autograd.grad(out, (q, k, v, bias), grad_out)
    assert max_err(out, ref) <= 1e-10
    for g, r in zip(grads, ref_grads):
        assert max_err(g, r) <= 1e-10
    _, textbook_w = graph_attention(q, k, v, ei, bias=bias, backend="gather", return_weights=True)
    assert max_err(w, textbook_w) <= 1e-12
    # two forwards and two recomputing backwards, one analysis: the op sees the caller's tensor
    assert (engine.CACHE.misses, engine.CACHE.hits) == (1, 3)
