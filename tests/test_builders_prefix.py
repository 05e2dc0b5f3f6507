"""prefix_lm against its boolean twin and dense attention."""
import pytest
import torch

from builder_checks import assert_edge_set, assert_layer_matches_dense, assert_matches_dense, block_diag, ij
from tgattn import builders


def twin(n, p):
    i, j = ij(n)
    return (j <= i) | (j < p)


@pytest.mark.parametrize("p", [0, 1, 2, 5, 30])
@pytest.mark.parametrize("n", [0, 1, 2, 7, 12])
def test_prefix_rule(n, p):
    e = builders.prefix_lm(n, p)
    assert_edge_set(e, twin(n, p))
    q = min(p, n)
    assert e.shape[1] == q * q + (n - q) * (n + q + 1) // 2


def test_prefix_limits():
    assert torch.equal(builders.prefix_lm(9, 0), builders.causal(9))
    assert torch.equal(builders.prefix_lm(9, 9), builders.full(9))


def test_packed_one_or_many_prefixes():
    lengths = [4, 0, 1, 9]
    assert_edge_set(builders.prefix_lm(lengths, 2), block_diag([twin(n, 2) for n in lengths]))
    prefixes = [3, 5, 0, 4]
    assert_edge_set(builders.prefix_lm(lengths, prefixes), block_diag([twin(n, p) for n, p in zip(lengths, prefixes)]))
    assert_edge_set(builders.prefix_lm(lengths, torch.tensor(prefixes)), block_diag([twin(n, p) for n, p in zip(lengths, prefixes)]))


def test_attention_equals_dense():
    e = builders.prefix_lm([6, 11], [2, 4])
    assert_matches_dense(e, 17)
    assert_layer_matches_dense(e, 17)


def test_errors():
    with pytest.raises(ValueError, match=r"prefix must be >= 0 \(got -1\)"):
        builders.prefix_lm(5, -1)
    with pytest.raises(ValueError, match="got 3 prefixes for 2 lengths"):
        builders.prefix_lm([4, 5], [1, 2, 3])
    with pytest.raises(ValueError, match="got 2 prefixes for a single length"):
        builders.prefix_lm(5, [1, 2])
