"""The Triton kernels compiled for sm_80 (A100) and sm_90 (H100) without a GPU (issue 35).

The interpreter tests (``test_engine_triton.py``) check what the kernels compute, in Python
semantics; they cannot see what a GPU compiler refuses or what the kernels cost on a GPU.
Here Triton's compiler and the ptxas of its wheel build the kernels for both targets, in a
child process (this one runs Triton's interpreter: ``tests/conftest.py`` sets
``TRITON_INTERPRET=1`` before triton is imported). Compiling all 1,209 configurations (1,089 of
the gather kernels, 96 of them with edge features, 120 of the ``tc`` backend's tile kernels) for both targets takes ~30 minutes of CPU
(``python -m tgattn.bench.gpu_compiled --out data/gpu``, run and committed); the test compiles each
kernel's configuration with every option on (bias per head, dropout, returned weights or their
gradient, bias gradient, softcap or edge features, sinks, the remainder's merge) at every dtype and head dim,
for both targets (258 compiles: 129 configurations), and checks the committed table of all of them against the code.
"""
import csv
import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO

pytest.importorskip("triton")
from tgattn.bench.gpu_compiled import failures  # noqa: E402
from tgattn.engine.triton import aot  # noqa: E402
from tgattn.engine.triton.attention import DTYPES, kernels_module, triton_attention  # noqa: E402

COMMITTED = REPO / "data" / "gpu" / "compiled.csv"


