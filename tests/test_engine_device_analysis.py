"""The device analysis of a new edge set equals the host analysis, and reads back once.

The oracle is :func:`tgattn.engine.analysis.analyse` (the host analysis, itself tested against the
builders' arithmetic twins); the device analysis runs here on CPU tensors, which it treats as a
GPU's (it never asks where they are). The two share no code: on the CPU the host analysis sorts
in the fused extension (rows sorted one by one, or a second counting sort past 32 edges a row),
which also finds the rows' spans; the device analysis sorts with ``torch.sort``.
"""
import pytest
import torch

from tgattn import builders
from tgattn.engine.analysis import analyse, row_spans
from tgattn.engine.device_analysis import analyse_on_device


def _shuffled(ei, seed=0):
    return ei[:, torch.randperm(ei.shape[1], generator=torch.Generator().manual_seed(seed))]


def _random(n_q, n_k, p, seed):
    mask = torch.rand(n_q, n_k, generator=torch.Generator().manual_seed(seed)) < p
    return builders.from_mask(mask)


CASES = {
    "window": (builders.window(12, 2), 12, 12),
    "window_shuffled": (_shuffled(builders.window(12, 2)), 12, 12),
    "causal": (builders.causal(9), 9, 9),
    "full": (_shuffled(builders.full(5), 1), 5, 5),
    "packed_full": (builders.full([3, 1, 4]), 8, 8),
    "packed_causal": (_shuffled(builders.causal([2, 5, 1]), 2), 8, 8),
    "packed_unequal_window": (builders.window([4, 6], 1), 10, 10),  # intervals, not packed
    "causal_with_a_gap": (builders.causal(6)[:, 1:], 6, 6),  # row 0 empty
    "random": (_random(10, 7, 0.4, 1), 10, 7),
    "random_shuffled": (_shuffled(_random(10, 10, 0.3, 2), 3), 10, 10),
    "duplicates": (_shuffled(torch.cat([builders.window(8, 1), builders.window(8, 1)[:, :3]], 1), 4), 8, 8),
    # more than 32 edges a row: the extension's second counting sort instead of sorting rows
    "dense_rows_shuffled": (_shuffled(torch.cat([_random(50, 60, 0.9, 5), _random(50, 60, 0.9, 5)[:, :40]], 1), 6),
                            50, 60),
    "full_dense_shuffled": (_shuffled(builders.full(40), 7), 40, 40),
    "few_edges_many_nodes": (torch.tensor([[90, 3, 50], [7, 7, 0]]), 100, 120),
    "one_edge": (torch.tensor([[2], [0]]), 1, 3),
    "one_edge_twice": (torch.tensor([[1, 1], [2, 2]]), 3, 3),
    "repeats_in_order": (torch.tensor([[0, 1, 1, 2], [0, 0, 0, 1]]), 2, 3),  # sorted as given, with a repeat
    # a row's last key n_k - 1 and the next row's first key 0: their keys i * n_k + j step by 1 across rows
    "rows_meeting_end_to_start": (torch.tensor([[1, 2, 0, 1], [0, 0, 1, 1]]), 2, 3),
    "a_row_with_a_gap": (torch.tensor([[0, 1, 3, 0], [0, 0, 0, 1]]), 2, 4),
    "isolated_nodes_shuffled": (_shuffled(torch.tensor([[3, 5, 5, 9], [8, 1, 8, 1]]), 8), 12, 10),
    "empty": (torch.zeros(2, 0, dtype=torch.long), 4, 4),
}


