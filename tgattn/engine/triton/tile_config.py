"""The launch options of the ``tc`` backend's tile kernels: tile shape, warps and pipeline stages per kernel.

:func:`tile_config` gives, for inputs of a dtype and head dim on tiles of ``rows x keys``, the
``(num_warps, num_stages)`` of the forward, dq and dk-dv kernels: the row of the committed
table :data:`TABLE` (written by ``python -m tgattn.bench.gpu --tune`` on a GPU, the card named
in each row) for the card this process runs on, else :func:`default_config`. :func:`tuned_shape`
gives the tile shape that table names for a dtype and head dim (the planner's choice,
:func:`~.tile_plan.choose_blocks`). :func:`candidates` lists every configuration the sweep may
pick: what :mod:`.aot` compiles for sm_80 / sm_90 (``data/gpu/tune_candidates.csv``) and what a
table row must be one of.

Why the defaults (:func:`default_config`, compiled by :mod:`.aot` without spills): a Hopper
warpgroup (4 warps) multiplies 64 rows at a time, so 4 warps on a 64-row tile hold each score
once (8 warps held the whole tile in both warpgroups: twice the exponentials and 1.5-1.67x the
products, issue 56); 3 stages keep two tiles' copies in flight while the third is multiplied
(the loops carry the next tile's id, :mod:`.tile_kernels`). The dk-dv programs take 32 keys each
(two per key block; at 64 they spilled). dq runs out of registers at 4 warps on sm_80 and at
d = 128 on sm_90 and takes 8, which then compute its products twice (sm_90 at d = 128, sm_80 at
d = 64: the repeats left).

Example:
    >>> import torch
    >>> tile_config(torch.bfloat16, 64, 64, 64, arch=90, card="none")
    TileConfig(forward=(4, 3), dq=(4, 3), dkdv=(4, 3), dkdv_split=2)
    >>> tile_config(torch.bfloat16, 128, 64, 64, arch=90, card="none").dq
    (8, 3)
    >>> tile_config(torch.bfloat16, 128, 64, 64, arch=80, card="none")
    TileConfig(forward=(4, 3), dq=(8, 3), dkdv=(8, 3), dkdv_split=2)
    >>> tile_config(torch.bfloat16, 64, 128, 128, arch=90, card="none").dkdv_split  # 32 keys a program
    4
"""
from __future__ import annotations

import csv
import functools
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

TABLE = Path(__file__).resolve().parents[3] / "data" / "gpu" / "tile_configs.csv"
TABLE_FIELDS = ("card", "dtype", "head_dim", "block_m", "block_n", "kernel", "num_warps", "num_stages")
KERNELS = ("forward", "dq", "dkdv")
# What a tuned row may hold (checked on reading; each combination compiled by aot): tile rows x keys
# (rows: queries x the grouped heads that share a key head), warps, pipeline stages. A Hopper
# warpgroup multiplies 64 rows: 64-row tiles on 4 warps and 128-row tiles on 8 hold each score once
# (64 rows on 8 warps, the d = 128 backward's default where 4 spill, twice). 128 x 128 is
# FlexAttention's H100 forward default. Left out: 128-row tiles on 4 warps (they spilled 4-6 KB a
# thread on sm_80, and took 10-40 s a compile) and 64 x 128 tiles, to keep the sweep's compiles
# short (192 on the card's 16 cores; 2 x 192 for aot's table, about 20 minutes of one busy core).
SHAPES = ((64, 64), (128, 64), (128, 128))
SHAPE_WARPS = {(64, 64): (4, 8), (128, 64): (8,), (128, 128): (8,)}  # the warps tried at each shape
STAGES = (2, 3, 4, 5)
TUNED_DTYPES = ("bfloat16", "float16")
TUNED_DIMS = (64, 128)  # head dims the sweep tunes (a table's head_dim is the kernels' padded one)


@dataclass(frozen=True)
class TileConfig:
    """``(num_warps, num_stages)`` of each tile kernel (the fields' defaults: sm_90's at d <= 64)."""

    forward: Tuple[int, int] = (4, 3)
    dq: Tuple[int, int] = (4, 3)
    dkdv: Tuple[int, int] = (4, 3)
    dkdv_split: int = 1  # programs per key block of the dk-dv kernel (keys / split each): the target's, not tuned


@dataclass(frozen=True)
class Candidate:
    """One configuration the sweep may pick: a tile kernel at a dtype, padded head dim, tile shape and
    launch options."""

    kernel: str
    dtype: str
    head_dim: int
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def candidates() -> List[Candidate]:
    """Every configuration the sweep (``python -m tgattn.bench.gpu --tune``) may pick.

    Example:
        >>> found = candidates()
        >>> len(found), found[0]
        (192, Candidate(kernel='forward', dtype='bfloat16', head_dim=64, block_m=64, block_n=64, num_warps=4, num_stages=2))
    """
    return [Candidate(kernel, dtype, d, *shape, warps, stages)
            for dtype in TUNED_DTYPES for d in TUNED_DIMS for shape in SHAPES
            for kernel in KERNELS for warps in SHAPE_WARPS[shape] for stages in STAGES]


