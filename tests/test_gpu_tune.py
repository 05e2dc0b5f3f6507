"""The tile kernels' tuning sweep (``python -m tgattn.bench.gpu --tune``) and the table ``tc`` reads."""
import csv
import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO
from tgattn.bench.gpu.tune import candidates
from tgattn.engine.triton import tile_config
from tgattn.engine.triton.tile_config import TABLE_FIELDS, default_config, read_table


def _write(path, rows):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=TABLE_FIELDS)
        writer.writeheader()
        writer.writerows(rows)


def _rows(card, **options):
    return [dict(card=card, dtype="bfloat16", head_dim=64, block_m=64, block_n=64, kernel=k, num_warps=w,
                 num_stages=s) for k, (w, s) in options.items()]


def test_tc_takes_its_card_s_row_of_the_table_and_the_defaults_elsewhere(tmp_path, monkeypatch):
    path = tmp_path / "tile_configs.csv"
    _write(path, _rows("NVIDIA H200", forward=(4, 4), dq=(8, 3), dkdv=(4, 5)))
    monkeypatch.setitem(tile_config.TABLE_IN_FORCE, "path", str(path))
    tuned = tile_config.tile_config(torch.bfloat16, 64, 64, 64, arch=90, card="NVIDIA H200")
    assert (tuned.forward, tuned.dq, tuned.dkdv) == ((4, 4), (8, 3), (4, 5))
    assert tuned.dkdv_split == default_config(90, 64).dkdv_split  # the target's, not tuned
    assert tile_config.tile_config(torch.bfloat16, 48, 64, 64, arch=90, card="NVIDIA H200") == tuned  # pads to 64
    assert tile_config.tile_config(torch.float16, 64, 64, 64, arch=90, card="NVIDIA H200") == default_config(90, 64)
    assert tile_config.tile_config(torch.bfloat16, 64, 64, 64, arch=80, card="NVIDIA A100") == default_config(80, 64)


def test_a_table_row_outside_the_compiled_options_is_refused(tmp_path):
    path = tmp_path / "bad.csv"
    _write(path, _rows("NVIDIA H200", forward=(16, 3), dq=(4, 3), dkdv=(4, 3)))
    with pytest.raises(ValueError, match="16 warps"):
        read_table(str(path))
    _write(path, _rows("NVIDIA H200", forward=(4, 3)))
    with pytest.raises(ValueError, match="not all of"):
        read_table(str(path))


def test_candidates_start_at_the_default_and_hold_only_table_options():
    for default in ((4, 3), (8, 3), (4, 2), (8, 1)):
        tried = candidates(default)
        assert tried[0] == default and len(set(tried)) == len(tried)
        assert all(w in tile_config.WARPS and s in tile_config.STAGES for w, s in tried[1:])


@pytest.mark.slow  # ~1 minute: twelve tile launches under Triton's interpreter
def test_the_dry_run_writes_a_sweep_and_a_table_the_loader_reads(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-m", "tgattn.bench.gpu", "--tune", "--dry-run", "--out", str(tmp_path)],
                          env=env, capture_output=True, text=True, cwd=REPO, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(tmp_path / "tile_sweep.csv") as f:
        sweep = list(csv.DictReader(f))
    assert len(sweep) == 2 * 2 * 3 and all(float(r["ms"]) > 0 for r in sweep)
    table = read_table(str(tmp_path / "tile_configs.csv"))
    assert set(table) == {"cpu (dry run)"} and len(table["cpu (dry run)"]) == 4  # 2 dtypes x 2 head dims
