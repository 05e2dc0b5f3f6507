"""cross and cross_window (bipartite edge sets) against their twins and dense cross attention."""
import pytest
import torch

from builder_checks import TOL, assert_edge_set, assert_matches_dense, ij
from tgattn import GraphAttention, builders
from tgattn.reference import dense_attention


def full_twin(n_q, n_k):
    return torch.ones(n_q, n_k, dtype=torch.bool)


def aligned_twin(n_q, n_k, w):
    i, j = ij(n_q, n_k)
    return (j - ((2 * i + 1) * n_k) // (2 * max(n_q, 1))).abs() <= w


def block_pairs(nq_list, nk_list, rule):
    rows = []
    for b, (lq, lk) in enumerate(zip(nq_list, nk_list)):
        row = [rule(lq, lk) if c == b else torch.zeros(lq, l2, dtype=torch.bool) for c, l2 in enumerate(nk_list)]
        rows.append(torch.cat(row, dim=1) if row else torch.zeros(lq, 0, dtype=torch.bool))
    return torch.cat(rows) if rows else torch.zeros(0, 0, dtype=torch.bool)


@pytest.mark.parametrize("n_q,n_k", [(0, 0), (0, 3), (3, 0), (1, 1), (4, 7), (9, 2)])
def test_cross_rule(n_q, n_k):
    assert_edge_set(builders.cross(n_q, n_k), full_twin(n_q, n_k))
    assert builders.cross(n_q, n_k).shape[1] == n_q * n_k


@pytest.mark.parametrize("w", [0, 1, 3])
@pytest.mark.parametrize("n_q,n_k", [(0, 0), (0, 4), (4, 0), (1, 1), (1, 9), (6, 12), (12, 5), (10, 10)])
def test_cross_window_rule(n_q, n_k, w):
    assert_edge_set(builders.cross_window(n_q, n_k, w), aligned_twin(n_q, n_k, w))


def test_cross_window_is_monotonic_and_window_on_square():
    centre = ((2 * torch.arange(13) + 1) * 31) // 26
    assert bool((centre[1:] >= centre[:-1]).all())
    assert torch.equal(builders.cross_window(15, 15, 2), builders.window(15, 2))


def test_packed_pairs():
    nq, nk = [2, 0, 3, 1], [3, 2, 0, 4]
    assert_edge_set(builders.cross(nq, nk), block_pairs(nq, nk, full_twin))
    assert_edge_set(builders.cross_window(nq, nk, 1), block_pairs(nq, nk, lambda a, b: aligned_twin(a, b, 1)))


@pytest.mark.parametrize("make,n_q,n_k", [
    (lambda: builders.cross(7, 11), 7, 11),
    (lambda: builders.cross([3, 4], [6, 2]), 7, 8),
    (lambda: builders.cross_window(9, 20, 2), 9, 20),
    (lambda: builders.cross_window([5, 4], [10, 3], 1), 9, 13),
])
def test_attention_equals_dense(make, n_q, n_k):
    e = make()
    assert_matches_dense(e, n_q, n_k)
    torch.manual_seed(0)
    layer = GraphAttention(8, 2).double()
    x_q, x_kv = torch.randn(n_q, 8, dtype=torch.float64), torch.randn(n_k, 8, dtype=torch.float64)
    q, k, v = layer.project((x_kv, x_q))
    ref = layer.out_proj(dense_attention(q, k, v, builders.to_mask(e, n_q, n_k)).reshape(n_q, 8))
    for backend in ("auto", "message_passing"):
        torch.testing.assert_close(layer((x_kv, x_q), e, backend=backend), ref, **TOL)


def test_errors():
    with pytest.raises(ValueError, match="2 query lengths vs 3 key lengths"):
        builders.cross([1, 2], [1, 2, 3])
    with pytest.raises(ValueError, match="both be ints or both be packed lengths"):
        builders.cross(3, [1, 2])
    with pytest.raises(ValueError, match=r"w must be >= 0 \(got -2\)"):
        builders.cross_window(3, 4, -2)
    with pytest.raises(ValueError, match=r"each length must be >= 0 \(got -1\)"):
        builders.cross([1, -1], [1, 1])
