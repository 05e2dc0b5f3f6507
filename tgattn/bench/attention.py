"""The attention sweep: every pattern x size x peer x {forward, forward+backward}.

Rows are dictionaries (one per measurement), written to CSV by :mod:`tgattn.bench.report`.
"""
from __future__ import annotations

import time
from typing import Dict, Iterable, List, Optional, Sequence

import torch

from .. import engine
from . import peers as peer_impls
from .measure import best_time, peak_extra_mb
from .patterns import Pattern

MEM_LIMIT = 12 * 2**30  # bytes a single peer may need on CPU (the machines have 24 GB)
GPU_MEM_FRACTION = 0.75  # of the GPU's memory a single peer may need
SLOW_S = 20.0  # a peer slower than this at one size is not run at larger sizes
FLEX_SIZES = (4096,)  # each (pattern, n) costs FlexAttention a compile of ~1 minute or more here


def _bytes_needed(peer: str, n: int, edges: int, heads: int, dim: int, backward: bool, cuda: bool = False,
                  itemsize: int = 4) -> float:
    """Rough working set of a peer (to skip runs that cannot fit).

    ``itemsize``: bytes per element of q / k / v (4 for float32, 2 for bfloat16 / float16); the
    tensors and the float masks of the inputs' dtype scale with it; boolean masks, block tables
    and tgattn's per-edge scores (counted at 4 bytes, as float32) do not.
    """
    factor = 3 if backward else 1
    if cuda and peer == "sdpa_mask":
        # the bool mask, the float mask the memory-efficient kernel reads, and in the backward that
        # mask's gradient (an H100 at n = 131,072 in bfloat16: the forward ran, the backward asked 32 GiB)
        return (1.0 + itemsize * (2 if backward else 1)) * n * n
    if cuda and peer == "flex":
        # create_block_mask evaluates the mask_mod on every pair: 8 bytes each (an H100 at n = 131,072
        # was asked for 128 GiB)
        return 8.0 * n * n
    if peer == "flex_csr":
        return 20.0 * (n / 128) ** 2 + 4.0 * n * heads * dim * itemsize * factor  # block tables, q / k / v / out
    if peer in ("gather", "transformerconv"):
        return 4.0 * edges * heads * dim * itemsize * factor  # several [E, H, d] tensors
    if peer == "gatconv":
        return 1.0 * itemsize * edges * heads * (dim + 8) * factor  # messages [E, H, d] and edge scores
    if peer == "sdpa_mask":
        return n * n * (1 + itemsize * heads * factor)  # the mask, and scores if a math kernel runs
    if peer == "flex":
        return 4.0 * n * n / 128  # block masks
    return 4.0 * edges * heads * 3 + 8.0 * n * heads * dim * itemsize


