"""An edge set says what is true of itself (issue 57.11).

Before: ``EdgeSet.tile_plan(torch.float64)`` returned a plan with every edge on tensor cores,
although ``backend="tc"`` runs float32 and float64 calls wholly on its gather kernels; and writing
into ``es.edge_index`` (documented as "must not be written to") made the set's two copies of its
edges disagree: ``es.edge_index`` said one thing, the analysis the engine runs on another.
"""
import warnings

import pytest
import torch

import tgattn
from tgattn import builders
from tgattn.functional import graph_attention

# Edges given out of order (so the set keeps a permutation), one query (3) with no key.
EDGES = [[2, 0, 1, 1, 0, 2], [0, 1, 2, 0, 2, 4]]
N = 5


def _dense(q, k, v, edges):
    """The float64 softmax over each query's keys, written out: no tgattn code."""
    out = torch.zeros(N, q.shape[1], v.shape[2], dtype=torch.float64)
    for i in range(N):
        keys = [j for j, t in zip(*edges) if t == i]
        if keys:
            scores = torch.einsum("hd,khd->hk", q[i], k[keys]) / q.shape[2] ** 0.5  # [H, keys]
            out[i] = torch.einsum("hk,khd->hd", scores.softmax(-1), v[keys])
    return out


@pytest.mark.parametrize("write", [
    lambda t: t.__setitem__((0, 0), 4),
    lambda t: t.add_(1).remainder_(N),
    lambda t: t.copy_(t.flip(1).clone()),
], ids=["one-entry", "every-entry", "reordered"])
@pytest.mark.parametrize("made", ["prepare", "cache"])
def test_writing_into_edge_index_does_not_change_the_set(write, made):
    ei = torch.tensor(EDGES)
    es = tgattn.prepare(ei, N, N) if made == "prepare" else tgattn.edgeset.as_edge_set(ei.clone(), N, N)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(N, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    write(es.edge_index)
    with pytest.warns(UserWarning, match="edge_index was written to in place: the set keeps the edges it was prepared with"):
        handed = es.edge_index
    assert handed.tolist() == EDGES
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once: the edges handed out again are the set's own
        assert es.edge_index is handed
    torch.testing.assert_close(graph_attention(q, k, v, es), _dense(q, k, v, EDGES), rtol=1e-12, atol=1e-12)
    assert ei.tolist() == EDGES  # the caller's tensor was never the set's


def test_reading_edge_index_costs_no_copy():
    es = tgattn.prepare(builders.window(64, 2), 64, 64)
    first = es.edge_index
    assert all(es.edge_index is first for _ in range(3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_tile_plan_of_a_gathered_dtype_is_refused(dtype):
    es = tgattn.prepare(builders.window(128, 8), 128, 128)
    with pytest.raises(ValueError) as refused:
        es.tile_plan(dtype)
    assert str(refused.value) == (f"dtype {dtype} has no tile plan: backend='tc' runs float32 and float64 inputs "
                                  "wholly on its gather kernels (tiles: torch.float16, torch.bfloat16)")
