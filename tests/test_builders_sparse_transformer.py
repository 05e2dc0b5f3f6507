"""strided and fixed (Child et al. 2019) against the paper's rules and dense attention."""
import pytest
import torch

from builder_checks import assert_edge_set, assert_layer_matches_dense, assert_matches_dense, ij, packed_twin
from tgattn import builders

SIZES = [0, 1, 2, 9, 16, 25]


def strided_twin(n, l, causal):
    i, j = ij(n)
    if causal:  # A(1) = {max(0, i - l) .. i}, A(2) = {j <= i : (i - j) mod l = 0}
        return ((i - j >= 0) & (i - j <= l)) | ((j <= i) & ((i - j) % l == 0))
    return ((i - j).abs() <= l) | ((i - j) % l == 0)


def fixed_twin(n, l, c, causal):
    i, j = ij(n)
    mask = (j // l == i // l) | (j % l >= l - c)  # A(1) | A(2), j mod l in {l - c, ..., l - 1}
    return mask & (j <= i) if causal else mask


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("stride", [1, 2, 3, 4, 30])
@pytest.mark.parametrize("n", SIZES)
def test_strided_rule(n, stride, causal):
    assert_edge_set(builders.strided(n, stride, causal=causal), strided_twin(n, stride, causal))


def test_strided_is_union_of_the_two_heads():
    n, l = 30, 5
    heads = builders.union(builders.window(n, l, causal=True), builders.dilated(n, n, l, causal=True))
    assert torch.equal(builders.strided(n, l, causal=True), heads)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block,c", [(1, 0), (1, 1), (3, 1), (4, 2), (4, 4), (8, 0)])
@pytest.mark.parametrize("n", SIZES)
def test_fixed_rule(n, block, c, causal):
    e = builders.fixed(n, block, c, causal=causal)
    assert_edge_set(e, fixed_twin(n, block, c, causal))
    if not causal and n % block == 0:
        b = n // block
        assert e.shape[1] == b * block**2 + b * (b - 1) * block * c


def test_fixed_zero_summaries_is_block_local():
    assert torch.equal(builders.fixed(23, 4, 0), builders.block_local(23, 4))


def test_packed():
    lengths = [5, 0, 1, 14]
    assert_edge_set(builders.strided(lengths, 3, causal=True), packed_twin(lengths, lambda n: strided_twin(n, 3, True)))
    assert_edge_set(builders.fixed(lengths, 4, 1), packed_twin(lengths, lambda n: fixed_twin(n, 4, 1, False)))


@pytest.mark.parametrize("make,n", [
    (lambda: builders.strided(25, 5, causal=True), 25),
    (lambda: builders.strided([7, 12], 3), 19),
    (lambda: builders.fixed(24, 4, 1, causal=True), 24),
    (lambda: builders.fixed([9, 10], 3, 2), 19),
])
def test_attention_equals_dense(make, n):
    assert_matches_dense(make(), n)
    assert_layer_matches_dense(make(), n)


def test_errors():
    with pytest.raises(ValueError, match=r"stride must be >= 1 \(got 0\)"):
        builders.strided(8, 0)
    with pytest.raises(ValueError, match=r"c must be <= block = 4 \(got 5\)"):
        builders.fixed(8, 4, 5)
    with pytest.raises(ValueError, match=r"c must be >= 0 \(got -1\)"):
        builders.fixed(8, 4, -1)
