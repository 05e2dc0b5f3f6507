"""expander, virtual_nodes, exphormer and membership: arithmetic twins, expansion, dense equality."""
import pytest
import torch

from builder_checks import assert_edge_set, assert_layer_matches_dense, assert_matches_dense, block_diag, ij
from tgattn import builders


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def expander_twin(lengths, degree, seed):
    """The documented draw, written out: degree / 2 rounds of one uniform number per node, ranked per graph."""
    g, n = gen(seed), sum(lengths)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for _ in range(degree // 2):
        u = torch.rand(n, generator=g, dtype=torch.float64)
        start = 0
        for length in lengths:
            p = start + torch.argsort(u[start:start + length])  # p(start + r) = node of rank r
            i = torch.arange(start, start + length)
            mask[i, p] = mask[p, i] = True
            start += length
    return mask & ~torch.eye(n, dtype=torch.bool)


@pytest.mark.parametrize("lengths,degree", [([0], 2), ([1], 2), ([7], 0), ([9], 2), ([30], 4), ([5, 0, 12, 1, 8], 4), ([3], 6)])
def test_expander_twin(lengths, degree):
    e = builders.expander(lengths if len(lengths) > 1 else lengths[0], degree, generator=gen(3))
    assert_edge_set(e, expander_twin(lengths, degree, 3))


def test_expander_is_symmetric_regular_block_diagonal_and_seeded():
    lengths = [40, 3, 57]
    e = builders.expander(lengths, 6, generator=gen(1))
    mask = builders.to_mask(e, 100)
    assert torch.equal(mask, mask.T) and not mask.diagonal().any()
    seq = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))
    assert not (mask & (seq.view(-1, 1) != seq.view(1, -1))).any()
    deg = mask.sum(1)
    assert int(deg.max()) <= 6 and float(deg[seq != 1].double().mean()) > 5.5
    assert torch.equal(e, builders.expander(lengths, 6, generator=gen(1)))
    assert not torch.equal(e, builders.expander(lengths, 6, generator=gen(2)))


def test_expander_has_a_spectral_gap():
    # Friedman: lambda_2 <= 2 sqrt(d - 1) + eps w.h.p.; a cycle or grid of 200 nodes has lambda_2 ~ d
    d, n = 6, 200
    adj = builders.to_mask(builders.expander(n, d, generator=gen(0)), n).double()
    eig = torch.linalg.eigvalsh(adj)
    assert float(eig[-2]) < 2 * (d - 1) ** 0.5 + 0.3 < float(eig[-1]) - 1


def test_virtual_nodes_twin():
    lengths, k = [3, 0, 2, 4], 2
    n, size = sum(lengths), sum(lengths) + 2 * len(lengths)
    graph = torch.cat([torch.repeat_interleave(torch.arange(4), torch.tensor(lengths)), torch.arange(4).repeat_interleave(k)])
    virtual = torch.arange(size) >= n
    i, j = ij(size)
    twin = (graph[i] == graph[j]) & (virtual[i] ^ virtual[j])
    e = builders.virtual_nodes(lengths, k)
    assert_edge_set(e, twin)
    assert e.shape[1] == 2 * k * n
    assert_edge_set(builders.virtual_nodes(5, 1), builders.to_mask(builders.virtual_nodes([5], 1), 6))


def test_exphormer_is_the_union_and_membership_labels_it():
    lengths = [6, 9]
    ring = torch.cat([torch.stack([torch.arange(s, s + L), s + (torch.arange(L) + 1) % L]) for s, L in ((0, 6), (6, 9))], 1)
    ring = torch.cat([ring, ring.flip(0)], 1)
    e = builders.exphormer(ring, lengths, 4, num_virtual=1, generator=gen(5))
    size = 17
    exp = builders.expander(lengths, 4, generator=gen(5))
    virt = builders.virtual_nodes(lengths, 1)
    loops = torch.arange(size).expand(2, size)
    twin = (builders.to_mask(ring, size) | builders.to_mask(exp, size) | builders.to_mask(virt, size)
            | torch.eye(size, dtype=torch.bool))
    assert_edge_set(e, twin)
    kind = builders.membership(e, ring, loops, virt, exp)
    assert bool((kind >= 0).all())
    assert torch.equal(kind == 0, builders.to_mask(ring, size)[e[1], e[0]])
    assert torch.equal(kind == 2, (e >= 15).any(0) & (e[0] != e[1]))
    assert torch.equal(kind == 1, e[0] == e[1])
    assert_matches_dense(e, size)
    assert_layer_matches_dense(e, size)


def test_membership_first_part_wins_and_minus_one_for_none():
    e = builders.full(3)
    label = builders.membership(e, builders.causal(3), builders.window(3, 1))
    i, j = e[1], e[0]
    expected = torch.where(j <= i, 0, torch.where((i - j).abs() <= 1, 1, -1))
    assert torch.equal(label, expected)
    assert torch.equal(builders.membership(e), torch.full((9,), -1))


@pytest.mark.parametrize("call,word", [
    (lambda: builders.expander(5, 3), "degree must be even"),
    (lambda: builders.expander(5, -2), r"degree must be >= 0 \(got -2\)"),
    (lambda: builders.virtual_nodes(5, -1), r"k must be >= 0 \(got -1\)"),
    (lambda: builders.exphormer(torch.tensor([[0], [5]]), 5, 2), "refers to node 5"),
])
def test_errors_name_the_value(call, word):
    with pytest.raises(ValueError, match=word):
        call()


def test_block_diag_twin_of_packed_expander():
    lengths = [4, 6]
    e = builders.expander(lengths, 2, generator=gen(7))
    parts = [e[:, e[1] < 4], e[:, e[1] >= 4] - 4]
    assert_edge_set(e, block_diag([builders.to_mask(parts[0], 4), builders.to_mask(parts[1], 6)]))
