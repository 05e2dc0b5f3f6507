"""dilated and block_local against their boolean twins and dense attention."""
import pytest
import torch

from builder_checks import assert_edge_set, assert_layer_matches_dense, assert_matches_dense, ij, packed_twin
from tgattn import builders

SIZES = [0, 1, 2, 7, 16, 23]


def dilated_twin(n, w, r, causal):
    i, j = ij(n)
    mask = ((i - j).abs() <= w * r) & ((i - j) % r == 0)
    return mask & (j <= i) if causal else mask


def block_twin(n, b, causal):
    i, j = ij(n)
    mask = i // b == j // b
    return mask & (j <= i) if causal else mask


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("w,r", [(0, 1), (1, 2), (2, 3), (3, 1), (5, 4), (30, 2)])
@pytest.mark.parametrize("n", SIZES)
def test_dilated_rule(n, w, r, causal):
    e = builders.dilated(n, w, r, causal=causal)
    assert_edge_set(e, dilated_twin(n, w, r, causal))
    sides = 1 if causal else 2
    assert e.shape[1] == (n + sides * sum(max(0, n - k * r) for k in range(1, w + 1)) if n else 0)


def test_dilated_one_is_window():
    assert torch.equal(builders.dilated(19, 3, 1), builders.window(19, 3))
    assert torch.equal(builders.dilated(19, 3, 1, causal=True), builders.window(19, 3, causal=True))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("b", [1, 2, 3, 8, 40])
@pytest.mark.parametrize("n", SIZES)
def test_block_local_rule(n, b, causal):
    e = builders.block_local(n, b, causal=causal)
    assert_edge_set(e, block_twin(n, b, causal))
    m = n % b
    expected = (n // b) * b * (b + 1) // 2 + m * (m + 1) // 2 if causal else (n // b) * b**2 + m**2
    assert e.shape[1] == expected


def test_packed():
    lengths = [4, 0, 1, 11]
    assert_edge_set(builders.dilated(lengths, 2, 2), packed_twin(lengths, lambda n: dilated_twin(n, 2, 2, False)))
    assert_edge_set(builders.block_local(lengths, 3, causal=True), packed_twin(lengths, lambda n: block_twin(n, 3, True)))


@pytest.mark.parametrize("make,n", [
    (lambda: builders.dilated(21, 2, 3), 21),
    (lambda: builders.dilated([6, 13], 1, 4, causal=True), 19),
    (lambda: builders.block_local(17, 4), 17),
    (lambda: builders.block_local([5, 9], 3, causal=True), 14),
])
def test_attention_equals_dense(make, n):
    assert_matches_dense(make(), n)
    assert_layer_matches_dense(make(), n)


def test_errors():
    with pytest.raises(ValueError, match=r"dilation must be >= 1 \(got 0\)"):
        builders.dilated(8, 2, 0)
    with pytest.raises(ValueError, match=r"w must be >= 0 \(got -1\)"):
        builders.dilated(8, -1, 2)
    with pytest.raises(ValueError, match=r"block must be >= 1 \(got 0\)"):
        builders.block_local(8, 0)
    with pytest.raises(TypeError, match="must be an int"):
        builders.dilated(8, 1.5, 2)