@pytest.mark.parametrize("name", list(CASES))
def test_device_analysis_equals_the_host_analysis(name):
    ei, n_q, n_k = CASES[name]
    host, device = analyse(ei, n_q, n_k), analyse_on_device(ei, n_q, n_k)
    for field in ("n_q", "n_k", "num_edges", "duplicates", "kind", "lengths", "intervals"):
        assert getattr(device, field) == getattr(host, field), field
    assert (device.perm is None) == (host.perm is None)
    if host.perm is not None:
        assert torch.equal(device.perm, host.perm)
    for field in ("src", "dst", "rowptr"):
        assert torch.equal(getattr(device, field).long(), getattr(host, field).long()), field
    assert device.rowptr.dtype == host.rowptr.dtype
    if ei.shape[1]:
        assert device.extras["row_spans"] == row_spans(host)


@pytest.mark.parametrize("bad, message", [
    (torch.tensor([[0], [0]]), "query/target node 0, but there are 0 query nodes"),
    (torch.tensor([[0, -1], [1, 1]]), "negative node id -1"),
    (torch.tensor([[0, 4], [1, 1]]), "key/source node 4, but there are 4 key nodes"),
    (torch.tensor([[0, 1], [3, 1]]), "query/target node 3, but there are 3 query nodes"),
])
def test_device_analysis_names_a_node_out_of_range(bad, message):
    with pytest.raises(ValueError, match=message):
        analyse_on_device(bad, 0 if "0 query" in message else 3, 4)


def test_device_analysis_reads_back_once_and_twice_where_a_set_may_be_packed(monkeypatch):
    reads = []
    for name in ("tolist", "numpy"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda t, *a, _o=original, _n=name: reads.append(_n) or _o(t, *a))
    monkeypatch.setattr(torch.Tensor, "item", lambda t: pytest.fail("a read of its own"))
    monkeypatch.setattr(torch.Tensor, "__bool__", lambda t: pytest.fail("a read of its own"))
    for ei, n in ((_random(10, 10, 0.3, 2), 10), (builders.causal(9), 9), (builders.causal(6)[:, 1:], 6)):
        reads.clear()
        analyse_on_device(ei, n, n)
        assert reads == ["tolist"]
    # keys one range in every row, every row with edges: the packed kinds' test reads once more
    for ei, n, lengths in ((builders.full([3, 1, 4]), 8, (3, 1, 4)), (_shuffled(builders.window(12, 2)), 12, None)):
        reads.clear()
        assert analyse_on_device(ei, n, n).lengths == lengths
        assert reads == ["tolist", "numpy"]


def test_device_analysis_counts_the_loops_among_the_first_edges():
    ei = torch.tensor([[0, 2, 1, 3], [0, 1, 1, 2]])  # (0, 0) and (1, 1) are loops
    looped = torch.cat([ei, torch.arange(4).expand(2, -1)], 1)
    assert analyse_on_device(looped, 4, 4, loops_among=4).extras["loops_among"] == 2
    assert analyse_on_device(looped[:, 2:], 4, 4, loops_among=2).extras["loops_among"] == 1
    assert analyse_on_device(looped[:, 1:], 4, 4, loops_among=1).extras["loops_among"] == 0
    assert "loops_among" not in analyse_on_device(looped, 4, 4).extras


@pytest.mark.parametrize("ei", [torch.tensor([[1, 0, 2], [0, 2, 1]]), torch.tensor([[1, 0, 2, 2], [0, 0, 2, 1]])],
                         ids=["without_loops", "with_loops"])
def test_self_looped_sets_on_a_device_equal_the_hosts(monkeypatch, ei):
    """Looped on a device (the input's own loops counted in the analysis's read, removed where found), the
    set equals the host's (the extension's removal), its given order included."""
    from tgattn.engine import analysis, edgeset

    host = edgeset.self_looped(ei.clone(), 3)
    monkeypatch.setattr(analysis, "HOST_DEVICES", frozenset())
    device = edgeset.self_looped(ei.clone(), 3)
    assert torch.equal(device.edge_index, host.edge_index)
    for field in ("kind", "duplicates", "intervals"):
        assert getattr(device.structure, field) == getattr(host.structure, field)
    for field in ("src", "dst", "rowptr"):
        assert torch.equal(getattr(device.structure, field), getattr(host.structure, field))
