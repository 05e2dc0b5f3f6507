"""tgattn.bench.distributed without processes: the local window edges and the summary table."""
import pytest
import torch

from tgattn import builders
from tgattn.bench.distributed import causal_window_edges, pattern_edges, summary
from tgattn.distributed import contiguous, halo_rows


@pytest.mark.parametrize("lo,hi", [(0, 7), (3, 40), (40, 100), (99, 100)])
def test_local_window_edges_are_the_ranks_edges(lo, hi):
    full = builders.window(100, 5, causal=True)
    assert torch.equal(causal_window_edges(lo, hi, 5), full[:, (full[1] >= lo) & (full[1] < hi)])


def test_benchmark_window_halo_is_w_rows():
    assert halo_rows(pattern_edges("window64", 512), contiguous(512, 4)) == [0, 64, 64, 64]
    with pytest.raises(ValueError, match="'dense'"):
        pattern_edges("dense", 8)


def test_summary_takes_the_slowest_rank_and_sums_the_rest():
    base = dict(case="w", n=8, heads=1, dim=1, world=2, queries=4, local_edges=4, ring_rows=4, peak_mb=1.0)
    rows = [dict(base, rank=0, halo_rows=0, min_rows=0, bytes_per_step=2**20, total_ms=10.0, exchange_ms=4.0,
                 compute_ms=6.0),
            dict(base, rank=1, halo_rows=3, min_rows=3, bytes_per_step=2**20, total_ms=12.0, exchange_ms=1.0,
                 compute_ms=11.0, peak_mb=2.0)]
    line = summary(rows).splitlines()[-1].split()
    assert line == ["w", "2", "12.0", "1.0", "11.0", "3", "3", "8", "2.00", "2.0"]
