"""softcap at the ends of the compute dtype's range: refused outside it, computed right inside it, on every backend.

The scores are computed in float32 for float16 / bfloat16 / float32 inputs and in float64 for
float64: a cap that rounds to 0 there read as "no cap" (fused, auto, tile, dense: error 1.98), one
that overflows gave NaN or finite wrong numbers. Inside the range the two limits have independent
oracles: a cap far above the scores leaves them as they are, one far below makes every score 0.
"""
import pytest
import torch

from tgattn import builders
from tgattn.functional import BACKENDS, graph_attention

F32, F64 = torch.finfo(torch.float32), torch.finfo(torch.float64)


def _inputs(dtype):
    g = torch.Generator().manual_seed(4)
    q = torch.randn(9, 2, 4, generator=g, dtype=torch.float64) * 3  # scores of several units
    k, v = torch.randn(9, 2, 4, generator=g, dtype=torch.float64), torch.randn(9, 2, 3, generator=g, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype), builders.window(9, 2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, cap", [
    (torch.float32, 1e-46), (torch.float32, 1e-40), (torch.float32, 3.5e38), (torch.float32, 1e308),
    (torch.bfloat16, 1e-46), (torch.float16, 1e39), (torch.float64, 1e-310),
])
@pytest.mark.parametrize("edge_value", [False, True])
def test_a_cap_the_compute_dtype_cannot_hold_is_refused_naming_it(backend, dtype, cap, edge_value):
    q, k, v, ei = _inputs(dtype)
    kw = dict(edge_value=torch.zeros(ei.shape[1], 2, 3, dtype=dtype)) if edge_value else {}
    work = torch.float64 if dtype == torch.float64 else torch.float32
    info = torch.finfo(work)
    message = (f"softcap must be within [{info.tiny}, {info.max}] for {dtype} inputs, whose scores are computed in "
               f"{work} (got {cap})")
    with pytest.raises(ValueError) as raised:
        graph_attention(q, k, v, ei, softcap=cap, backend=backend, **kw)
    assert str(raised.value) == message


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, cap, limit", [
    (torch.float32, F32.max, "uncapped"), (torch.float32, 1e10, "uncapped"), (torch.float32, F32.tiny, "zero"),
    (torch.bfloat16, F32.max, "uncapped"),
    (torch.float64, 1e300, "uncapped"), (torch.float64, 1e30, "uncapped"), (torch.float64, F64.tiny, "zero"),
])
def test_caps_at_the_ends_of_the_range_equal_their_limits(backend, dtype, cap, limit):
    q, k, v, ei = _inputs(dtype)
    out, weights = graph_attention(q, k, v, ei, softcap=cap, backend=backend, return_weights=True)
    q64, k64, v64 = (t.double() for t in (q, k, v))
    ref, ref_weights = graph_attention(q64 * (limit == "uncapped"), k64, v64, ei, backend="gather", return_weights=True)
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=2e-2, atol=2e-2) \
        if dtype == torch.bfloat16 else dict(rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(out.double(), ref, **tol)
    torch.testing.assert_close(weights.double(), ref_weights, **tol)
