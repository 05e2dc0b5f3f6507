"""density, degree and receptive_field against masks, matrix powers and networkx path lengths."""
import networkx as nx
import pytest
import torch

from builder_checks import ij
from tgattn import builders


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


PATTERNS = {
    "window": lambda n: builders.window(n, 2),
    "causal window": lambda n: builders.window(n, 3, causal=True),
    "strided": lambda n: builders.strided(n, 4, causal=True),
    "bigbird": lambda n: builders.bigbird(n, 1, 1, 2, generator=gen()),
    "random": lambda n: builders.random(n, 2, generator=gen(1)),
    "dilated": lambda n: builders.dilated(n, 1, 3),
}


@pytest.mark.parametrize("name", list(PATTERNS))
@pytest.mark.parametrize("n", [0, 1, 17])
def test_density_and_degree(name, n):
    e = PATTERNS[name](n)
    mask = builders.to_mask(e, n, n)
    assert builders.density(e, n) == (mask.double().mean().item() if n else 0.0)
    d = builders.degree(torch.cat([e, e], dim=1), n)  # duplicates count once
    assert torch.equal(d.keys_per_query, mask.sum(1)) and torch.equal(d.queries_per_key, mask.sum(0))
    s = d.summary()["keys_per_query"]
    if n:
        assert s["min"] == mask.sum(1).min() and s["max"] == mask.sum(1).max()
        assert s["mean"] == pytest.approx(mask.sum(1).double().mean().item(), abs=1e-12)


def test_density_cross_and_packed():
    assert builders.density(builders.cross(3, 5), 3, 5) == 1.0
    assert builders.density(builders.full([2, 2]), [2, 2]) == 0.5


@pytest.mark.parametrize("name", list(PATTERNS))
@pytest.mark.parametrize("layers", [0, 1, 2, 3, 5])
def test_receptive_field_is_matrix_power(name, layers):
    n = 23
    e = PATTERNS[name](n)
    step = builders.to_mask(e, n, n).double() + torch.eye(n, dtype=torch.float64)  # I + A
    expected = torch.linalg.matrix_power(step, layers) > 0
    assert torch.equal(builders.receptive_field(e, n, layers), expected)


@pytest.mark.parametrize("name", list(PATTERNS))
def test_receptive_field_is_networkx_path_length(name):
    n, layers = 19, 2
    e = PATTERNS[name](n)
    G = nx.DiGraph()
    G.add_nodes_from(range(n))
    G.add_edges_from(e.T.tolist())  # key j -> query i
    reach = builders.receptive_field(e, n, layers)
    for j, lengths in nx.all_pairs_shortest_path_length(G, cutoff=layers):
        column = torch.zeros(n, dtype=torch.bool)
        column[list(lengths)] = True
        assert torch.equal(reach[:, j], column)


def test_growth_numbers():
    n = 64
    window = builders.receptive_field_growth(builders.window(n, 4), n, 20)
    i, j = ij(n)
    for layer in range(21):  # L layers of radius w reach |i - j| <= L w
        assert window[layer] == int(((i - j).abs() <= 4 * layer).sum())
    assert int((window < n * n).sum()) == 16  # full after ceil((n - 1) / w) = 16 layers
    bigbird = builders.receptive_field_growth(builders.bigbird(n, 1, 1, 1, generator=gen()), n, 4)
    assert bigbird[2] == n * n  # j -> global token 0 -> i
    strided = builders.receptive_field_growth(builders.strided(n, 8, causal=True), n, 4)
    assert strided[2] == n * (n + 1) // 2 and strided[1] < strided[2]


def test_errors():
    with pytest.raises(ValueError, match="refers to node 9, but n = 4"):
        builders.receptive_field(torch.tensor([[9], [0]]), 4, 1)
    with pytest.raises(ValueError, match=r"layers must be >= 0 \(got -1\)"):
        builders.receptive_field(builders.full(3), 3, -1)
