"""The tile kernels' tuning sweep (``python -m tgattn.bench.gpu --tune``) and the table ``tc`` reads."""
import csv
import itertools
import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO
from tgattn.bench.gpu.tune import CANDIDATES, candidate_rows, clean_candidates
from tgattn.engine.triton.aot import triton_version
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


def test_use_table_reads_a_rewritten_table_anew(tmp_path, monkeypatch):
    """A sweep that rewrites its table in one process puts the new rows in force, not the cached ones."""
    path = tmp_path / "tile_configs.csv"
    monkeypatch.setitem(tile_config.TABLE_IN_FORCE, "path", str(path))
    _write(path, _rows("NVIDIA H200", forward=(4, 4), dq=(8, 3), dkdv=(4, 5)))
    tile_config.use_table(str(path))
    assert tile_config.tile_config(torch.bfloat16, 64, 64, 64, arch=90, card="NVIDIA H200").forward == (4, 4)
    _write(path, _rows("NVIDIA H200", forward=(8, 2), dq=(8, 3), dkdv=(4, 5)))
    tile_config.use_table(str(path))
    assert tile_config.tile_config(torch.bfloat16, 64, 64, 64, arch=90, card="NVIDIA H200").forward == (8, 2)


def test_a_table_row_outside_the_compiled_options_is_refused(tmp_path):
    path = tmp_path / "bad.csv"
    _write(path, _rows("NVIDIA H200", forward=(16, 3), dq=(4, 3), dkdv=(4, 3)))
    with pytest.raises(ValueError, match="16 warps"):
        read_table(str(path))
    _write(path, _rows("NVIDIA H200", forward=(4, 3)))
    with pytest.raises(ValueError, match="not all of"):
        read_table(str(path))


def _candidate_rows(path, rows):
    from tgattn.bench.gpu_compiled import CANDIDATE_FIELDS

    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CANDIDATE_FIELDS)
        writer.writeheader()
        writer.writerows(rows)


def test_the_sweep_tries_the_candidates_that_compile_clean_for_the_card_s_target(tmp_path):
    first, second, third = tile_config.candidates()[:3]
    def row(c, target, **res):
        return dict(triton="3.7.1", target=target, **vars(c), **{**dict(registers=200, spill_stores=0, spill_loads=0, stack=0,
                                                        shared=1000, smem_limit=2000, compile_s=1.0), **res})
    path = tmp_path / "tune_candidates.csv"
    _candidate_rows(path, [row(first, "sm_90"), row(second, "sm_90", spill_stores=8), row(third, "sm_90", shared=2001),
                           row(second, "sm_80"), row(third, "sm_80", shared=2000)])
    assert clean_candidates(90, path) == [first]  # no spills, within the shared memory a block may take
    assert clean_candidates(100, path) == [first]  # sm_90's code from 90 up
    assert clean_candidates(80, path) == [second, third]


def test_the_sweep_reads_the_rows_of_its_own_triton_release_else_the_newest(tmp_path):
    first, second = tile_config.candidates()[:2]
    def row(c, version, **res):
        return dict(triton=version, target="sm_90", **vars(c), **{**dict(registers=200, spill_stores=0, spill_loads=0,
                    stack=0, shared=1000, smem_limit=2000, compile_s=1.0), **res})
    path = tmp_path / "tune_candidates.csv"
    _candidate_rows(path, [row(first, "3.7.1"), row(second, "3.7.1", spill_stores=8),
                           row(first, "3.10.0", spill_stores=4), row(second, "3.10.0"),
                           row(first, "3.9.0"), row(second, "3.9.0")])
    assert clean_candidates(90, path, version="3.7.1") == [first]
    assert clean_candidates(90, path, version="3.9.0") == [first, second]
    assert candidate_rows(path, version="3.8.0")[0] == "3.10.0"  # not in the table: its newest (by release)
    assert clean_candidates(90, path, version="3.8.0") == [second]


def _releases():
    with open(CANDIDATES) as f:
        return sorted({r["triton"] for r in csv.DictReader(f)})


@pytest.mark.parametrize("version", _releases())
def test_every_candidate_has_a_committed_row_for_both_targets_and_the_sweep_drops_exactly_the_bad_ones(version):
    """Per Triton release in the table (``python -m tgattn.bench.gpu_compiled --tune-candidates`` under each)."""
    rows = candidate_rows(version=version)[1]
    key = lambda r: (r["kernel"], r["dtype"], int(r["head_dim"]), int(r["block_m"]), int(r["block_n"]),  # noqa: E731
                     int(r["num_warps"]), int(r["num_stages"]))
    every = [(c.kernel, c.dtype, c.head_dim, c.block_m, c.block_n, c.num_warps, c.num_stages)
             for c in tile_config.candidates()]
    for target, arch in (("sm_80", 80), ("sm_90", 90)):
        mine = [key(r) for r in rows if r["target"] == target]
        assert sorted(mine) == sorted(every)  # each candidate once
        bad = {key(r) for r in rows if r["target"] == target and (int(r["spill_stores"]) or int(r["spill_loads"])
                                                                 or int(r["shared"]) > int(r["smem_limit"]))}
        clean = {(c.kernel, c.dtype, c.head_dim, c.block_m, c.block_n, c.num_warps, c.num_stages)
                 for c in clean_candidates(arch, version=version)}
        assert clean == set(every) - bad and bad and clean
        # the sweep always has a shape to pick: the backend's defaults (64 x 64) are among the clean ones
        for dtype, d in itertools.product(tile_config.TUNED_DTYPES, tile_config.TUNED_DIMS):
            defaults = default_config(arch, d)
            assert {(k, dtype, d, 64, 64, *getattr(defaults, k)) for k in tile_config.KERNELS} <= clean


