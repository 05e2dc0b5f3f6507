"""The Triton kernels compiled for sm_80 (A100) and sm_90 (H100) without a GPU, with their
resources and an H100 roofline: ``python -m tgattn.bench.gpu_compiled``.

Every configuration the backends launch (:func:`tgattn.engine.triton.aot.configurations`: 4
dtypes x head dims 16-128 x bias / dropout / returned weights / bias gradient / softcap / sinks, forward and
backward kernels of ``triton``; the tile kernels of ``tc``) is compiled by Triton for each target, with ptxas from Triton's wheel, into a
fresh cache (nothing is reused across runs). It writes ``compiled.csv`` (one row per
configuration and target: registers, spills, shared memory, resident warps, compile time) and
``compiled.md``: the table per kernel, dtype and head dim (the worst over option sets) and the
roofline (:func:`edge_head_cost`). A compile error stops the run with Triton's message; the
exit status is 1 when any configuration spills, asks for more shared memory than its target
has, or keeps fewer than ``OCCUPANCY_FLOOR_WARPS`` warps resident per SM.

Example::

    python -m tgattn.bench.gpu_compiled --out data/gpu        # the committed table (~30 min of CPU)
    python -m tgattn.bench.gpu_compiled --every-option-only   # each kernel's heaviest code only (~45 s)
    python -m tgattn.bench.gpu_compiled --only "edge features" --add-to data/gpu   # new rows into the table
    python -m tgattn.bench.gpu_compiled --tune-candidates --out data/gpu  # the tile sweep's candidates
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Sequence, Tuple

import torch

from .._cli import out_help, runs_dir
from .report import read_rows, write_csv

FIELDS = ("target", "kernel", "dtype", "head_dim", "options", "block_m", "block_n", "num_warps", "registers",
          "spill_stores", "spill_loads", "stack", "shared", "resident_warps", "compile_s")
# NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column (dense rates, without sparsity).
H100_BANDWIDTH = 3.35e12  # bytes/s, HBM3
H100_FLOPS = {torch.float32: 67e12, torch.float64: 34e12}  # CUDA-core FP32 / FP64 (the kernels have no tl.dot)
INDEX_BYTES = 8  # int64 edge ids and node ids


def compile_all(targets, every_option_only: bool = False, progress=None, only: str = "") -> List[dict]:
    """One row per (target, configuration), compiled into a temporary cache; ``only``: just the configurations
    whose options name it."""
    from tgattn.engine.triton import aot

    rows = []
    with tempfile.TemporaryDirectory() as cache:
        for target in targets:
            for config in aot.configurations():
                if (every_option_only and not config.every_option) or only not in config.options:
                    continue
                launch = aot.launch_of(config, target)
                start = time.perf_counter()
                res, _ = aot.compile_launch(launch, target, cache)
                block_m, block_n = aot.blocks_of(config)
                rows.append(dict(
                    target=target.name, kernel=config.kernel, dtype=config.dtype_name, head_dim=config.head_dim,
                    options=config.options, block_m=block_m, block_n=block_n, num_warps=res.num_warps,
                    registers=res.registers, spill_stores=res.spill_stores, spill_loads=res.spill_loads,
                    stack=res.stack, shared=res.shared, resident_warps=res.resident_warps(target),
                    compile_s=round(time.perf_counter() - start, 2),
                ))
                if progress:
                    progress(rows[-1])
    return rows


CANDIDATE_FIELDS = ("triton", "target", "kernel", "dtype", "head_dim", "block_m", "block_n", "num_warps", "num_stages", "registers",
                    "spill_stores", "spill_loads", "stack", "shared", "smem_limit", "compile_s")


def compile_candidates(targets, progress=None) -> List[dict]:
    """One row per (target, candidate of the tile kernels' sweep: :func:`~tgattn.engine.triton.tile_config.candidates`),
    each compiled with a softcap and the remainder's merge (:func:`~tgattn.engine.triton.aot.candidate_launch`)."""
    from tgattn.engine.triton import aot
    from tgattn.engine.triton.tile_config import candidates

    rows, version = [], aot.triton_version()
    with tempfile.TemporaryDirectory() as cache:
        for target in targets:
            for c in candidates():
                start = time.perf_counter()
                res, _ = aot.compile_launch(aot.candidate_launch(c, target), target, cache)
                rows.append(dict(
                    triton=version, target=target.name, kernel=c.kernel, dtype=c.dtype, head_dim=c.head_dim, block_m=c.block_m,
                    block_n=c.block_n, num_warps=c.num_warps, num_stages=c.num_stages, registers=res.registers,
                    spill_stores=res.spill_stores, spill_loads=res.spill_loads, stack=res.stack, shared=res.shared,
                    smem_limit=target.smem_per_block, compile_s=round(time.perf_counter() - start, 2)))
                if progress:
                    progress(rows[-1])
    return rows


def failures(rows: Sequence[dict]) -> List[str]:
    """What breaks the issue's bar: spills, shared memory over the target's limit, occupancy under the floor."""
    from tgattn.engine.triton.aot import OCCUPANCY_FLOOR_WARPS, TARGETS, TILE_FLOOR_WARPS, TILE_KERNELS

    limits = {t.name: t.smem_per_block for t in TARGETS}
    bad = []
    for r in rows:
        where = f"{r['target']} {r['kernel']} {r['dtype']} d={r['head_dim']} ({r['options']})"
        if int(r["spill_stores"]) or int(r["spill_loads"]):
            bad.append(f"{where}: spills {r['spill_stores']} / {r['spill_loads']} bytes")
        if int(r["shared"]) > limits[r["target"]]:
            bad.append(f"{where}: {r['shared']} bytes of shared memory (limit {limits[r['target']]})")
        floor = TILE_FLOOR_WARPS if r["kernel"] in TILE_KERNELS else OCCUPANCY_FLOOR_WARPS
        if int(r["resident_warps"]) < floor:
            bad.append(f"{where}: {r['resident_warps']} resident warps (floor {floor})")
    return bad


def edge_head_cost(kernel: str, dtype: torch.dtype, d: int, *, bias=False, weights=False, bias_grad=False) -> Tuple[int, int]:
    """``(bytes, FLOPs)`` one edge of one head costs ``kernel``, read from the kernel's code.

    Counted: the edge's index loads, its gathered key / value (query / output-gradient) row,
    its bias, weight or weight gradient, and the multiply-adds of its dot products (2 FLOPs
    each). Not counted: the per-row terms (a row's query, output, log-sum-exp, loaded or stored
    once per row and head, amortised over its edges), exponentials and dropout's Philox draws.

    Example:
        >>> edge_head_cost("forward_kernel", torch.float32, 64)  # SRC id, key and value rows
        (520, 256)
    """
    b = torch.finfo(dtype).bits // 8
    acc = 8 if dtype == torch.float64 else 4
    if kernel == "forward_kernel":  # SRC, K row, V row; weights: a second pass over SRC, K (and bias)
        read = INDEX_BYTES + 2 * d * b + bias * b
        return read + weights * (INDEX_BYTES + d * b + bias * b + b), 4 * d + weights * 2 * d
    if kernel == "dq_kernel":  # SRC, K row, V row, bias, weight grad; writes the score grad
        return INDEX_BYTES + 2 * d * b + bias * b + weights * b + bias_grad * acc, 6 * d
    if kernel == "dkdv_kernel":  # ROW_T, PERM_T, Q row, dO row, LSE, DELTA, bias, weight grad
        return 2 * INDEX_BYTES + 2 * d * b + 2 * acc + bias * b + weights * b, 8 * d
    raise ValueError(f"no cost model for {kernel!r}")


def roofline_ps(nbytes: int, flops: int, dtype: torch.dtype) -> float:
    """The H100 SXM's least time for ``nbytes`` and ``flops``, in picoseconds."""
    rate = H100_FLOPS[torch.float64 if dtype == torch.float64 else torch.float32]
    return max(nbytes / H100_BANDWIDTH, flops / rate) * 1e12


def resource_table(rows: Sequence[dict]) -> str:
    """Markdown: per kernel, dtype and head dim, the worst over option sets on each target (the kernels with edge
    features on lines of their own: they run at other blocks)."""
    targets = sorted({r["target"] for r in rows})
    groups = {}
    for r in rows:
        kernel = r["kernel"] + (", edge features" if "edge features" in r["options"] else "")
        groups.setdefault((kernel, r["dtype"], int(r["head_dim"])), {}).setdefault(r["target"], []).append(r)
    head = "| kernel | dtype | d | blocks (M x N) | configs | " + " | ".join(
        f"{t} regs | {t} spills B | {t} smem KB | {t} warps/SM" for t in targets) + " |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for (kernel, dtype, d), by_target in groups.items():
        first = next(iter(by_target.values()))
        cells = [kernel, dtype, str(d) if d else "-", f"{first[0]['block_m']} x {first[0]['block_n']}" if d else "-",
                 str(len(first))]
        for t in targets:
            rs = by_target.get(t, [])
            cells += [
                f"{min(int(r['registers']) for r in rs)}-{max(int(r['registers']) for r in rs)}",
                str(max(int(r["spill_stores"]) + int(r["spill_loads"]) for r in rs)),
                f"{max(int(r['shared']) for r in rs) / 1024:.1f}",
                str(min(int(r["resident_warps"]) for r in rs)),
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def roofline_table() -> str:
    """Markdown: bytes, FLOPs and the H100 time per edge-head of each kernel, without options."""
    from tgattn.engine.triton.aot import HEAD_DIMS
    from tgattn.engine.triton.attention import DTYPES

    head = ("| dtype | d | forward B / FLOP | dq B / FLOP | dk dv B / FLOP | forward ps | "
            "backward ps (dq + dk dv) | forward + backward ps |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for dtype in DTYPES:
        for d in HEAD_DIMS:
            costs = [edge_head_cost(k, dtype, d) for k in ("forward_kernel", "dq_kernel", "dkdv_kernel")]
            ps = [roofline_ps(nb, fl, dtype) for nb, fl in costs]
            lines.append(f"| {str(dtype).replace('torch.', '')} | {d} | " + " | ".join(f"{nb} / {fl}" for nb, fl in costs)
                         + f" | {ps[0]:.0f} | {ps[1] + ps[2]:.0f} | {sum(ps):.0f} |")
    return "\n".join(lines)


def markdown(rows: Sequence[dict], command: str) -> str:
    import triton

    from tgattn.engine.triton.aot import HEAD_DIMS, OCCUPANCY_FLOOR_WARPS, TARGETS, TILE_FLOOR_WARPS
    from tgattn.engine.triton.attention import DTYPES

    bad = failures(rows)
    seconds = sum(float(r["compile_s"]) for r in rows)
    intensity = [fl / nb for nb, fl in (edge_head_cost(k, dtype, d) for k in ("forward_kernel", "dq_kernel", "dkdv_kernel")
                                        for dtype in DTYPES for d in HEAD_DIMS)]
    low, high = min(intensity), max(intensity)
    ridge32, ridge64 = (H100_FLOPS[t] / H100_BANDWIDTH for t in (torch.float32, torch.float64))
    verdict = (f"none spills, none asks for more shared memory than its target has, and each keeps at least "
               f"{OCCUPANCY_FLOOR_WARPS} warps resident per SM ({TILE_FLOOR_WARPS} for the tile kernels)" if not bad
               else f"{len(bad)} configurations break the bar: " + "; ".join(bad[:5]))
    limits = "; ".join(f"{t.name} ({t.gpu}): {t.regs_per_sm} registers, {t.smem_per_sm // 1024} KB shared memory "
                       f"({t.smem_per_block // 1024} KB a block), {t.max_warps} warps per SM" for t in TARGETS)
    return f"""# The Triton kernels compiled for sm_80 and sm_90

Made by `{command}` (triton {triton.__version__}, its own ptxas; no GPU): {len(rows)} compiles,
{seconds:.0f} s. Every configuration the `triton` and `tc` backends launch
(`tgattn.engine.triton.aot.configurations`) was compiled for each target:
{verdict}. Per configuration: `compiled.csv`.

Each line is the worst over the option sets of one kernel, dtype and head dim ("configs": how
many): registers per thread (least-most), spilled bytes (stores + loads), shared memory per
block, resident warps per SM (the CUDA occupancy rule: registers in units of 256 per warp,
1 KB of shared memory reserved per block). Warps a block: 2 from head dim 64 up, 4 below
(`tgattn.engine.triton.kernels.num_warps`; 4 with float64 edge features from d + F = 256,
`kernels.WIDE_FEATURES`); the kernels with edge features are compiled at F = d, the most the blocks
of their own lines take (`tgattn.engine.triton.aot`); the `tc` backend's tile kernels (`tile_*`, 64 x 64
tiles of float16 / bfloat16 on tensor cores) take the warps and pipeline stages of each target
(`tgattn.engine.triton.tile_config.default_config`). The limits:
{limits}.
The floor of {OCCUPANCY_FLOOR_WARPS} warps per SM ({TILE_FLOOR_WARPS} for the tile kernels, which keep their own copies in
flight), and why: `tgattn/engine/triton/aot.py`.

{resource_table(rows)}

## Roofline on an H100 SXM

Per edge and head (`tgattn.bench.gpu_compiled.edge_head_cost`, counted from each kernel's
loads, stores and dot products; the per-row terms amortised over a row's edges are left out),
and the least time the H100 SXM allows for it: HBM3 at 3.35 TB/s, and, since the kernels
multiply and sum on CUDA cores (no `tl.dot`), 67 TFLOP/s of FP32 for float16 / bfloat16 /
float32 inputs (accumulated in float32) and 34 TFLOP/s of FP64 for float64 (NVIDIA H100 Tensor
Core GPU datasheet, SXM, dense; the 989 TFLOP/s of bf16 / fp16 tensor cores and 495 of TF32
are not what these kernels use). At {low:.2f}-{high:.2f} FLOP per byte every kernel is bound by
memory (the ridge: {ridge32:.0f} FLOP per byte for FP32, {ridge64:.0f} for FP64). Bytes assume each edge's gathered rows come from HBM:
the time a scattered set (random, top-k) should reach; a local set (window) rereads rows
from L2 and may beat it. Options add bytes: a bias one element per kernel, returned weights a
second forward pass over the keys, a bias gradient one accumulator per edge in dq.

A GPU run's time per edge-head is its time / (E x H) (1 ps per edge-head = 1 us per million
edge-heads); PERFORMANCE.md's GPU target is within 2x of the line of its dtype and head dim.

{roofline_table()}

Measured on an H100 (`h100.md` beside this file): at d = 64 window-64 and random-1 % sets ran
at 1.1-1.5x the bfloat16 line and under the float32 line (rows reread from L2), within the
2x target.
"""


def _added(rows: List[dict], folder: Path) -> List[dict]:
    """The rows of ``folder/compiled.csv`` with ``rows`` in place of those of the same target and configuration."""
    def key(r):
        return r["target"], r["kernel"], r["dtype"], str(r["head_dim"]), r["options"]

    old = read_rows(folder / "compiled.csv")
    new = {key(r) for r in rows}
    return [r for r in old if key(r) not in new] + rows


def main(argv=None) -> int:
    from tgattn.engine.triton.aot import TARGETS

    parser = argparse.ArgumentParser(allow_abbrev=False, prog="python -m tgattn.bench.gpu_compiled", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=runs_dir("gpu_compiled"), help=out_help("gpu_compiled"))
    parser.add_argument("--targets", nargs="+", choices=[t.name for t in TARGETS], default=[t.name for t in TARGETS])
    parser.add_argument("--every-option-only", action="store_true",
                        help="each kernel's configuration with every option on, per dtype and head dim")
    parser.add_argument("--only", default="", metavar="OPTION",
                        help="just the configurations whose options name OPTION (e.g. 'edge features')")
    parser.add_argument("--add-to", type=Path, metavar="DIR",
                        help="add the rows to DIR/compiled.csv (replacing rows of the same configuration) and "
                             "rewrite DIR/compiled.md from all of them, instead of writing --out")
    parser.add_argument("--quiet", action="store_true", help="no line per compile")
    parser.add_argument("--tune-candidates", action="store_true",
                        help="instead: every configuration the tile kernels' sweep may pick (tile shape x warps x "
                             "stages), written as tune_candidates.csv beside the rows of other Triton releases (~20 minutes of one CPU core)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("TRITON_INTERPRET is set: this command needs Triton's compiler; run it without TRITON_INTERPRET=1",
              file=sys.stderr)
        return 2
    targets = [t for t in TARGETS if t.name in args.targets]
    if args.tune_candidates:
        rows = compile_candidates(targets, None if args.quiet else lambda r: print(
            " ".join(str(r[k]) for k in CANDIDATE_FIELDS), flush=True))
        path = args.out / "tune_candidates.csv"
        if path.exists():  # the rows of other Triton releases stay: the sweep reads its own release's
            rows = [r for r in read_rows(path) if r["triton"] != rows[0]["triton"]] + rows
        write_csv(rows, path, CANDIDATE_FIELDS)
        return 0

    def progress(r):
        if not args.quiet:
            print(f"{r['target']} {r['kernel']:<14} {r['dtype']:<8} d={r['head_dim']:<3} {r['options']:<45} "
                  f"regs {r['registers']:>3} spills {r['spill_stores']}/{r['spill_loads']} "
                  f"smem {r['shared']:>6} warps/SM {r['resident_warps']:>2} {r['compile_s']:.1f}s", flush=True)

    rows = compile_all(targets, args.every_option_only, progress, args.only)
    given = argv if argv is not None else sys.argv[1:]
    command = "python -m tgattn.bench.gpu_compiled" + "".join(f" {shlex.quote(a)}" for a in given)
    out = args.out
    if args.add_to is not None:  # the table's command: the full run's (the markdown quotes it), then this one
        rows, out = _added(rows, args.add_to), args.add_to
        command = f"python -m tgattn.bench.gpu_compiled --out {args.add_to}` then `{command}"
    write_csv(rows, out / "compiled.csv", FIELDS)
    (out / "compiled.md").write_text(markdown(rows, command))
    bad = failures(rows)
    for line in bad:
        print(line, file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
