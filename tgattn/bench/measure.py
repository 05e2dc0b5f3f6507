"""Timing and peak-memory probes for the attention benchmark."""
from __future__ import annotations

import os
import re
import resource
import time
import weakref
from typing import Callable, Dict, Optional, Sequence, Tuple

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
    """Minimum wall time (ms) of :func:`run_once` over up to ``repeats`` runs after one warm-up run
    (:func:`interleaved` of one function).

    Stops early once ``budget_s`` seconds were spent (slow peers at large n run once).

    Example:
        >>> best_time(lambda: torch.ones(4).sum(), False, [], None, repeats=3, budget_s=1.0) >= 0.0
        True
    """
    wall, _, _ = interleaved({"fn": lambda r: run_once(fn, backward, leaves, grad)}, repeats, budget_s=budget_s)
    return wall["fn"] * 1e3


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


def rss_mb() -> float:
    """This process's resident set now, in MB (Linux: ``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def rss_high_water_mb() -> float:
    """This process's resident-set high-water mark (``VmHWM``) in MB, Linux only."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise OSError("/proc/self/status has no VmHWM line: resident-set peaks are read on Linux only")


def reset_rss_high_water() -> None:
    """Set this process's ``VmHWM`` to its current resident set (Linux: ``5 > /proc/self/clear_refs``),
    so that :func:`rss_high_water_mb` then reads the peak of what runs after the call.

    Example:
        >>> reset_rss_high_water()
        >>> rss_high_water_mb() > 0
        True
    """
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


_TRIED = re.compile(r"tried to allocate (\d+) bytes")


def failed_allocation(err: BaseException) -> Optional[int]:
    """The bytes a failed CPU allocation asked for: ``0`` where the error is an allocation failure
    that does not say its size (``MemoryError``, ``std::bad_alloc``), ``None`` where ``err`` is no
    allocation failure at all.

    Example:
        >>> failed_allocation(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 4096 bytes."))
        4096
        >>> failed_allocation(MemoryError()), failed_allocation(RuntimeError("shape mismatch"))
        (0, None)
    """
    if isinstance(err, MemoryError):
        return 0
    text = str(err)
    found = _TRIED.search(text)
    if found:
        return int(found.group(1))
    return 0 if "bad_alloc" in text or "can't allocate memory" in text or "Cannot allocate memory" in text else None


def memory_capped(cap_bytes: int) -> Callable[[], None]:
    """A ``preexec_fn`` for :mod:`subprocess` that caps the child's data segment at ``cap_bytes``.

    ``RLIMIT_DATA`` (Linux >= 4.7) counts the private writable mappings, which is where malloc and
    torch's CPU allocator put tensors, and not the shared libraries a ``RLIMIT_AS`` cap would also
    charge (about 0.5 GB for torch). The kernel refuses the mapping itself, so an allocation over
    the cap fails at once (torch: ``RuntimeError: ... you tried to allocate N bytes``, Python:
    ``MemoryError``) and the out-of-memory killer never runs, even with overcommit on.
    """
    if cap_bytes <= 0:
        raise ValueError(f"the memory cap must be a positive number of bytes (got {cap_bytes})")

    def cap() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_DATA, (cap_bytes, cap_bytes))

    return cap


def release_free_memory() -> None:
    """Hand the C allocator's free memory back to the system (glibc's ``malloc_trim``), so that
    the resident set holds live memory only; nothing where the C library has no ``malloc_trim``.

    Example:
        >>> release_free_memory()
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        trim = libc.malloc_trim
    except (OSError, AttributeError, TypeError):
        return
    trim(0)


def os_usage() -> Tuple[float, int]:
    """``(system seconds, minor page faults)`` of the calling thread so far (of the process where
    the platform has no per-thread usage)."""
    who = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)
    usage = resource.getrusage(who)
    return usage.ru_stime, usage.ru_minflt


def interleaved(fns: Dict[object, Callable], rounds: int, threads: Optional[Dict[object, int]] = None,
                slow_s: float = float("inf"), on_round: Optional[Callable[[int], None]] = None, *,
                setup: Optional[Dict[object, Callable[[], object]]] = None, alternate: bool = False,
                sync: Optional[Callable[[], None]] = None, on_call: Optional[Callable[[object, float], None]] = None,
                budget_s: float = float("inf")):
    """``(wall, cpu, system)``: minimum wall and thread-CPU seconds of each function, run in turn
    ``rounds`` times after a warm-up, and ``(system seconds, minor page faults)`` of its round of
    least CPU time (:func:`os_usage`).

    Each call gets the round's number (0: the warm-up), for functions that take a new input each
    round; ``threads`` sets torch's threads per function; ``on_round(r)`` runs after each round
    (a progress bar). A function whose warm-up call took more than ``slow_s`` seconds is timed
    once (round 1) only. ``setup[key]()``, where given, runs before each call of ``key`` outside
    the timing (a fresh input, a cache to fill), and the call gets what it returns instead of
    the round's number; ``alternate`` runs the functions in reverse order every other round
    (round 0 included), so that none always follows the same one; ``sync()`` runs before the
    clocks start and before they stop (``torch.cuda.synchronize`` for work on a GPU);
    ``on_call(key, seconds)`` gets each timed call's wall seconds (rounds 1 on: for a median);
    no round starts after round 1 once ``budget_s`` seconds have passed since the first call.

    Example:
        >>> wall, cpu, system = interleaved({"a": lambda r: sum(range(1000)), "b": lambda r: None}, rounds=3)
        >>> sorted(wall), cpu["a"] >= 0.0
        (['a', 'b'], True)
        >>> seen = []
        >>> _ = interleaved({"a": seen.append, "b": seen.append}, 2, setup={"a": lambda: "fresh"}, alternate=True)
        >>> seen
        [0, 'fresh', 'fresh', 1, 2, 'fresh']
    """
    threads, setup = threads or {}, setup or {}
    before = torch.get_num_threads()
    wall = {key: float("inf") for key in fns}
    cpu = dict(wall)
    system = {key: (0.0, 0) for key in fns}
    slow = set()
    order = list(fns.items())
    start = time.perf_counter()
    try:
        for r in range(rounds + 1):
            if r > 1 and time.perf_counter() - start > budget_s:
                break
            for key, fn in order[::-1] if alternate and r % 2 == 0 else order:
                if r > 1 and key in slow:
                    continue
                torch.set_num_threads(threads.get(key, before))
                arg = setup[key]() if key in setup else r
                if sync is not None:
                    sync()
                (s0, f0), t0, c0 = os_usage(), time.perf_counter(), time.thread_time()
                fn(arg)
                if sync is not None:
                    sync()
                seconds, cpu_seconds = time.perf_counter() - t0, time.thread_time() - c0
                del arg  # what setup made goes before the next call's setup
                if r and cpu_seconds < cpu[key]:  # round 0 warms caches, pages and the analysis
                    s1, f1 = os_usage()
                    cpu[key], system[key] = cpu_seconds, (s1 - s0, f1 - f0)
                if r:
                    wall[key] = min(wall[key], seconds)
                    if on_call is not None:
                        on_call(key, seconds)
                elif seconds > slow_s:
                    slow.add(key)
            if on_round is not None:
                on_round(r)
    finally:
        torch.set_num_threads(before)
    return wall, cpu, system