@pytest.mark.slow  # ~30 s: 24 timed tile launches (and 8 delta launches) under Triton's interpreter
def test_the_dry_run_writes_a_sweep_and_a_table_of_the_fastest_shape_the_loader_reads(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-m", "tgattn.bench.gpu", "--tune", "--dry-run", "--out", str(tmp_path)],
                          env=env, capture_output=True, text=True, cwd=REPO, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(tmp_path / "tile_sweep.csv") as f:
        sweep = list(csv.DictReader(f))
    # each dtype, head dim and shape whose three kernels have a clean option on sm_90: the first of each
    clean = {(c.dtype, c.head_dim, (c.block_m, c.block_n), c.kernel) for c in clean_candidates(90)}
    runs = {(dtype, d, shape) for dtype, d, shape, _ in clean
            if all((dtype, d, shape, k) in clean for k in tile_config.KERNELS)}
    timed = [r for r in sweep if r["ms"]]
    assert sorted((r["dtype"], int(r["head_dim"]), (int(r["block_m"]), int(r["block_n"])), r["kernel"]) for r in timed) \
        == sorted((*run, k) for run in runs for k in tile_config.KERNELS)
    assert all(float(r["ms"]) > 0 for r in timed) and len(runs) < 2 * 2 * len(tile_config.SHAPES)
    # a shape left out says which kernel has no clean option
    for r in sweep:
        if not r["ms"]:
            assert r["note"] == "no candidate compiles for sm_90 without spills within its shared memory", r
            assert (r["dtype"], int(r["head_dim"]), (int(r["block_m"]), int(r["block_n"])), r["kernel"]) not in clean
    table = read_table(str(tmp_path / "tile_configs.csv"))
    assert set(table) == {"cpu (dry run)"} and len(table["cpu (dry run)"]) == 4  # 2 dtypes x 2 head dims
    for dtype, d, rows, keys in table["cpu (dry run)"]:  # the shape of least forward + dq + dk-dv time
        totals = {}
        for r in timed:
            if (r["dtype"], int(r["head_dim"])) == (dtype, d):
                shape = (int(r["block_m"]), int(r["block_n"]))
                totals[shape] = totals.get(shape, 0.0) + float(r["ms"])
        assert (rows, keys) == min(totals, key=totals.get)


_PRECOMPILE_PROBE = """
import sys, torch
from tgattn.bench.gpu import tune
from tgattn.engine.triton import aot, tile_config
sm90 = [t for t in aot.TARGETS if t.name == "sm_90"][0]
from tgattn import builders, engine
s = engine.analyse(builders.window(96, 4), 96, 96)
made = {device: tune._launches(torch.bfloat16, 64, (128, 64), [torch.zeros(96, 8, 64, dtype=torch.bfloat16, device=device)
                                                                for _ in range(4)], s) for device in ("cpu", "meta")}
def bound(launch, proxy):
    launch = launch._replace(args=tuple(tune._proxy(a) for a in launch.args)) if proxy else launch
    options, *rest = aot.bind(launch, sm90)
    return vars(options), rest
# what precompile binds (data-less stand-ins of launches on meta inputs) is what the timed launch binds
print(all(bound(made["meta"][k], True) == bound(made["cpu"][k], False) for k in tile_config.KERNELS))
launch = aot.candidate_launch(tile_config.Candidate("forward", "bfloat16", 64, 128, 64, 8, 3), sm90)
spills = tune.precompile([(launch, {}), (aot.candidate_launch(tile_config.Candidate("dq", "float16", 128, 128, 128, 8, 3), sm90), {})], 90, workers=2)
print(*[s for s, _ in spills])
# the sweep's own pre-compile: its first option per kernel at 64 x 64 tiles
first = [next(c for c in tune.clean_candidates(90) if (c.kernel, c.block_m) == (k, 64)) for k in tile_config.KERNELS]
print(tune._precompile_cases([(torch.bfloat16, 64, "bfloat16")], first, s, 96, 90, 300.0))
"""


@pytest.mark.slow  # ~12 s: five Triton compiles in three processes
def test_precompile_fills_triton_s_cache_with_what_the_launch_binds(tmp_path):
    """The sweep's compiles run in other processes on stand-ins of the launch's tensors: they bind as the
    launch does (the cache key), land in the cache the launch reads, and report the committed spills."""
    version, rows = candidate_rows()
    if version != triton_version():
        pytest.skip(f"tune_candidates.csv holds no rows of the installed triton {triton_version()}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    done = subprocess.run([sys.executable, "-c", _PRECOMPILE_PROBE], env=env, capture_output=True, text=True,
                          cwd=REPO, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    same, spills, cases = done.stdout.splitlines()
    assert same == "True"
    committed = {(r["kernel"], r["dtype"], r["block_m"]): int(r["spill_stores"]) + int(r["spill_loads"])
                 for r in rows if r["target"] == "sm_90" and
                 (r["kernel"], r["dtype"], r["head_dim"], r["block_m"], r["block_n"], r["num_warps"], r["num_stages"])
                 in {("forward", "bfloat16", "64", "128", "64", "8", "3"), ("dq", "float16", "128", "128", "128", "8", "3")}}
    assert [int(x) for x in spills.split()] == [committed["forward", "bfloat16", "128"], committed["dq", "float16", "128"]]
    assert cases == str({("bfloat16", 64, (64, 64), k, (4, 2)): 0 for k in tile_config.KERNELS})
    assert len(list(tmp_path.rglob("*.cubin"))) == 2 + 3