def default_config(arch: int, head_dim: int, keys: int = 64) -> TileConfig:
    """The options without a tuned row, for compute capability ``arch`` (80, 90), ``head_dim`` and
    tiles of ``keys`` keys (the dk-dv programs per key block follow from it: 32 keys a program)."""
    wide = head_dim > 64
    # dk-dv: programs of 32 keys (two per 64-key block), 8 warps at d = 128. Programs of 64 keys spilled
    # 8-48 bytes on sm_80 at every option tried (4 / 8 warps, 1-3 stages), and on sm_90 under triton
    # 3.9 48-144 bytes on 4 warps; 8 warps ran their 64 x 64 scores in both warpgroups. On sm_90 the
    # 32-key products are mma.sync, not wgmma (which takes 64 rows a warpgroup).
    dkdv = dict(dkdv=(8, 3) if wide else (4, 3), dkdv_split=max(1, keys // 32))
    if arch >= 90:  # dq at d = 128: 4 warps spilled 12-20 bytes (its float32 accumulator and scores)
        # (d <= 32: 64-key dk-dv programs fit, and 32-key ones spilled 28 bytes under triton 3.9)
        split = dkdv["dkdv_split"] if head_dim > 32 else max(1, keys // 64)
        return TileConfig(dq=(8, 3) if wide else (4, 3), **{**dkdv, "dkdv_split": split})
    # sm_80: dq on 4 warps spilled 12-16 bytes with the remainder's merge (d = 64); on 8 its mma.sync
    # layout puts 16 rows a warp over the 64 at d = 64, so its products run twice there
    return TileConfig(dq=(8, 3), **dkdv)


def _key(dtype: torch.dtype, head_dim: int, rows: int, keys: int) -> Tuple[str, int, int, int]:
    d = 16
    while d < head_dim:  # the kernels' padded head dim (next power of two, at least 16)
        d *= 2
    return str(dtype).replace("torch.", ""), d, rows, keys


@functools.lru_cache(maxsize=None)
def read_table(path: str = str(TABLE)) -> Dict[str, Dict[tuple, Dict[str, Tuple[int, int]]]]:
    """``{card: {(dtype, head_dim, rows, keys): {kernel: (warps, stages)}}}`` from a tuning table (``{}``
    without one).

    Rows name a kernel each; a key must name all three, and a card one tile shape per dtype and head
    dim. A row outside :func:`candidates` (what aot compiled) is refused."""
    if not Path(path).exists():
        return {}
    found: Dict[str, Dict[tuple, dict]] = {}
    compiled = set(candidates())
    with open(path) as f:
        for row in csv.DictReader(f):
            key = (row["dtype"], int(row["head_dim"]), int(row["block_m"]), int(row["block_n"]))
            warps, stages = int(row["num_warps"]), int(row["num_stages"])
            if Candidate(row["kernel"], *key, warps, stages) not in compiled:
                raise ValueError(
                    f"{path}: {row['card']} {row['kernel']} {key[0]} d={key[1]} {key[2]} x {key[3]} tiles, {warps} warps, "
                    f"{stages} stages is not a compiled candidate (kernels {KERNELS}, dtypes {TUNED_DTYPES}, head dims "
                    f"{TUNED_DIMS}, shapes: warps {SHAPE_WARPS}, stages {STAGES})")
            found.setdefault(row["card"], {}).setdefault(key, {})[row["kernel"]] = (warps, stages)
    for card, rows in found.items():
        for key, kernels in rows.items():
            if set(kernels) != set(KERNELS):
                raise ValueError(f"{path}: {card} {key} names kernels {sorted(kernels)}, not all of {KERNELS}")
        shapes = {}
        for dtype, d, block_m, block_n in rows:
            shapes.setdefault((dtype, d), []).append((block_m, block_n))
        for (dtype, d), named in shapes.items():
            if len(named) > 1:
                raise ValueError(f"{path}: {card} {dtype} d={d} names tile shapes {sorted(named)}, not one")
    return {card: {key: kernels for key, kernels in rows.items()} for card, rows in found.items()}


TABLE_IN_FORCE = {"path": str(TABLE)}  # the table tile_config reads: the committed one, or a sweep's (use_table)


def use_table(path: str) -> None:
    """This process's tile kernels take their launch options from the table at ``path`` instead of
    :data:`TABLE` (the GPU suite, after its sweep); a table outside the compiled options is refused
    before it is in force. The file is read anew (a sweep may have rewritten it since)."""
    read_table.cache_clear()
    read_table(str(path))
    TABLE_IN_FORCE["path"] = str(path)


def current_device() -> Tuple[Optional[str], int]:
    """``(name, arch)`` of this process's CUDA device (``(None, 90)`` without one: the interpreter
    ignores launch options)."""
    if not torch.cuda.is_available():
        return None, 90
    major, minor = torch.cuda.get_device_capability()
    return torch.cuda.get_device_name(), major * 10 + minor


def tile_config(dtype: torch.dtype, head_dim: int, rows: int, keys: int, *, arch: Optional[int] = None,
                card: Optional[str] = None) -> TileConfig:
    """The launch options for inputs of ``dtype`` and ``head_dim`` on tiles of ``rows x keys``, on
    ``card`` of compute capability ``arch`` (default: this process's device): its row of
    :data:`TABLE`, else :func:`default_config`."""
    name, device_arch = current_device()
    card, arch = name if card is None else card, device_arch if arch is None else arch
    tuned = read_table(TABLE_IN_FORCE["path"]).get(card or "", {}).get(_key(dtype, head_dim, rows, keys), {})
    return replace(default_config(arch, head_dim, keys), **tuned)


def tuned_shape(dtype: torch.dtype, head_dim: int, *, card: Optional[str] = None) -> Optional[Tuple[int, int]]:
    """The ``(rows, keys)`` of the tiles the table in force names for ``dtype`` and ``head_dim`` on
    ``card`` (default: this process's device), or ``None`` without such a row.

    Example:
        >>> tuned_shape(torch.bfloat16, 64, card="none") is None
        True
    """
    card = current_device()[0] if card is None else card
    dtype_name, d = _key(dtype, head_dim, 0, 0)[:2]
    for name, dim, rows, keys in read_table(TABLE_IN_FORCE["path"]).get(card or "", {}):
        if (name, dim) == (dtype_name, d):
            return rows, keys
    return None
