"""Starting a process group: under ``torchrun``, or as local processes on this machine.

* ``torchrun --nproc-per-node N script.py`` sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``MASTER_ADDR`` and ``MASTER_PORT``; the script calls :func:`init` (NCCL with a GPU per
  rank, else gloo) and finds the same group on every node.
* :func:`spawn` runs ``fn(rank, world_size, *args)`` in ``world_size`` fresh local processes
  joined by a gloo group on the loopback interface (127.0.0.1, a free port) and returns each
  rank's result: for tests, benchmarks and examples without ``torchrun``.
  At most :data:`MAX_RANKS` ranks (more than this machine's cores: a warning).

No job waits forever on a peer that is gone or stuck. A rank waits at most ``timeout_s``
(:data:`PEER_TIMEOUT_S` = 60 s unless set) for the others, to join and in each collective;
ranks that disagree on ``WORLD_SIZE`` fail at once. :func:`spawn` watches its processes: when
one dies or stays stopped (``SIGSTOP``) that long, it stops the others and raises
``ChildProcessError`` with one line naming the rank and why. Under ``torchrun`` the ranks'
own timeouts end the job and ``torchrun`` stops the rest.
"""
from __future__ import annotations

import math
import os
import re
import signal
import socket
import tempfile
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, List, Optional, Tuple

PEER_TIMEOUT_S = 60.0
TIMEOUT_HELP = ("seconds a rank waits for the others (to join, and in each exchange) before the job ends, naming "
                "the rank that is gone or stopped (default: %(default)s)")
POLL_S = 0.2  # how often spawn looks at its processes
# What a collective says when it lost a peer (gloo: "Connection closed by peer", "Read error ...: Connection
# reset by peer", "Timed out waiting ...ms for recv", each "... caused by a remote worker ..."; NCCL; torch's DistError).
LOST_PEER = ("gloo", "NCCL", "torch.distributed.", "by peer", "remote worker", "Timed out", "Broken pipe")
CAUSE_WAIT_S = 10.0  # how long spawn waits for the rank that made its peers fail (its exit may lag on a busy machine)
# The most local ranks spawn starts: each is a Python process holding torch (~0.3 GB) and gloo joins every
# pair (a rank holds a socket per peer, and the usual open-file limit is 1024). 100,000 ranks ran out of memory
# before the watch began.
MAX_RANKS = 1024


def cores() -> int:
    """The CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def check_world_size(world_size, name: str = "world_size") -> None:
    """Raise ``ValueError`` unless ``world_size`` is an integer in [1, :data:`MAX_RANKS`]; warn above :func:`cores`.

    Example:
        >>> check_world_size(True)
        Traceback (most recent call last):
        ...
        ValueError: world_size must be an integer in [1, 1024] (got True)
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or not 1 <= world_size <= MAX_RANKS:
        raise ValueError(f"{name} must be an integer in [1, {MAX_RANKS}] (got {world_size!r})")
    if world_size > cores():
        warnings.warn(f"{world_size} local ranks on {cores()} cores: they share the cores (slower than fewer ranks)",
                      stacklevel=3)


