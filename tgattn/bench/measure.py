"""Timing and peak-memory probes for the attention benchmark."""
from __future__ import annotations

import time
import weakref
from typing import Callable, Optional, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def run_once(fn: Callable, backward: bool, leaves: Sequence[torch.Tensor], grad: Optional[torch.Tensor]) -> None:
    """One forward (+ backward) of ``fn``; on CUDA it waits for the kernels to finish."""
    if not backward:
        with torch.no_grad():
            fn()
    else:
        for t in leaves:
            t.grad = None
        out = fn()
        out.backward(grad.view_as(out))
    if leaves and leaves[0].is_cuda:
        torch.cuda.synchronize(leaves[0].device)


def best_time(fn: Callable, backward: bool, leaves, grad, *, repeats: int, budget_s: float) -> float:
    """Minimum wall time (ms) over up to ``repeats`` runs after one warm-up run.

    Stops early once ``budget_s`` seconds were spent (slow peers at large n run once).
    """
    start = time.perf_counter()
    run_once(fn, backward, leaves, grad)  # warm-up: compilation, caches, first-touch pages
    best = float("inf")
    for i in range(repeats):
        t0 = time.perf_counter()
        run_once(fn, backward, leaves, grad)
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() - start > budget_s:
            break
    return best * 1e3


class _LiveBytes(TorchDispatchMode):
    """Tracks the bytes of storages created by operators while active, and their peak.

    Counts each storage once (views share it) and releases it when the last tensor seen on
    it dies. Memory that kernels allocate internally without returning it is not seen, nor
    are sparse tensors (the CSR backend's index arrays alias the cached structure; its
    values are ``[E]`` per head).
    """

    def __init__(self):
        super().__init__()
        self.live = {}  # storage pointer -> [bytes, tensors alive]
        self.current = self.peak = 0

    def _release(self, ptr: int) -> None:
        entry = self.live.get(ptr)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self.live[ptr]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta" or t.layout != torch.strided:
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr == 0:
                continue
            if ptr not in self.live:
                self.live[ptr] = [storage.nbytes(), 0]
                self.current += storage.nbytes()
                self.peak = max(self.peak, self.current)
            self.live[ptr][1] += 1
            weakref.finalize(t, self._release, ptr)
        return out


def peak_extra_mb(fn: Callable, backward: bool, leaves, grad) -> float:
    """Peak MB of tensors created during one forward (+ backward) beyond the inputs (run warm).

    On CUDA it reads the caching allocator's peak instead (everything allocated, kernels' own
    workspaces included).
    """
    if leaves and leaves[0].is_cuda:
        torch.cuda.synchronize(leaves[0].device)
        base = torch.cuda.memory_allocated(leaves[0].device)
        torch.cuda.reset_peak_memory_stats(leaves[0].device)
        run_once(fn, backward, leaves, grad)
        return (torch.cuda.max_memory_allocated(leaves[0].device) - base) / 2**20
    probe = _LiveBytes()
    with probe:
        run_once(fn, backward, leaves, grad)
    return probe.peak / 2**20
