"""The GPU benchmark's parts that run without a GPU: the device check, sizes, molecule batches,
the GNN step timer (on CPU) and the target lines computed from fixed times."""
import pytest
import torch

from tgattn.bench.__main__ import main
from tgattn.bench.attention import sizes_for
from tgattn.bench.gpu.command import gnn_steps, gpu_targets
from tgattn.bench.models import molecule_batches


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without CUDA")
def test_device_cuda_without_cuda_is_a_clear_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--device", "cuda", "--no-progress"])
    assert exit_info.value.code == 2
    assert "torch.cuda.is_available() is False" in capsys.readouterr().err


def test_gpu_sizes_are_the_targets():
    sizes = sizes_for(["window64", "random0.01", "topk0.01"], quick=False, device="cuda")
    assert sizes["window64"] == [16384, 32768, 65536, 131072, 1 << 20]
    assert sizes["random0.01"] == sizes["topk0.01"] == [16384]


def test_molecule_batches_are_symmetric_graphs_of_molecule_size():
    (x, ei, y), (_, ei2, _) = molecule_batches(2, graphs=10, sizes=(18, 30), features=8)
    n = x.shape[0]
    assert 180 <= n <= 300 and y.shape == (n,) and x.shape == (n, 8)
    pairs = set(map(tuple, ei.T.tolist()))
    assert all((j, i) in pairs for i, j in pairs)  # both directions
    assert ei.max() < n and not torch.equal(ei, ei2[:, : ei.shape[1]])  # a new edge set per batch
    # no edge joins two graphs: node ids of one graph are a contiguous range, rings close on themselves
    assert int((ei[0] - ei[1]).abs().max()) < 30


@pytest.mark.slow
def test_gnn_steps_run_and_time_every_model():  # a few seconds: the first PyG and tgattn steps
    rows = gnn_steps("cpu", repeats=1, workloads=("molecules",), graphs=4)
    assert [(r["workload"], r["model"]) for r in rows] == [("molecules", m) for m in ("gat", "transformer", "tgattn")]
    assert all(r["ms"] > 0 and r["edges"] > r["nodes"] for r in rows)


def test_gpu_targets_from_fixed_times():
    def row(pattern, n, mode, peer, ms):
        return dict(pattern=pattern, n=n, mode=mode, peer=peer, ms=ms, peak_mb=None, edges=1)

    rows = [row("window64", 16384, "fwd+bwd", "tgattn", 2.0), row("window64", 16384, "fwd+bwd", "sdpa_mask", 12.0),
            row("window64", 16384, "fwd+bwd", "flex", 1.0), row("random0.01", 16384, "fwd", "tgattn", 1.0),
            row("random0.01", 16384, "fwd", "sdpa_mask", 30.0), row("random0.01", 16384, "fwd", "flex_csr", 1.5)]
    gnn = [dict(workload="cora", model="gat", ms=4.0), dict(workload="cora", model="tgattn", ms=3.0)]
    lines = {line[:62].strip(): line[62:].split(maxsplit=1) for line in gpu_targets(rows, gnn).splitlines()}
    assert lines["window64 n=16384 fwd+bwd: SDPA masked / tgattn >= 5"] == ["6.00x", "met"]
    assert lines["window64 n=16384 fwd+bwd: Flex / tgattn >= 1"] == ["0.50x", "NOT met"]
    assert lines["random0.01 n=16384 fwd: SDPA masked / tgattn >= 10"] == ["30.00x", "met"]
    assert lines["random0.01 n=16384 fwd: Flex / tgattn >= 2"] == ["1.50x", "NOT met"]
    assert lines["random0.01 n=16384 fwd+bwd: SDPA masked / tgattn >= 10"] == ["n/a"]
    assert lines["GNN cora train step: tgattn / GATConv <= 1"] == ["0.75x", "met"]


def test_memory_estimate_scales_with_the_element_size():
    from tgattn.bench.attention import _bytes_needed

    for peer in ("tgattn", "gather", "transformerconv", "gatconv", "sdpa_mask", "flex_csr"):
        for cuda in (False, True):
            fp32, bf16 = (_bytes_needed(peer, 16384, 2_000_000, 8, 64, True, cuda, itemsize=b) for b in (4, 2))
            assert fp32 == _bytes_needed(peer, 16384, 2_000_000, 8, 64, True, cuda)  # float32 the default
            assert 0.5 * fp32 <= bf16 < fp32, (peer, cuda)


def test_memory_estimate_skips_what_ran_out_of_memory_on_an_h100():
    """On an H100 (80 GB, 75 % of it allowed) at n = 131,072, window 64, bfloat16: SDPA's boolean
    mask ran the forward and ran out of memory in the backward (32 GiB more), and Flex's
    create_block_mask asked for 128 GiB (data/gpu/h100_bf16.csv); at 65,536 both ran."""
    from tgattn.bench.attention import _bytes_needed

    limit = 0.75 * 80e9
    for n, fits in ((65536, True), (131072, False)):
        edges = 129 * n
        assert (_bytes_needed("flex", n, edges, 8, 64, False, True, itemsize=2) <= limit) == fits
        assert (_bytes_needed("sdpa_mask", n, edges, 8, 64, True, True, itemsize=2) <= limit) == fits
    assert _bytes_needed("sdpa_mask", 131072, 129 * 131072, 8, 64, False, True, itemsize=2) <= limit
