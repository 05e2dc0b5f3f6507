"""global_tokens (Longformer global attention) against its boolean twin and dense attention."""
import pytest
import torch

from builder_checks import assert_edge_set, assert_layer_matches_dense, assert_matches_dense, ij, packed_twin
from tgattn import builders


def twin(n, idx, causal=False):
    i, j = ij(n)
    chosen = torch.zeros(n, dtype=torch.bool)
    chosen[list(idx)] = True
    mask = chosen.view(-1, 1) | chosen.view(1, -1)
    return mask & (j <= i) if causal else mask


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n,idx", [(0, []), (1, [0]), (1, []), (6, [2]), (10, [0, 9, 3, 3]), (13, torch.tensor([1, 5]))])
def test_global_rule(n, idx, causal):
    e = builders.global_tokens(n, idx, causal=causal)
    assert_edge_set(e, twin(n, [int(x) for x in idx], causal))
    if not causal:
        k = len(set(int(x) for x in idx))
        assert e.shape[1] == 2 * k * n - k * k


@pytest.mark.parametrize("causal", [False, True])
def test_global_packed(causal):
    lengths = [3, 1, 0, 8]
    e = builders.global_tokens(lengths, [0, 2], causal=causal)
    assert_edge_set(e, packed_twin(lengths, lambda n: twin(n, [p for p in (0, 2) if p < n], causal)))
    assert builders.global_tokens([], [0]).shape == (2, 0)


def test_attention_equals_dense():
    e = builders.union(builders.window([9, 14], 1), builders.global_tokens([9, 14], [0, 4]))
    assert_matches_dense(e, 23)
    assert_layer_matches_dense(e, 23)
    assert_matches_dense(builders.global_tokens(11, [3], causal=True), 11)


def test_errors():
    with pytest.raises(ValueError, match="position 6, outside a sequence of length 6"):
        builders.global_tokens(6, [1, 6])
    with pytest.raises(ValueError, match="position -1, outside"):
        builders.global_tokens(6, [-1])
    with pytest.raises(ValueError, match=r"position 5, outside every packed sequence \(the longest has length 5\)"):
        builders.global_tokens([5, 2], [3, 5])
    with pytest.raises(ValueError, match="integer positions"):
        builders.global_tokens(6, [0.5])