def _read(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def _key(row):
    return row["target"], row["kernel"], row["dtype"], int(row["head_dim"]), row["options"]


@pytest.mark.slow  # 146 Triton compiles: 13-20 minutes on two busy cores
def test_every_kernel_compiles_for_sm80_and_sm90_without_spills_within_shared_memory_and_over_the_floor(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-m", "tgattn.bench.gpu_compiled", "--every-option-only", "--quiet", "--out", str(tmp_path)],
        env=env, capture_output=True, text=True, cwd=REPO, timeout=1200,
    )
    assert done.returncode == 0, done.stderr[-4000:]  # a compile error's traceback, or the failures
    rows = _read(tmp_path / "compiled.csv")
    heaviest = [c for c in aot.configurations() if c.every_option]
    assert sorted(_key(r) for r in rows) == sorted(
        (t.name, c.kernel, c.dtype_name, c.head_dim, c.options) for t in aot.TARGETS for c in heaviest
    )
    limits = {t.name: t.smem_per_block for t in aot.TARGETS}
    for r in rows:
        assert (int(r["spill_stores"]), int(r["spill_loads"])) == (0, 0), r
        assert 0 < int(r["registers"]) <= 255 and int(r["shared"]) <= limits[r["target"]], r
        # one warpgroup for the tile kernels (their copies in flight are their own: aot.TILE_FLOOR_WARPS)
        floor = aot.TILE_FLOOR_WARPS if r["kernel"] in aot.TILE_KERNELS else aot.OCCUPANCY_FLOOR_WARPS
        assert int(r["resident_warps"]) >= floor, r
    assert "## Roofline on an H100 SXM" in (tmp_path / "compiled.md").read_text()


def test_the_committed_table_covers_every_configuration_at_the_blocks_the_backend_picks():
    rows = _read(COMMITTED)
    expected = {(t.name, c.kernel, c.dtype_name, c.head_dim, c.options) for t in aot.TARGETS for c in aot.configurations()}
    assert len(rows) == len(expected) == 2 * 1209
    assert {_key(r) for r in rows} == expected
    assert failures(rows) == []
    configs = {(c.kernel, c.dtype_name, c.head_dim, c.options): c for c in aot.configurations()}
    targets = {t.name: t for t in aot.TARGETS}
    for r in rows:
        d = int(r["head_dim"])
        if d:
            config = configs[_key(r)[1:]]
            assert (int(r["block_m"]), int(r["block_n"])) == aot.blocks_of(config), r
            # the launchers' own: the target's for the tiles (tile_config), kernels.num_warps or four for wide
            # float64 edge features (kernels.WIDE_FEATURES) for the gather kernels
            warps = aot.launch_of(config, targets[r["target"]]).meta["num_warps"]
            assert int(r["num_warps"]) == warps, r
            if r["kernel"] not in aot.TILE_KERNELS and not config.features:
                assert warps == kernels_module().num_warps(d), r


_PRECISION_PROBE = """
import re, torch
from tgattn.engine.triton import aot
sm90 = [t for t in aot.TARGETS if t.name == "sm_90"][0]
for dtype in (torch.float64, torch.float32):
    for kernel in ("forward_kernel", "dq_kernel", "dkdv_kernel"):
        ptx = aot.compile_launch(aot.launch_of(aot.Config(kernel, dtype, 16)), sm90)[1]["ptx"]
        params = sorted(re.findall(r"\\.param \\.(f32|f64) ", ptx))
        print(kernel, dtype, ",".join(params), len(re.findall(r"\\b(?:mul|fma|add|sub)\\.rn\\.f64", ptx)))
"""


def test_float_arguments_reach_the_compiled_kernels_in_double_precision():
    """A Python float reaches a compiled kernel as float32 unless its parameter says otherwise:
    the softmax scale, soft-cap and dropout rescale were rounded so, and float64 results were
    1e-8 off on an H100 (data/gpu/h100.md) while the interpreter's were exact. Compiled for
    sm_90: three float64 arguments (scale, cap, 1 / keep) and one float32 (p, compared with
    Triton's float32 random numbers); the float32 kernels convert them once and do no float64
    arithmetic."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _PRECISION_PROBE], env=env, capture_output=True, text=True,
                          cwd=REPO, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [line.split() for line in done.stdout.splitlines()]
    assert len(lines) == 6
    for kernel, dtype, params, f64_arithmetic in lines:
        assert params == "f32,f64,f64,f64", (kernel, dtype, params)
        assert (int(f64_arithmetic) > 0) == (dtype == "torch.float64"), (kernel, dtype, f64_arithmetic)


def _meta_key(launch):
    """What makes a compiled kernel: the kernel, its first tensor's dtype, constants and options."""
    meta = {k: str(v) for k, v in launch.meta.items()}
    return launch.kernel.__name__, launch.args[0].dtype, tuple(sorted(meta.items()))


@pytest.mark.parametrize("call", ["bias, dropout, weights", "softcap and sinks", "every option", "edge features"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_every_launch_of_a_real_call_is_among_the_compiled_configurations(dtype, call, monkeypatch):
    """A call with bias, dropout and returned weights (or Gemma 2 / gpt-oss's softcap and sinks, or
    everything, or F = d edge features with every other option), forward and backward, launches nothing
    the compiled matrix lacks (the configurations come from the launchers, not from a copy)."""
    if not kernels_module().INTERPRETED:
        pytest.skip("needs Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py)")
    from tgattn.engine.analysis import analyse

    kern = kernels_module()
    seen = []
    run = kern.Launch.__call__

    def record(launch):
        seen.append(_meta_key(launch))
        run(launch)

    monkeypatch.setattr(kern.Launch, "__call__", record)
    n, heads, d = 10, aot.HEADS, 16
    i = torch.arange(n)
    edge_index = torch.stack([(i[:, None] - torch.arange(3)).clamp(min=0).flatten(), i.repeat_interleave(3)])
    s = analyse(edge_index, n, n)
    q, k, v = (torch.randn(n, heads, d, dtype=dtype, requires_grad=True) for _ in range(3))
    bias = torch.randn(s.num_edges, heads, dtype=dtype, requires_grad=True)
    sinks = torch.zeros(heads, dtype=dtype, requires_grad=True)
    if call == "edge features":  # F = d features, a permuted set (unsorted edges), every other option
        from tgattn.engine.triton.edge_features import triton_edge_features

        shuffled = edge_index[:, torch.randperm(edge_index.shape[1])]
        s = analyse(shuffled, n, n)
        assert s.perm is not None
        maps = torch.randn(heads, d, d, dtype=dtype, requires_grad=True)
        features = torch.randn(s.num_edges, d, dtype=dtype, requires_grad=True)
        out, w = triton_edge_features(q, k, v, s, bias, 0.25, 0.2, True, features, maps, maps, sinks=sinks)
    elif call == "softcap and sinks":
        out, w = triton_attention(q, k, v, s, None, 0.25, 0.0, False, softcap=2.0, sinks=sinks)
        w = out.new_zeros(())
    else:
        every = call == "every option"
        out, w = triton_attention(q, k, v, s, bias, 0.25, 0.2, True, softcap=2.0 if every else None,
                                  sinks=sinks if every else None)
    (out.sum() + w.sum()).backward()
    compiled = {_meta_key(aot.launch_of(c)) for c in aot.configurations() if c.dtype == dtype and c.head_dim == d}
    assert len(seen) == 3 and set(seen) <= compiled


def test_resident_warps_follow_the_occupancy_rule():
    sm80, sm90 = aot.TARGETS
    # 255 registers: 8,160 a warp, allocated as 8,192: 8 warps (two blocks of 4)
    assert aot.Resources(4, 255, 0, 0, 0, 2048).resident_warps(sm90) == 8
    # 72 registers: 2,304 a warp: 28 warps fit, 7 blocks of 4
    assert aot.Resources(4, 72, 0, 0, 0, 2048).resident_warps(sm90) == 28
    # 18 registers: the 64-warp limit
    assert aot.Resources(4, 18, 0, 0, 0, 0).resident_warps(sm80) == 64
    # 100 KB of shared memory a block (+ 1 KB reserved): one block on an A100, two on an H100
    assert aot.Resources(4, 64, 0, 0, 0, 100 * 1024).resident_warps(sm80) == 4
    assert aot.Resources(4, 64, 0, 0, 0, 100 * 1024).resident_warps(sm90) == 8


def test_configurations_cover_every_dtype_head_dim_and_option():
    configs = list(aot.configurations())
    assert {c.dtype for c in configs if c.head_dim} == set(DTYPES)
    assert {c.head_dim for c in configs if c.head_dim} == set(aot.HEAD_DIMS)
    plain = [c for c in configs if not c.features]  # (the edge features' configurations: below)
    forward = [c for c in plain if c.kernel == "forward_kernel" and c.dtype == torch.float16 and c.head_dim == 64]
    # bias none / [E, 1] / [E, H] x dropout x weights; softcap, sinks or both with each bias; every option
    assert len(forward) == 3 * 2 * 2 + 3 * 3 + 1
    dq = [c for c in plain if c.kernel == "dq_kernel" and c.dtype == torch.float16 and c.head_dim == 64]
    assert len(dq) == 2 * 2 + 2 * 2 * 2 * 2 + 3 + 1  # a bias gradient only with a bias; softcap with each bias
    tiles = [c for c in configs if c.kernel in aot.TILE_KERNELS and c.dtype == torch.bfloat16 and c.head_dim == 64]
    # forward, dq: softcap x remainder, grouped with both (dq also without a remainder); dk dv: softcap,
    # grouped with it (the caller adds a remainder's share); the delta kernel once
    assert sorted(c.kernel for c in tiles) == sorted(["tile_forward_kernel"] * 5 + ["tile_dq_kernel"] * 6
                                                     + ["tile_dkdv_kernel"] * 3 + ["tile_delta_kernel"])
    features = [c for c in configs if c.features and c.dtype == torch.float16 and c.head_dim == 64]
    assert sorted(c.kernel for c in features) == sorted(["forward_kernel", "dq_kernel", "dkdv_kernel"] * 2)
    assert len({(c.kernel, c.dtype, c.head_dim, c.options) for c in configs}) == len(configs) == 1209


def test_failures_name_spills_shared_memory_over_the_limit_and_occupancy_under_the_floor():
    row = dict(target="sm_80", kernel="dq_kernel", dtype="float32", head_dim=64, options="-",
               spill_stores=0, spill_loads=0, shared=2048, resident_warps=8)
    assert failures([row]) == []
    assert failures([{**row, "spill_stores": 12, "spill_loads": 4}]) == [
        "sm_80 dq_kernel float32 d=64 (-): spills 12 / 4 bytes"]
    assert failures([{**row, "shared": 163 * 1024 + 1}]) == [
        f"sm_80 dq_kernel float32 d=64 (-): {163 * 1024 + 1} bytes of shared memory (limit {163 * 1024})"]
    assert failures([{**row, "target": "sm_90", "shared": 163 * 1024 + 1}]) == []  # an H100 block may take 227 KB
    assert failures([{**row, "resident_warps": 4}]) == ["sm_80 dq_kernel float32 d=64 (-): 4 resident warps (floor 8)"]


def test_added_rows_replace_those_of_the_same_configuration(tmp_path):
    """``--add-to``: the new rows join the table, in place of any row of the same target and configuration."""
    from tgattn.bench.gpu_compiled import FIELDS, _added
    from tgattn.bench.report import write_csv

    row = dict(target="sm_80", kernel="dq_kernel", dtype="float32", head_dim=64, options="-", registers=100)
    write_csv([row, {**row, "options": "dropout"}], tmp_path / "compiled.csv", FIELDS)
    rows = _added([{**row, "registers": 120}, {**row, "options": "edge features"}], tmp_path)
    assert [(r["options"], int(r["registers"])) for r in rows] == [("dropout", 100), ("-", 120), ("edge features", 100)]


CANDIDATES = REPO / "data" / "gpu" / "tune_candidates.csv"
_CANDIDATE_PROBE = """
import sys
from tgattn.engine.triton import aot, tile_config
targets = {t.name: t for t in aot.TARGETS}
for line in sys.stdin.read().split(";"):
    target, kernel, dtype, *numbers = line.split(",")
    res, _ = aot.compile_launch(aot.candidate_launch(tile_config.Candidate(kernel, dtype, *map(int, numbers)),
                                                     targets[target]), targets[target])
    print(res.registers, res.spill_stores, res.spill_loads, res.shared)
"""


@pytest.mark.slow  # 8 Triton compiles: ~30 s
def test_the_committed_tune_candidates_compile_to_the_same_registers_spills_and_shared_memory():
    """Rows of data/gpu/tune_candidates.csv (every configuration the tile sweep may pick, for sm_80 and
    sm_90: ``python -m tgattn.bench.gpu_compiled --tune-candidates``) compiled again: the same numbers.
    A spread of rows, a spilling one and one over the shared memory a block may take among them."""
    from tgattn.bench.gpu.tune import candidate_rows
    from tgattn.engine.triton.aot import triton_version

    version, rows = candidate_rows(CANDIDATES)
    if version != triton_version():
        pytest.skip(f"tune_candidates.csv holds no rows of the installed triton {triton_version()}")
    spread = rows[::127]
    spilling = next(r for r in rows if int(r["spill_stores"]) and r not in spread)
    too_big = next(r for r in rows if int(r["shared"]) > int(r["smem_limit"]) and r not in spread)
    picked = spread + [spilling, too_big]
    fields = ("target", "kernel", "dtype", "head_dim", "block_m", "block_n", "num_warps", "num_stages")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _CANDIDATE_PROBE], env=env, capture_output=True, text=True, cwd=REPO,
                          timeout=900, input=";".join(",".join(r[f] for f in fields) for r in picked))
    assert done.returncode == 0, done.stderr[-4000:]
    found = [line.split() for line in done.stdout.splitlines()]
    assert found == [[r["registers"], r["spill_stores"], r["spill_loads"], r["shared"]] for r in picked]