def check_timeout(value, name: str) -> None:
    """Raise ``ValueError`` unless ``value`` is a finite number > 0 (``timedelta`` overflows on inf, inside a rank)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be a finite number > 0 (got {value!r})")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _environment() -> Tuple[int, int, str, int]:
    """``(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)`` from the environment, checked."""
    values = {}
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        if name not in os.environ:
            raise ValueError(f"{name} is not set: start the ranks with torchrun, or set RANK, WORLD_SIZE, "
                             "MASTER_ADDR and MASTER_PORT")
        values[name] = os.environ[name]
    try:
        rank, world, port = int(values["RANK"]), int(values["WORLD_SIZE"]), int(values["MASTER_PORT"])
    except ValueError:
        raise ValueError(f"RANK, WORLD_SIZE and MASTER_PORT must be integers (got RANK={values['RANK']!r}, "
                         f"WORLD_SIZE={values['WORLD_SIZE']!r}, MASTER_PORT={values['MASTER_PORT']!r})") from None
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"need 0 <= RANK < WORLD_SIZE (got RANK={rank}, WORLD_SIZE={world})")
    return rank, world, values["MASTER_ADDR"], port


SEEN_WAIT_S = 5.0  # how long rank 0 keeps the store up for a disagreeing rank to read its WORLD_SIZE


def _meet(rank: int, world: int, host: str, port: int, timeout_s: float):
    """The rendezvous store, once every rank has joined it and all agree on ``WORLD_SIZE``.

    Rank 0 serves a ``TCPStore`` at ``host:port``; each rank writes its ``WORLD_SIZE`` there and
    compares it with rank 0's (rank 0 with everyone's) as it appears, so a disagreement ends both
    sides at once, and a missing rank after ``timeout_s`` (torch's own rendezvous waited the whole
    group timeout, 600 s, without a word).
    """
    import torch.distributed as dist

    where = f"{host}:{port}"
    try:
        store = dist.TCPStore(host, port, world, is_master=rank == 0, timeout=timedelta(seconds=timeout_s),
                              wait_for_workers=False)
    except RuntimeError as err:  # DistNetworkError and DistStoreError are RuntimeErrors
        who = "could not serve the rendezvous" if rank == 0 else "found no rank 0"
        raise TimeoutError(f"rank {rank} of WORLD_SIZE={world} {who} at {where} within {timeout_s:g} s "
                           f"({_tidy(str(err)) or type(err).__name__})") from None
    store.set(f"tgattn/world_size/{rank}", str(world))
    waiting = [0] if rank else list(range(1, world))
    deadline = time.monotonic() + timeout_s
    while waiting:
        for other in list(waiting):
            key = f"tgattn/world_size/{other}"
            try:
                theirs = int(store.get(key)) if store.check([key]) else None
            except RuntimeError:  # rank 0's store went away (it failed, or saw a disagreement first)
                raise TimeoutError(f"rank {rank} of WORLD_SIZE={world} lost the rendezvous at {where}: "
                                   "rank 0 ended before every rank had joined") from None
            if theirs is not None:
                if rank:  # rank 0 serves the store: it waits for this word before it ends on a disagreement
                    store.set(f"tgattn/seen/{rank}", "1")
                elif theirs != world:
                    try:  # so that rank `other` reads rank 0's WORLD_SIZE and names the disagreement too
                        store.wait([f"tgattn/seen/{other}"], timedelta(seconds=min(timeout_s, SEEN_WAIT_S)))
                    except RuntimeError:
                        pass
                if theirs != world:
                    raise ValueError(f"rank {rank} has WORLD_SIZE={world} but rank {other} has WORLD_SIZE={theirs} "
                                     f"at {where}: start every rank with the same WORLD_SIZE")
                waiting.remove(other)
        if waiting and time.monotonic() > deadline:
            missing = ", ".join(map(str, waiting))
            raise TimeoutError(f"rank {rank} of WORLD_SIZE={world}: rank{'s' * (len(waiting) > 1)} {missing} did not join "
                               f"at {where} within {timeout_s:g} s (not started, gone, or started with another port)")
        if waiting:
            time.sleep(0.05)
    return store


def init(backend: Optional[str] = None, *, timeout_s: float = PEER_TIMEOUT_S,
         join_timeout_s: Optional[float] = None) -> Tuple[int, int]:
    """Join the process group that ``torchrun`` (or :func:`spawn`) describes in the environment.

    Args:
        backend: ``"nccl"`` or ``"gloo"`` (default: NCCL when CUDA is available, else gloo).
            With NCCL, this process takes the GPU ``LOCAL_RANK``.
        timeout_s: how long a collective may wait for the other ranks (default:
            :data:`PEER_TIMEOUT_S`, 60 s); a collective still waiting then raises.
        join_timeout_s: how long to wait for the others to join (default: ``timeout_s``).

    Returns:
        ``(rank, world_size)``.

    Raises:
        ValueError: the environment lacks a variable, or two ranks disagree on ``WORLD_SIZE``
            (both fail at once, each naming its own and the other's).
        TimeoutError: a rank did not join within ``join_timeout_s`` (the message names it).
    """
    import torch
    import torch.distributed as dist

    check_timeout(timeout_s, "timeout_s")
    if join_timeout_s is not None:
        check_timeout(join_timeout_s, "join_timeout_s")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s)
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # torchrun's agent holds the store and
            dist.init_process_group(backend, timeout=timeout)  # its rendezvous already agreed on the world
        else:
            rank, world, host, port = _environment()
            store = _meet(rank, world, host, port, timeout_s if join_timeout_s is None else join_timeout_s)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    return dist.get_rank(), dist.get_world_size()


def _worker(_, rank: int, fn: Callable, world_size: int, port: int, threads: int, timeout_s: float, folder: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's own connections stay on loopback too
    torch.set_num_threads(threads)
    args = torch.load(Path(folder) / "args.pt", weights_only=False)  # spawn's own file
    # Joining may wait on the others' imports (minutes on a loaded machine): spawn itself ends
    # the job when a rank dies or stops, so only collectives need the short timeout.
    init("gloo", timeout_s=timeout_s, join_timeout_s=max(timeout_s, 600.0))
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, Path(folder) / f"{rank}.pt")
    finally:
        dist.destroy_process_group()


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (``SIGSTOP`` / ``SIGTSTP``: state T in /proc; False elsewhere)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] in "Tt"


def _why(rank: int, exitcode: int, error_file: str) -> str:
    """One line: how rank ``rank`` ended (the last line of its traceback, or its signal)."""
    import pickle

    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"rank {rank} was killed by {name}"
    try:
        with open(error_file, "rb") as fh:
            trace = pickle.load(fh)
    except (OSError, EOFError, pickle.UnpicklingError):
        return f"rank {rank} exited with status {exitcode}"
    lines = trace.strip().splitlines()
    return f"rank {rank} failed: {_tidy(lines[-1]) if lines else 'no traceback'}"


def _tidy(message: str) -> str:
    """The first line of ``message`` without gloo's source location (``[/path/pair.cc:553] ``)."""
    lines = message.strip().splitlines()
    return re.sub(r"\[/\S+:\d+\] ", "", lines[0].strip()) if lines else ""


def _lost_peer(why: str) -> bool:
    """Whether a rank's failure (:func:`_why`) is a collective that lost or waited out a peer: an effect, not the cause."""
    return any(word in why for word in LOST_PEER)


def _stop_all(processes) -> None:
    """End every process still there at once (SIGKILL: a stopped process would hold SIGTERM pending)."""
    for process in processes:
        if process.is_alive():
            process.kill()
    for process in processes:
        process.join(10)


def spawn(fn: Callable[..., Any], world_size: int, *args, threads: int = 1, timeout_s: Optional[float] = 300.0,
          peer_timeout_s: float = PEER_TIMEOUT_S) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local gloo ranks; their results.

    ``fn`` must be importable (defined at module level) and its result picklable by
    ``torch.save``. While the ranks run, this process watches them: the first rank that fails
    (raises, or is killed) or stays stopped (``SIGSTOP``) for ``peer_timeout_s`` ends the job:
    the other ranks are killed and one line says which rank and why. A rank waiting on a peer
    gives up after ``peer_timeout_s`` (its collective raises), so a stuck job ends within about
    ``peer_timeout_s`` seconds, and a dead peer's within a second or two.

    Args:
        fn: the per-rank function.
        world_size: number of processes, at most :data:`MAX_RANKS` (more than the cores: a warning).
        threads: torch threads per process (default: 1).
        timeout_s: wall-clock limit for the whole run, start-up included (default: 300; ``None``: none).
        peer_timeout_s: how long a rank waits for the others in a collective, and how long a
            rank may stay stopped (default: :data:`PEER_TIMEOUT_S`, 60).

    The ranks start while the watch runs, so a rank that fails during start-up, or a timeout,
    ends the job before the last rank has started.

    Raises:
        ValueError: ``world_size`` is not an integer in [1, :data:`MAX_RANKS`] (a bool is not one),
            or a timeout is not a finite number > 0.
        ChildProcessError: a rank failed, was killed or stayed stopped (the others are ended);
            the message names the rank and why, in one line.
        TimeoutError: the ranks did not finish within ``timeout_s`` (they are ended).
    """
    import multiprocessing.connection

    import torch
    import torch.multiprocessing as mp

    check_world_size(world_size)
    check_timeout(peer_timeout_s, "peer_timeout_s")
    if timeout_s is not None:
        check_timeout(timeout_s, "timeout_s")
    with tempfile.TemporaryDirectory(prefix="tgattn-spawn-") as folder:
        # The arguments go through a file: a start message larger than a pipe's buffer (a corpus, a graph)
        # made each start wait for the rank before it to import torch (~5 s a rank, before any watch).
        torch.save(args, Path(folder) / "args.pt")
        port = free_port()
        processes, error_files = [], []
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        stopped_since = {}  # rank -> when it was first seen stopped
        first_failure = None
        try:
            while True:
                began = time.monotonic()  # start ranks for at most POLL_S, then watch: the watch covers start-up
                while len(processes) < world_size and time.monotonic() - began < POLL_S:
                    worker_args = (len(processes), fn, world_size, port, threads, peer_timeout_s, folder)
                    context = mp.start_processes(_worker, args=worker_args, nprocs=1, join=False, start_method="spawn")
                    processes += context.processes
                    error_files += context.error_files
                multiprocessing.connection.wait([p.sentinel for p in processes if p.exitcode is None], timeout=POLL_S)
                now = time.monotonic()
                stopped_since = {r: stopped_since.get(r, now) for r, p in enumerate(processes)
                                 if p.exitcode is None and _stopped(p.pid)}
                failed = [r for r, p in enumerate(processes) if p.exitcode not in (None, 0)]
                if failed and first_failure is None:
                    first_failure = now
                if failed or any(now - since > peer_timeout_s for since in stopped_since.values()):
                    # The cause first: a rank killed or stopped, then one that raised, then the peers that
                    # lost it (given CAUSE_WAIT_S to appear: the peers of a failing rank often end first).
                    killed = [r for r in failed if processes[r].exitcode < 0]
                    causes = [_why(r, processes[r].exitcode, error_files[r]) for r in killed]
                    causes += [f"rank {r} is stopped (SIGSTOP, for {now - since:.0f} s)" for r, since in stopped_since.items()]
                    raised = [_why(r, processes[r].exitcode, error_files[r]) for r in failed if r not in killed]
                    if causes or not all(map(_lost_peer, raised)) or now - first_failure > CAUSE_WAIT_S:
                        causes += sorted(raised, key=_lost_peer)
                        raise ChildProcessError(f"{fn.__name__} on {world_size} ranks ended: " + "; ".join(causes[:2]))
                if len(processes) == world_size and all(p.exitcode == 0 for p in processes):
                    break
                if deadline is not None and now > deadline:
                    started = "" if len(processes) == world_size else f" ({len(processes)} started)"
                    raise TimeoutError(f"{world_size} ranks of {fn.__name__} did not finish in {timeout_s:g} s{started}")
        finally:
            _stop_all(processes)
        return [torch.load(Path(folder) / f"{r}.pt", weights_only=False) for r in range(world_size)]


def launch(fn: Callable[..., Any], nproc: int, *args, threads: int = 1, peer_timeout_s: float = PEER_TIMEOUT_S,
           timeout_s: Optional[float] = None) -> None:
    """Run ``fn(rank, world_size, *args)`` on every rank of a job.

    Under ``torchrun`` (``RANK`` and ``WORLD_SIZE`` set) this process is one rank: it joins the
    group with :func:`init` (``timeout_s=peer_timeout_s``) and runs ``fn``; a collective that
    waited ``peer_timeout_s`` for a gone or stopped peer raises ``TimeoutError`` naming this
    rank. Otherwise ``nproc`` local gloo processes are started with :func:`spawn` (no wall-clock
    limit unless ``timeout_s``). The command-line modules of this package start this way.
    """
    import torch.distributed as dist

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        rank, world_size = init(timeout_s=peer_timeout_s)
        try:
            fn(rank, world_size, *args)
        except RuntimeError as err:  # gloo / NCCL timeouts and lost peers: one line, not a trace per rank
            if not (isinstance(err, dist.DistError) or _lost_peer(str(err))):
                raise
            raise TimeoutError(f"rank {rank} of {world_size} lost its peers (a rank is gone, or stuck past the "
                               f"{peer_timeout_s:g} s timeout): {_tidy(str(err)) or type(err).__name__}") from None
        finally:
            dist.destroy_process_group()
        return
    spawn(fn, nproc, *args, threads=threads, timeout_s=timeout_s, peer_timeout_s=peer_timeout_s)
