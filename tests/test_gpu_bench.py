"""``python -m tgattn.bench.gpu --dry-run``: the GPU benchmark's code end to end on the CPU at a
tiny size, so that the run on a GPU machine does not fail on its first use."""
import csv

import pytest

from tgattn.bench.gpu.command import DRY_RUN_N, main
from tgattn.bench.peers import GPU_PEERS

pytest.importorskip("matplotlib")
pytest.importorskip("torch_geometric")


def test_dry_run_builds_every_gpu_peer_and_names_the_device(tmp_path, capsys):
    assert main(["--dry-run", "--no-gnn", "--no-progress", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "gpu_attention.csv") as f:
        rows = list(csv.DictReader(f))
    assert (tmp_path / "gpu_attention.png").stat().st_size > 0
    assert {r["device"] for r in rows} == {r["device"] for r in rows[:1]} and "dry run" in rows[0]["device"]
    assert {r["pattern"] for r in rows} == {"window64", "random0.01", "topk0.01", "packed_causal", "packed_full"}
    assert {r["n"] for r in rows} == {str(DRY_RUN_N)}
    seen = {r["peer"] for r in rows}
    assert set(GPU_PEERS) - {"flex", "flex_csr"} <= seen  # Flex compiles for minutes on a CPU: GPU runs only
    assert {"varlen_bf16", "tgattn_bf16"} <= seen
    ran = {r["peer"] for r in rows if r["ms"]}
    assert {"tgattn", "sdpa_mask", "transformerconv", "gatconv", "tgattn_bf16"} <= ran
    # what cannot run on a CPU says why, on every row
    assert all(r["note"] for r in rows if not r["ms"])
    assert all(r["note"].startswith("unavailable") for r in rows if r["peer"] == "varlen_bf16")
    # varlen applies to the packed sets and the window, not to the scattered ones
    assert {r["pattern"] for r in rows if r["peer"] == "varlen_bf16"} == {"window64", "packed_causal", "packed_full"}
    out = capsys.readouterr().out
    assert "dry run" in out and "window64 n=128 fwd+bwd: SDPA masked / tgattn >= 5" in out


def test_without_cuda_and_without_dry_run_a_clear_error(cli):
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks the message given without CUDA")
    status, err = cli(main, ["--no-progress"])
    assert status == 2 and "torch.cuda.is_available() is False" in err and "--dry-run" in err


def test_dry_run_in_bfloat16_for_the_chosen_pattern_only(tmp_path, capsys):
    assert main(["--dry-run", "--no-gnn", "--no-progress", "--dtype", "bfloat16", "--patterns", "window64",
                 "--out", str(tmp_path)]) == 0
    with open(tmp_path / "gpu_attention.csv") as f:
        rows = list(csv.DictReader(f))
    assert rows and {r["pattern"] for r in rows} == {"window64"}  # the varlen rows too
    assert {r["dtype"] for r in rows} == {"bfloat16"}
    # the peers ran in bfloat16 (none upcast behind the sweep's back), or say why not
    ran = {r["peer"] for r in rows if r["ms"]}
    assert {"tgattn", "sdpa_mask", "transformerconv", "gatconv", "tgattn_bf16"} <= ran
    assert all(r["note"] for r in rows if not r["ms"])
    out = capsys.readouterr().out
    assert "H=8, d=64, bfloat16" in out and "fp32" not in out


def test_float32_rows_say_float32_and_the_varlen_rows_bfloat16(tmp_path):
    assert main(["--dry-run", "--no-gnn", "--no-progress", "--patterns", "random0.01", "packed_full",
                 "--out", str(tmp_path)]) == 0
    with open(tmp_path / "gpu_attention.csv") as f:
        rows = list(csv.DictReader(f))
    assert {r["pattern"] for r in rows} == {"random0.01", "packed_full"}
    assert {r["dtype"] for r in rows if not r["peer"].endswith("_bf16")} == {"float32"}
    assert {r["dtype"] for r in rows if r["peer"].endswith("_bf16")} == {"bfloat16"}


@pytest.mark.parametrize("argv, named", [(["--patterns", "window64", "window128"], "window128"),
                                         (["--dtype", "float64"], "float64")])
def test_bad_pattern_or_dtype_is_an_argparse_error_naming_it(cli, tmp_path, argv, named):
    status, err = cli(main, ["--dry-run", "--no-progress", "--out", str(tmp_path), *argv])
    assert status == 2 and "invalid choice" in err and repr(named) in err
