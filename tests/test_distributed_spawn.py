"""tgattn.distributed on real process groups: 2 and 4 gloo ranks on 127.0.0.1, equal to one process.

One spawn of 4 ranks runs every case on all 4 and on a subgroup of 2 (tests/distributed_cases.py);
the tests below read its results. Float64, outputs and all gradients within 1e-10 of
single-process ``graph_attention`` (and of the single-process layers, GPT step and GNN step).
"""
import pytest

from tgattn.distributed import spawn

from conftest import DATA
from distributed_cases import run_job

TOL = 1e-10
CASES = ["window", "bigbird", "random", "causal", "empty_rank", "cora", "layer", "conv", "gpt", "gnn"]


@pytest.fixture(scope="module")
def job():
    """Every rank's results (4 processes, spawned once, 300 s at most)."""
    if not DATA.is_dir():
        pytest.skip(f"shared data folder not found at {DATA} (set TGATTN_DATA)")
    return spawn(run_job, 4, str(DATA), timeout_s=300)


@pytest.fixture(params=[2, 4], ids=lambda w: f"world{w}")
def ranks(job, request):
    """The results of the ranks of one world size."""
    return [r[request.param] for r in job if request.param in r]


@pytest.mark.parametrize("case", CASES)
def test_equal_to_one_process(ranks, case):
    errors = [r[case]["err"] for r in ranks]
    assert max(errors) < TOL, f"{case}: largest difference per rank {errors}"


@pytest.mark.parametrize("case", ["window", "bigbird", "random", "causal", "empty_rank", "cora"])
def test_halo_is_the_minimum(ranks, case):
    """Each rank receives exactly the distinct remote rows its edges read, once per exchange,
    and in backward the gradients of exactly the rows it sent."""
    for rank, r in enumerate(ranks):
        assert r[case]["halo"] == r[case]["minimum"], (rank, r[case])
        assert r[case]["calls"] == 2, (rank, r[case])  # one forward, one backward exchange
        assert r[case]["received"] == r[case]["halo"] + r[case]["sent"], (rank, r[case])
    assert sum(r[case]["sent"] for r in ranks) == sum(r[case]["halo"] for r in ranks)


def test_cora_uses_a_graph_partitioner(ranks):
    assert ranks[0]["cora"]["method"] in ("metis", "louvain")