def _inputs(n: int, heads: int, dim: int, seed: int = 0, device="cpu", dtype: torch.dtype = torch.float32):
    """q, k, v (leaves) and the output gradient ``[n, heads, dim]`` in ``dtype``: drawn in float32
    from a seeded generator and then cast, so that every dtype rounds the same numbers."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, grad = (torch.randn(n, heads, dim, generator=g).to(device, dtype) for _ in range(4))
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), grad


def sweep(
    patterns: Dict[str, Pattern],
    sizes: Dict[str, Sequence[int]],
    peers: Sequence[str],
    *,
    heads: int = 8,
    dim: int = 64,
    repeats: int = 3,
    budget_s: float = 10.0,
    memory: bool = True,
    progress: bool = True,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> List[dict]:
    """Measure every (pattern, n, peer, mode); returns one row per measurement (or skip).

    Every peer gets the same q, k, v and gradient in ``dtype`` (no peer is upcast: one that
    cannot run in ``dtype`` gives a row whose note says why)."""
    from tqdm.auto import tqdm

    from ..engine import triton as triton_backend

    cuda = torch.device(device).type == "cuda"
    mem_limit = GPU_MEM_FRACTION * torch.cuda.get_device_properties(device).total_memory if cuda else MEM_LIMIT

    itemsize = torch.empty((), dtype=dtype).element_size()
    tasks = [(name, n) for name in patterns for n in sizes[name]]
    rows: List[dict] = []
    slow = set()  # (pattern, peer, mode) that ran out of time at a smaller n
    for name, n in tqdm(tasks, desc="attention bench", disable=not progress):
        pattern = patterns[name]
        edge_index = pattern.make(n).to(device)
        edges = edge_index.shape[1]
        q, k, v, grad = _inputs(n, heads, dim, device=device, dtype=dtype)
        t0 = time.perf_counter()
        s = engine.structure_of(edge_index, n, n)
        backend = engine.plan(s, fusable=not cuda, triton=triton_backend.usable(q))
        if cuda:
            torch.cuda.synchronize(device)
        analysis_ms = (time.perf_counter() - t0) * 1e3
        base = dict(pattern=name, n=n, edges=edges, density=edges / n**2, heads=heads, dim=dim)
        for peer in peers:
            for backward in (False, True):
                mode = "fwd+bwd" if backward else "fwd"
                row = dict(base, peer=peer, mode=mode, ms=None, peak_mb=None, note="")
                rows.append(row)
                if backward and peer in peer_impls.FORWARD_ONLY_CPU and not cuda:
                    row["note"] = "no backward"
                    continue
                if (name, peer, mode) in slow:
                    row["note"] = f"skipped: > {SLOW_S:g} s at a smaller n"
                    continue
                if peer in peer_impls.FLEX and n not in FLEX_SIZES and not cuda:
                    row["note"] = f"skipped: compiled only for n in {FLEX_SIZES}"
                    continue
                if _bytes_needed(peer, n, edges, heads, dim, backward, cuda, itemsize) > mem_limit:
                    row["note"] = "skipped: does not fit in memory"
                    continue
                try:
                    fn = peer_impls.build(peer, q, k, v, edge_index, pattern)
                except Exception as err:  # a peer that cannot be built here (e.g. no compiler, or this dtype)
                    row["note"] = f"unavailable: {type(err).__name__}: {str(err)[:80]}"
                    continue
                if fn is None:
                    row["note"] = "not applicable"
                    continue
                try:
                    row["ms"] = best_time(fn, backward, (q, k, v), grad, repeats=repeats, budget_s=budget_s)
                    if memory and (cuda or peer not in peer_impls.NO_MEMORY_PROBE):
                        row["peak_mb"] = peak_extra_mb(fn, backward, (q, k, v), grad)
                except Exception as err:  # e.g. Flex failing to compile on this machine
                    row["note"] = f"failed: {type(err).__name__}: {str(err)[:80]}"
                    continue
                if peer == "tgattn":
                    row["note"] = f"backend={backend}; analysis {analysis_ms:.1f} ms"
                if row["ms"] > SLOW_S * 1e3:
                    slow.add((name, peer, mode))
        del q, k, v, grad
    return rows


def sizes_for(patterns: Iterable[str], quick: bool, largest: Optional[int] = None, device: str = "cpu") -> Dict[str, List[int]]:
    """Sizes per pattern: quick = small ones; full = 256 up to what each pattern can reach.

    On CUDA: window 16k to 128k and 1M tokens, random / top-k at 16k (the issue's targets).
    """
    out = {}
    for name in patterns:
        if torch.device(device).type == "cuda":
            sizes = _gpu_sizes(name, quick)
        elif quick:
            sizes = [128, 256]
        elif name in ("full", "causal"):
            sizes = [256, 1024, 4096, 8192]  # E grows as n^2
        elif name.startswith(("random", "topk")):
            sizes = [256, 1024, 4096]
        elif name.startswith("window"):
            sizes = [256, 1024, 4096, 16384, 65536, 131072]
        else:
            sizes = [256, 1024, 4096, 16384, 65536]
        out[name] = [n for n in sizes if largest is None or n <= largest]
    return out


def _gpu_sizes(name: str, quick: bool) -> List[int]:
    if quick:
        return [4096, 16384]
    if name in ("full", "causal"):
        return [4096, 16384]
    if name.startswith(("random", "topk")):
        return [16384]
    if name.startswith("window"):
        return [16384, 32768, 65536, 131072, 1 << 20]
    return [16384, 65536]
