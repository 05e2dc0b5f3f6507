"""Core builders (full, causal, window) and mask conversions against their O(n^2) twins."""
import pytest
import torch

from tgattn import builders
from tgattn.builders._common import sort_unique


def _ij(n):
    i = torch.arange(n).unsqueeze(1)
    return i, torch.arange(n).unsqueeze(0)


TWINS = {
    "full": (builders.full, lambda i, j: torch.ones_like(i - j, dtype=torch.bool)),
    "causal": (builders.causal, lambda i, j: j <= i),
    "window1": (lambda n: builders.window(n, 1), lambda i, j: (i - j).abs() <= 1),
    "window3": (lambda n: builders.window(n, 3), lambda i, j: (i - j).abs() <= 3),
    "window0": (lambda n: builders.window(n, 0), lambda i, j: i == j),
    "window3-causal": (lambda n: builders.window(n, 3, causal=True), lambda i, j: (i - j >= 0) & (i - j <= 3)),
}


def _assert_builder_output(ei):
    assert ei.dtype == torch.long and ei.dim() == 2 and ei.shape[0] == 2
    n_k = int(ei[0].max()) + 1 if ei.numel() else 1
    assert torch.equal(ei, sort_unique(ei, n_k)), "edges must be sorted by (target, source) without duplicates"


@pytest.mark.parametrize("n", [0, 1, 2, 5, 17])
@pytest.mark.parametrize("name", list(TWINS))
def test_builder_equals_twin(name, n):
    build, rule = TWINS[name]
    ei = build(n)
    _assert_builder_output(ei)
    assert torch.equal(builders.to_mask(ei, n), rule(*_ij(n)))


@pytest.mark.parametrize("name", list(TWINS))
def test_packed_is_block_diagonal(name):
    build, rule = TWINS[name]
    lengths = [3, 0, 1, 6, 3]
    ei = build(lengths)
    _assert_builder_output(ei)
    assert torch.equal(builders.to_mask(ei, sum(lengths)), torch.block_diag(*[rule(*_ij(n)).int() for n in lengths]).bool())
    assert torch.equal(build(torch.tensor(lengths)), ei)


def test_window_edge_count_formula():
    for n, w in [(10, 2), (100, 7), (64, 63)]:
        assert builders.window(n, w).shape[1] == n * (2 * w + 1) - w * (w + 1)
        assert builders.window(n, w, causal=True).shape[1] == n * (w + 1) - w * (w + 1) // 2
    assert builders.window(5, 10).shape[1] == 25  # w >= n: full
    assert builders.causal(9).shape[1] == 9 * 10 // 2


def test_device_argument():
    assert builders.causal(4, device="cpu").device.type == "cpu"
    assert builders.window([2, 3], 1, device=torch.device("cpu")).device.type == "cpu"


def test_mask_round_trip_and_batch():
    mask = torch.rand(6, 9) < 0.4
    assert torch.equal(builders.to_mask(builders.from_mask(mask), 6, 9), mask)
    batch = torch.rand(3, 4, 5) < 0.5
    ei = builders.from_mask(batch)
    assert torch.equal(builders.to_mask(ei, 12, 15), torch.block_diag(*batch.int()).bool())
    _assert_builder_output(ei)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: builders.window(5, -1), ValueError, r"w must be >= 0 \(got -1\)"),
        (lambda: builders.causal(-3), ValueError, r"n must be >= 0 \(got -3\)"),
        (lambda: builders.full([2, -1]), ValueError, r"each length must be >= 0 \(got -1\)"),
        (lambda: builders.full(2.5), TypeError, "n must be an int"),
        (lambda: builders.window(4, 1.5), TypeError, "w must be an int"),
        (lambda: builders.from_mask(torch.zeros(2, 2)), ValueError, "boolean"),
        (lambda: builders.to_mask(torch.tensor([[0], [5]]), 3), ValueError, r"does not fit a \[3, 3\] mask"),
    ],
)
def test_bad_arguments_are_named(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_draw():
    assert builders.draw(builders.causal(3)) == "x . .\nx x .\nx x x"
