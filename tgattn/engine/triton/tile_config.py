"""The launch options of the ``tc`` backend's tile kernels: warps and pipeline stages per kernel.

:func:`tile_config` gives, for inputs of a dtype and head dim on tiles of ``rows x keys``, the
``(num_warps, num_stages)`` of the forward, dq and dk-dv kernels: the row of the committed
table :data:`TABLE` (written by ``python -m tgattn.bench.gpu --tune`` on a GPU, the card named
in each row) for the card this process runs on, else :data:`DEFAULT`.

Why the defaults: a Hopper warpgroup (4 warps) multiplies 64 rows at a time, so 4 warps on a
64-row tile hold each score once (8 warps held the whole tile in both warpgroups: twice the
exponentials and 1.5-1.67x the products, issue 56); 3 stages keep two tiles' copies in flight
while the third is multiplied (the loops carry the next tile's id, :mod:`.tile_kernels`).
Every option the table may hold is compiled for sm_80 and sm_90 by :mod:`.aot`.

Example:
    >>> import torch
    >>> tile_config(torch.bfloat16, 64, 64, 64, card="none")
    TileConfig(forward=(4, 3), dq=(4, 3), dkdv=(4, 3))
"""
from __future__ import annotations

import csv
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Tuple

import torch

TABLE = Path(__file__).resolve().parents[3] / "data" / "gpu" / "tile_configs.csv"
TABLE_FIELDS = ("card", "dtype", "head_dim", "block_m", "block_n", "kernel", "num_warps", "num_stages")
KERNELS = ("forward", "dq", "dkdv")
WARPS = (4, 8)  # the options a tuned row may hold (checked on reading; compiled by aot)
STAGES = (2, 3, 4, 5)


@dataclass(frozen=True)
class TileConfig:
    """``(num_warps, num_stages)`` of each tile kernel."""

    forward: Tuple[int, int] = (4, 3)
    dq: Tuple[int, int] = (4, 3)
    dkdv: Tuple[int, int] = (4, 3)


DEFAULT = TileConfig()


def _key(dtype: torch.dtype, head_dim: int, rows: int, keys: int) -> Tuple[str, int, int, int]:
    d = 16
    while d < head_dim:  # the kernels' padded head dim (next power of two, at least 16)
        d *= 2
    return str(dtype).replace("torch.", ""), d, rows, keys


@functools.lru_cache(maxsize=None)
def read_table(path: str = str(TABLE)) -> Dict[str, Dict[tuple, TileConfig]]:
    """``{card: {(dtype, head_dim, rows, keys): TileConfig}}`` from a tuning table (``{}`` without one).

    Rows name a kernel each; a key missing a kernel takes :data:`DEFAULT`'s options for it."""
    if not Path(path).exists():
        return {}
    found: Dict[str, Dict[tuple, dict]] = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            warps, stages = int(row["num_warps"]), int(row["num_stages"])
            if row["kernel"] not in KERNELS or warps not in WARPS or stages not in STAGES:
                raise ValueError(f"{path}: a row holds kernel {row['kernel']!r}, {warps} warps, {stages} stages "
                                 f"(allowed: {KERNELS}, warps {WARPS}, stages {STAGES})")
            key = (row["dtype"], int(row["head_dim"]), int(row["block_m"]), int(row["block_n"]))
            found.setdefault(row["card"], {}).setdefault(key, {})[row["kernel"]] = (warps, stages)
    return {card: {key: TileConfig(**kernels) for key, kernels in rows.items()} for card, rows in found.items()}


def current_card() -> Optional[str]:
    """The name of this process's CUDA device (``torch.cuda.get_device_name``), ``None`` without one."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def tile_config(dtype: torch.dtype, head_dim: int, rows: int, keys: int, *, card: Optional[str] = None) -> TileConfig:
    """The launch options for inputs of ``dtype`` and ``head_dim`` on tiles of ``rows x keys``, on
    ``card`` (default: this process's device): its row of :data:`TABLE`, else :data:`DEFAULT`."""
    card = current_card() if card is None else card
    return read_table().get(card or "", {}).get(_key(dtype, head_dim, rows, keys), DEFAULT)
