"""Starting a process group: under ``torchrun``, or as local processes on this machine.

* ``torchrun --nproc-per-node N script.py`` sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``MASTER_ADDR`` and ``MASTER_PORT``; the script calls :func:`init` (NCCL with a GPU per
  rank, else gloo) and finds the same group on every node.
* :func:`spawn` runs ``fn(rank, world_size, *args)`` in ``world_size`` fresh local processes
  joined by a gloo group on the loopback interface (127.0.0.1, a free port), waits at most
  ``timeout_s`` seconds and returns each rank's result: for tests, benchmarks and examples
  without ``torchrun``.
"""
from __future__ import annotations

import os
import socket
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, List, Optional, Tuple

import torch


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init(backend: Optional[str] = None, *, timeout_s: float = 600.0) -> Tuple[int, int]:
    """Join the process group that ``torchrun`` (or :func:`spawn`) describes in the environment.

    Args:
        backend: ``"nccl"`` or ``"gloo"`` (default: NCCL when CUDA is available, else gloo).
            With NCCL, this process takes the GPU ``LOCAL_RANK``.
        timeout_s: how long a collective may wait for the other ranks (default: 600).

    Returns:
        ``(rank, world_size)``.
    """
    import torch.distributed as dist

    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def _worker(rank: int, fn: Callable, world_size: int, port: int, threads: int, timeout_s: float,
            folder: str, args: tuple) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's own connections stay on loopback too
    torch.set_num_threads(threads)
    init("gloo", timeout_s=timeout_s)
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, Path(folder) / f"{rank}.pt")
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable[..., Any], world_size: int, *args, threads: int = 1, timeout_s: float = 300.0) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local gloo ranks; their results.

    ``fn`` must be importable (defined at module level) and its result picklable by
    ``torch.save``. The processes are stopped when ``timeout_s`` passes.

    Args:
        fn: the per-rank function.
        world_size: number of processes.
        threads: torch threads per process (default: 1).
        timeout_s: wall-clock limit for the whole run (default: 300).

    Raises:
        TimeoutError: when the ranks did not finish in time (they are terminated).
        torch.multiprocessing.ProcessRaisedException: when a rank raised (the others are stopped).
    """
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="tgattn-spawn-") as folder:
        worker_args = (fn, world_size, free_port(), threads, timeout_s, folder, args)
        context = mp.start_processes(_worker, args=worker_args, nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        while not context.join(timeout=max(deadline - time.monotonic(), 0.0) + 0.1):
            if time.monotonic() > deadline:
                for process in context.processes:
                    if process.is_alive():
                        process.terminate()
                for process in context.processes:
                    process.join(5)
                raise TimeoutError(f"{world_size} ranks of {fn.__name__} did not finish in {timeout_s:.0f} s")
        return [torch.load(Path(folder) / f"{r}.pt", weights_only=False) for r in range(world_size)]


def launch(fn: Callable[..., Any], nproc: int, *args, threads: int = 1, timeout_s: float = 3600.0) -> None:
    """Run ``fn(rank, world_size, *args)`` on every rank of a job.

    Under ``torchrun`` (``RANK`` and ``WORLD_SIZE`` set) this process is one rank: it joins the
    group with :func:`init` and runs ``fn``. Otherwise ``nproc`` local gloo processes are
    started with :func:`spawn`. The command-line modules of this package start this way.
    """
    import torch.distributed as dist

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        rank, world_size = init()
        try:
            fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        return
    spawn(fn, nproc, *args, threads=threads, timeout_s=timeout_s)
