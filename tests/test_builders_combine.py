"""union / intersection / difference / add_self_loops equal the boolean mask algebra."""
import pytest
import torch

from builder_checks import assert_edge_set, assert_matches_dense, ij
from tgattn import builders


def rand_edges(n_q, n_k, p, seed):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(n_q, n_k, generator=g) < p
    e = builders.from_mask(mask)
    perm = torch.randperm(e.shape[1], generator=g)
    return torch.cat([e[:, perm], e[:, perm[: len(perm) // 3]]], dim=1), mask  # shuffled, with duplicates


@pytest.mark.parametrize("n_q,n_k", [(0, 0), (1, 1), (9, 9), (7, 12)])
def test_set_algebra(n_q, n_k):
    (a, ma), (b, mb), (c, mc) = (rand_edges(n_q, n_k, 0.4, s) for s in range(3))
    assert_edge_set(builders.union(a, b, c), ma | mb | mc)
    assert_edge_set(builders.union(a), ma)
    assert_edge_set(builders.intersection(a, b, c), ma & mb & mc)
    assert_edge_set(builders.difference(a, b), ma & ~mb)
    assert_matches_dense(builders.union(a, b), n_q, n_k)


@pytest.mark.parametrize("n", [0, 1, 6])
def test_add_self_loops(n):
    a, ma = rand_edges(n, n, 0.3, 4)
    i, j = ij(n)
    assert_edge_set(builders.add_self_loops(a, n), ma | (i == j))
    assert_edge_set(builders.add_self_loops(a, [n, 2]), torch.block_diag(ma.byte(), torch.zeros(2, 2).byte()).bool() | torch.eye(n + 2, dtype=torch.bool))


def test_longformer_is_window_or_global():
    e = builders.union(builders.window(20, 2), builders.global_tokens(20, [0, 7]))
    i, j = ij(20)
    assert_edge_set(e, ((i - j).abs() <= 2) | (i == 0) | (i == 7) | (j == 0) | (j == 7))


def test_errors():
    with pytest.raises(ValueError, match="at least one"):
        builders.union()
    with pytest.raises(ValueError, match=r"shape \[2, E\] \(got \[3, 2\]\)"):
        builders.intersection(torch.zeros(3, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="negative node id -1"):
        builders.difference(torch.tensor([[0], [-1]]), torch.tensor([[0], [0]]))
    with pytest.raises(ValueError, match="refers to node 5, but n = 3"):
        builders.add_self_loops(torch.tensor([[5], [0]]), 3)
