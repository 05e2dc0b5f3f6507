"""The tile kernels' compiled code for sm_90 and sm_80, read without a GPU (issue 56).

A child process (this one runs Triton's interpreter) compiles the ``tc`` backend's tile kernels
through :mod:`tgattn.engine.triton.aot` at their launch options for each target and reports what
the software pipeliner and the tensor-core lowering made of them:

* **a pipeline in every tile loop**: each loop waits at its top for all but the newest copies
  (``ttg.async_wait {num = N}``, ``cp.async.wait_group N`` with N > 0), over operand buffers
  at least 3 deep where the products are ``wgmma`` (sm_90; 2 for ``mma.sync``, which reads registers); no tile id is
  itself an asynchronous copy (a ``1 x 1`` buffer), which cost the key / value loads their
  distance before;
* **one copy of each score**: the products' multiply-adds (``wgmma`` / ``mma.sync`` shapes times
  the warps that run them) equal the tile's products exactly, and the exponentials per score
  cell are one (two with a softcap's tanh) plus per-row terms (but dq where it runs on 8 warps,
  ``REPEATED``);
* no spills.
"""
import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

pytest.importorskip("triton")

_PROBE = r"""
import json, re, sys, torch
from tgattn.engine.triton import aot
for target in aot.TARGETS:
    for kernel, d in (("tile_forward_kernel", 64), ("tile_dq_kernel", 64), ("tile_dkdv_kernel", 64),
                      ("tile_forward_kernel", 128), ("tile_dq_kernel", 128)):
        config = aot.Config(kernel, torch.bfloat16, d, softcap=True, remainder=kernel != "tile_dkdv_kernel")
        launch = aot.launch_of(config, target)
        res, asm = aot.compile_launch(launch, target)
        ttgir, ptx = asm["ttgir"], asm["ptx"]
        waits, depth, in_loop = [], [], False
        for line in ttgir.splitlines():
            if "scf.for" in line:
                in_loop, first = True, True
            elif "scf.yield" in line:
                in_loop = False
            elif in_loop and first and "ttg.async_wait" in line:
                waits.append(int(re.search(r"num = (\d+)", line).group(1)))
                first = False
        buffers = [int(n) for n in re.findall(r"ttg.local_alloc : \(\) -> !ttg.memdesc<(\d+)x(?:64|128)x(?:64|128)x", ttgir)]
        macs = sum(int(m) * int(n) * int(k) for m, n, k in re.findall(r"wgmma\.mma_async\S*\.m(\d+)n(\d+)k(\d+)", ptx))
        macs = macs * res.num_warps // 4 + 16 * 8 * 16 * res.num_warps * len(re.findall(r"mma\.sync\.aligned\.m16n8k16", ptx))
        print(json.dumps(dict(
            target=target.name, kernel=kernel, d=d, warps=res.num_warps, spills=res.spill_stores + res.spill_loads,
            loop_waits=waits, ptx_waits=[int(n) for n in re.findall(r"cp\.async\.wait_group\s+(\d+)", ptx)],
            buffers=buffers, scalar_copies=len(re.findall(r"memdesc<\d+x1xi(?:32|64)", ttgir)),
            macs=macs, ex2=len(re.findall(r"ex2\.approx", ptx)), wgmma=len(re.findall(r"wgmma\.mma_async", ptx)),
            rows=launch.meta["BLOCK_M"] * launch.meta["GROUP"], keys=launch.meta["BLOCK_N"] // launch.meta.get("SPLIT", 1))))
"""
PRODUCTS = {"tile_forward_kernel": 2, "tile_dq_kernel": 3, "tile_dkdv_kernel": 4}  # products of a tile
LOOPS = 2  # full tiles, then partial ones
# The kernels here on 8 warps (tile_config: 4 spilled 12-20 bytes) whose 64-row products run in two
# copies, at most: sm_90's dq at d = 128 (both warpgroups), sm_80's at d = 64 (its mma.sync layout
# puts the 8 warps over the 64 rows; at d = 128 it spreads them over the columns: no copy).
REPEATED = {("sm_90", "tile_dq_kernel", 128), ("sm_80", "tile_dq_kernel", 64)}


@pytest.fixture(scope="module")
def compiled():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, cwd=REPO,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow  # ~1-2 minutes of CPU: 10 compiles
def test_every_tile_loop_keeps_the_next_tiles_in_flight_without_spills(compiled):
    assert len(compiled) == 10
    for r in compiled:
        assert r["spills"] == 0, r
        assert len(r["loop_waits"]) == LOOPS and min(r["loop_waits"]) > 0, r  # the top of each loop
        assert sum(n > 0 for n in r["ptx_waits"]) >= LOOPS, r
        assert r["scalar_copies"] == 0, r  # no tile id made an asynchronous copy
        assert min(r["buffers"]) >= (3 if r["wgmma"] else 2), r  # wgmma reads shared memory: one more buffer


@pytest.mark.slow
def test_each_score_is_computed_once(compiled):
    for r in compiled:
        cells = r["rows"] * r["keys"]
        products = LOOPS * PRODUCTS[r["kernel"]] * cells * r["d"]
        if (r["target"], r["kernel"], r["d"]) in REPEATED:
            assert r["warps"] == 8 and products < r["macs"] <= 2 * products, r
            continue
        assert r["macs"] == products, r
        exps = 2  # the score's exponential and the softcap's tanh
        threads = 32 * r["warps"]
        # per-row terms (the running max's rescale, recomputed in each layout that needs it, and the
        # remainder's merge) stay under a quarter; a second copy of the scores would double it
        assert LOOPS * exps * cells <= r["ex2"] * threads <= 1.25 * LOOPS * exps * cells, r
