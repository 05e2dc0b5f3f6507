import pytest
import torch

from analysis_cases import HAND, dense_residual, random_edges, random_stack
from tgattn import builders
from tgattn.analysis import attention_rollout, layer_matrix


def test_hand_example():
    # A~ = rownorm(0.5 A + 0.5 I), rows already sum to 1:
    #   A~1 = [[1, 0, 0], [.25, .75, 0], [.25, .125, .625]]   A~2 = [[1, 0, 0], [.5, .5, 0], [0, .25, .75]]
    # R = A~2 A~1:
    #   row 0 = [1, 0, 0]
    #   row 1 = .5 [1, 0, 0] + .5 [.25, .75, 0]                  = [.625, .375, 0]
    #   row 2 = .25 [.25, .75, 0] + .75 [.25, .125, .625]        = [.25, .28125, .46875]
    expected = torch.tensor([[1, 0, 0], [0.625, 0.375, 0], [0.25, 0.28125, 0.46875]], dtype=torch.float64)
    torch.testing.assert_close(attention_rollout(HAND).to_dense(), expected, atol=1e-12, rtol=0)
    # Without the residual mix: R = A2 A1 = [[1, 0, 0], [1, 0, 0], [.5, .375, .125]].
    raw = torch.tensor([[1, 0, 0], [1, 0, 0], [0.5, 0.375, 0.125]], dtype=torch.float64)
    torch.testing.assert_close(attention_rollout(HAND, residual=False).to_dense(), raw, atol=1e-12, rtol=0)


@pytest.mark.parametrize("pattern", ["window", "causal", "random"])
@pytest.mark.parametrize("head", ["mean", 1])
def test_sparse_rollout_equals_dense(pattern, head):
    n = 24
    make = {
        "window": lambda s: builders.window(n, 2),
        "causal": lambda s: builders.causal(n),
        "random": lambda s: random_edges(n, 0.2, s),
    }[pattern]
    layers, dense = random_stack([make(s) for s in range(3)], n, heads=2)
    expected = torch.eye(n, dtype=torch.float64)
    for weights in dense:
        expected = dense_residual(weights, head) @ expected
    got = attention_rollout(layers, head=head).to_dense()
    torch.testing.assert_close(got, expected, atol=1e-10, rtol=0)
    torch.testing.assert_close(got.sum(1), torch.ones(n, dtype=torch.float64), atol=1e-10, rtol=0)
    rows = [5, 0, 23]
    torch.testing.assert_close(attention_rollout(layers, queries=rows, head=head).to_dense(), expected[rows])


def test_raw_rollout_equals_dense_product():
    n = 16
    layers, dense = random_stack([builders.window(n, 1, causal=True)] * 2 + [builders.full(n)], n, heads=3)
    expected = dense[2].mean(0) @ dense[1].mean(0) @ dense[0].mean(0)
    torch.testing.assert_close(attention_rollout(layers, residual=False).to_dense(), expected, atol=1e-10, rtol=0)


def test_rollout_support_is_the_widened_band():
    # Each window(n, w) layer widens the reach by w, so L layers reach |i - j| <= L w exactly.
    n, w, depth = 40, 2, 3
    layers, _ = random_stack([builders.window(n, w)] * depth, n, heads=1)
    rollout = attention_rollout(layers)
    i, j = rollout.indices()
    assert int((i - j).abs().max()) == depth * w
    assert rollout._nnz() == int(builders.to_mask(builders.window(n, depth * w)).sum())


def test_layer_matrix_row_without_edges_keeps_itself():
    ei = torch.tensor([[0, 1], [1, 1]])  # query 0 has no edges
    matrix = layer_matrix(ei, torch.tensor([0.25, 0.75]), 2).to_dense()
    torch.testing.assert_close(matrix, torch.tensor([[1.0, 0.0], [0.125, 0.875]], dtype=torch.float64))


def test_rollout_errors():
    with pytest.raises(ValueError, match="queries"):
        attention_rollout(HAND, queries=3)
    with pytest.raises(ValueError, match="head 2"):
        attention_rollout(HAND, head=2)
    with pytest.raises(ValueError, match="at least one layer"):
        attention_rollout([])
    with pytest.raises(ValueError, match="node 2"):
        attention_rollout(HAND, num_nodes=2)


@pytest.mark.parametrize("pattern, tiled", [("window", True), ("causal", True), ("scattered", False)])
def test_rollout_over_many_blocks_equals_dense_and_takes_the_tiles_where_the_pattern_is_local(pattern, tiled):
    from tgattn.analysis.rollout import TILE, rollout_tiles
    from tgattn.analysis.weights import layer_csr

    n = 2 * TILE + 37  # three blocks, the last one short
    make = {
        "window": lambda s: builders.window(n, 9, causal=bool(s % 2)),
        "causal": lambda s: builders.causal(n),
        "scattered": lambda s: random_edges(n, 0.01, s),
    }[pattern]
    layers, dense = random_stack([make(s) for s in range(3)], n, heads=2, seed=3)
    expected = torch.eye(n, dtype=torch.float64)
    for weights in dense:
        expected = dense_residual(weights) @ expected
    torch.testing.assert_close(attention_rollout(layers).to_dense(), expected, atol=1e-12, rtol=0)
    matrices = [layer_csr(ei, alpha, n) for ei, alpha in layers]
    assert (rollout_tiles(matrices) is not None) == tiled
