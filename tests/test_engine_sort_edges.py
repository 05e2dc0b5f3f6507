"""The extension's sort of a new edge set (``sort_edges``) against an oracle of PyTorch ops: the
order, the row pointer and the row statistics, on each of its paths (edges that come sorted, few
edges a row, many edges a row) with repeated edges, empty rows and rows longer than 16 edges."""
import os

import pytest
import torch

from tgattn.engine import fused

pytestmark = pytest.mark.skipif(
    not fused.available() and not os.environ.get("CI"), reason="no C++ toolchain here (CI requires one)"
)


def _oracle(src, dst, n_q, n_k):
    """(perm, src, dst, duplicates, rowptr, stats) by a stable argsort and per-row arithmetic."""
    perm = torch.argsort(dst * n_k + src, stable=True)
    s, t = src[perm], dst[perm]
    rowptr = torch.zeros(n_q + 1, dtype=torch.long)
    rowptr[1:] = torch.bincount(t, minlength=n_q).cumsum(0)
    same_row = t[1:] == t[:-1]
    dup = bool((same_row & (s[1:] == s[:-1])).any())
    if len(s) == 0:
        return perm, s, t, dup, rowptr, [0] * 7
    deg = rowptr.diff()
    full = deg > 0
    first, last = s[rowptr[:-1][full]], s[rowptr[1:][full] - 1]
    rows = int(full.sum())
    stats = [int((s - t).min()), int((s - t).max()), int(deg.max()), rows, len(s) - rows,
             int((last - first).sum()), int(dup)]
    return perm, s, t, dup, rowptr, stats


def _edges(n_q, n_k, E, seed, *, in_order=False):
    g = torch.Generator().manual_seed(seed)
    src, dst = torch.randint(0, n_k, (E,), generator=g), torch.randint(0, n_q, (E,), generator=g)
    if in_order:
        perm = torch.argsort(dst * n_k + src, stable=True)
        src, dst = src[perm], dst[perm]
    return src, dst


CASES = {
    "few_per_row": (40, 50, 120),  # ~3 a row: one counting sort, rows by insertion
    "long_rows": (6, 300, 150),  # ~25 a row: rows past 16 edges sorted by merging
    "many_per_row": (5, 30, 400),  # past 32 a row: two counting sorts
    "one_edge": (3, 3, 1),
    "no_edges": (4, 4, 0),
}


@pytest.mark.parametrize("in_order", [False, True], ids=["unsorted", "sorted"])
@pytest.mark.parametrize("case", CASES)
def test_sort_edges_matches_a_stable_argsort(case, in_order):
    n_q, n_k, E = CASES[case]
    for seed in range(3):
        src, dst = _edges(n_q, n_k, E, seed, in_order=in_order)
        if seed == 2 and E > 1:  # repeated edges, an empty row
            src, dst = torch.cat([src, src[:4]]), torch.cat([dst, dst[:4]])
            keep = dst != dst[0]
            src, dst = src[keep], dst[keep]
        perm, s, t, dup, rowptr, stats = torch.ops.tgattn_fused.sort_edges(src, dst, n_q, n_k)
        o_perm, o_s, o_t, o_dup, o_rowptr, o_stats = _oracle(src, dst, n_q, n_k)
        came_sorted = bool(torch.equal(o_perm, torch.arange(len(src))))
        assert (perm.numel() == 0) == came_sorted
        if not came_sorted:
            assert torch.equal(perm, o_perm)
        assert torch.equal(s, o_s) and torch.equal(t, o_t)
        assert bool(dup) == o_dup
        assert torch.equal(rowptr.long(), o_rowptr)
        assert stats.tolist() == o_stats


def test_sort_edges_copies_edges_that_come_sorted():
    src, dst = _edges(10, 10, 30, 0, in_order=True)
    _, s, t, *_ = torch.ops.tgattn_fused.sort_edges(src, dst, 10, 10)
    held = s.clone(), t.clone()
    src.add_(1), dst.add_(1)  # the caller's edges change after the analysis, which keeps its own
    assert torch.equal(s, held[0]) and torch.equal(t, held[1])


@pytest.mark.parametrize("in_order", [False, True], ids=["unsorted", "sorted"])
def test_sort_edges_refuses_a_node_out_of_range(in_order):
    src, dst = _edges(8, 8, 40, 1, in_order=in_order)
    for bad in (0, 20, 39):  # the first edge, one inside, the last
        s, t = src.clone(), dst.clone()
        t[bad] = 8
        with pytest.raises(RuntimeError, match="an index outside"):
            torch.ops.tgattn_fused.sort_edges(s, t, 8, 8)
        s[bad], t[bad] = -1, dst[bad]
        with pytest.raises(RuntimeError, match="an index outside"):
            torch.ops.tgattn_fused.sort_edges(s, t, 8, 8)
