"""Compile a C++ extension once per machine and load it: a keyed build folder and a crash-safe lock.

:func:`torch.utils.cpp_extension.load` builds into ``~/.cache/torch_extensions/<python>_cpu/<name>``
and guards the folder with a lock *file*. Two things go wrong with that here:

* a build killed by SIGKILL, SIGTERM or the OOM killer leaves the lock file, and every later
  process waits for it forever;
* the folder is named by the extension alone, so every virtual environment (its torch
  headers sit at another path) and every version of the source rebuilds it in turn.

:func:`load_extension` builds into a folder named by the torch version, the Python version,
the CPU's feature flags (the build uses ``-march=native``) and a hash of the source and
flags, under ``$TGATTN_BUILD_DIR``, else ``$TORCH_EXTENSIONS_DIR``, else torch's per-user
default (``~/.cache/torch_extensions``). A finished build leaves ``built.json`` beside the
library; later processes, in any environment with the same torch, load the library at once.
Builds of one folder are serialised by an ``fcntl.flock`` on ``build.lock``, which the
kernel releases when its owner dies however it dies; whoever holds it next removes torch's
stale lock file and builds. A process that waits longer than ``wait`` seconds for a live
owner gives up with a warning, and the caller falls back.

An extension of several translation units (the fused kernel: :data:`FUSED`) is compiled by
ninja on every core, and the build says how far it is: what it builds and how long the last
build of the extension here took (``built.json``, else the measurement the caller quotes), a
line per unit compiled, a line at least every :data:`HEARTBEAT_S` seconds with the units in
the compiler, and the time it took. :func:`prebuild` builds every extension of the package
ahead of its first use (``python -m tgattn build``).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import socket
import sys
import threading
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Optional, Sequence, Tuple, Union

import torch

logger = logging.getLogger(__name__)

WAIT_S = 600.0  # the longest wait for another process's build of the same folder
HEARTBEAT_S = 10.0  # the longest silence of a build with progress on
_DONE = "built.json"

Paths = Union[str, Path, Sequence[Union[str, Path]]]


def _paths(files: Paths) -> List[Path]:
    """One path or several, as a list."""
    return [Path(files)] if isinstance(files, (str, Path)) else [Path(f) for f in files]


def cpu_tag() -> str:
    """A short hash of the CPU's feature flags (``/proc/cpuinfo``; empty flags elsewhere).

    Example:
        >>> len(cpu_tag())
        8
    """
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    return hashlib.sha1(flags.encode()).hexdigest()[:8]


def build_dir(name: str, sources: Paths, *, headers: Paths = (), cflags: Sequence[str] = (),
              ldflags: Sequence[str] = ()) -> Path:
    """The folder that holds the build of ``sources`` (one C++ file or several, and the ``headers``
    they include) with these flags for this torch, Python and CPU.

    Nothing here depends on the virtual environment (``sys.prefix``): every environment with
    the same torch shares the build.

    Example:
        >>> import tempfile
        >>> src = Path(tempfile.mkdtemp()) / "ext.cpp"
        >>> _ = src.write_text("int one() { return 1; }")
        >>> build_dir("ext", src).name.startswith("ext-torch" + torch.__version__.replace("+", "_"))
        True
    """
    digest = hashlib.sha256()
    for path in (*_paths(sources), *_paths(headers)):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    for part in (*cflags, "|", *ldflags, torch.version.git_version or "", cpu_tag()):
        digest.update(b"\0" + str(part).encode())
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    key = re.sub(r"[^A-Za-z0-9._-]", "_", f"{name}-torch{torch.__version__}-{python}-{digest.hexdigest()[:16]}")
    root = os.environ.get("TGATTN_BUILD_DIR") or os.environ.get("TORCH_EXTENSIONS_DIR")
    if not root:
        from torch.utils.cpp_extension import get_default_build_root

        root = get_default_build_root()
    return Path(root).expanduser() / key


def load_extension(
    name: str,
    sources: Paths,
    *,
    headers: Paths = (),
    cflags: Sequence[str] = (),
    ldflags: Sequence[str] = (),
    fallback: str = "",
    wait: float = WAIT_S,
    label: str = "",
    expect: str = "",
    progress: bool = True,
) -> bool:
    """Load the extension built from C++ ``sources``, compiling it first if no process has.

    Args:
        name: the extension's name (the library is ``<name>_<hash>.so`` in :func:`build_dir`).
        sources: the C++ file, or the files, each a translation unit (ninja compiles them side
            by side: ``MAX_JOBS`` at a time if set, else ninja's default for the machine's cores).
        headers: the headers they include (default: none), part of the build folder's key.
        cflags, ldflags: extra compiler and linker flags (default: none).
        fallback: what the caller does without the extension, for the warning (default: "").
        wait: seconds to wait for another live process building the same folder before
            giving up (default: :data:`WAIT_S`).
        label, expect: what the extension is and how long its build takes, measured, for the
            notice when no build of it here recorded its time (default: its name, no time).
        progress: log the build's progress (default: True); False logs nothing but failures.

    Returns:
        ``True`` once the library is loaded (its ``TORCH_LIBRARY`` ops are registered);
        ``False``, with one warning saying why, when it cannot be built or loaded.

    A build logs (``logging``, level WARNING: shown without any logging set up) one line before
    it starts, with what it builds and how long the last build of ``name`` here took, then, for
    several units, a line per unit compiled and at least every :data:`HEARTBEAT_S` seconds one
    with the units in the compiler, and one at the end with the time it took.
    """
    say = logger.warning if progress else (lambda *args: None)
    try:
        units = _paths(sources)
        folder = build_dir(name, units, headers=headers, cflags=cflags, ldflags=ldflags)
        library = folder / f"{name}_{folder.name[-16:]}.so"
        if _load_built(folder, library):
            return True
        folder.mkdir(parents=True, exist_ok=True)
        with _exclusive(folder / "build.lock", wait):
            if _load_built(folder, library):  # built by the process we waited for
                return True
            (folder / "lock").unlink(missing_ok=True)  # torch's lock file: stale, since we hold ours
            for stale in folder.glob("*.o"):  # an interrupted build's: the progress counts fresh ones
                stale.unlink()
            last = _last_build(folder, name, len(units))
            estimate = f"the last build here took {last}" if last else expect
            say("tgattn: compiling %s for this machine (once%s%s; cached in %s)", label or name,
                f", {estimate}" if estimate else "", f"; {_jobs(len(units))}" if len(units) > 1 else "", folder)
            start = time.perf_counter()
            from torch.utils import cpp_extension

            with _Progress(folder, units, start, say if len(units) > 1 else None):
                cpp_extension.load(
                    name=library.stem,
                    sources=[str(u) for u in units],
                    extra_cflags=list(cflags),
                    extra_ldflags=list(ldflags),
                    build_directory=str(folder),
                    is_python_module=False,
                    verbose=False,
                )
            seconds = time.perf_counter() - start
            (folder / _DONE).write_text(json.dumps({
                "library": library.name, "seconds": round(seconds, 1), "torch": torch.__version__,
                "units": len(units), "cores": _cores(), "max_jobs": os.environ.get("MAX_JOBS"),
            }))
        say("tgattn: compiled %s in %.1f s, once for this torch, CPU and source (%scached in %s)", name, seconds,
            f"{_jobs(len(units))}; " if len(units) > 1 else "", folder)
        return True
    except Exception as err:  # no compiler, no ninja, a read-only cache, a stuck build: fall back, loudly once
        warnings.warn(f"tgattn: {name} unavailable ({type(err).__name__}: {err})" + (f"; using {fallback}" if fallback else ""))
        return False


@dataclass(frozen=True)
class Extension:
    """A C++ extension of the package: what :func:`load_extension` takes, less ``wait`` and ``progress``."""

    name: str
    sources: Tuple[Path, ...]
    headers: Tuple[Path, ...] = ()
    cflags: Tuple[str, ...] = ()
    ldflags: Tuple[str, ...] = ()
    fallback: str = ""
    label: str = ""
    expect: str = ""

    def load(self, *, progress: bool = True, wait: float = WAIT_S) -> bool:
        """:func:`load_extension` of this extension."""
        return load_extension(self.name, self.sources, headers=self.headers, cflags=self.cflags, ldflags=self.ldflags,
                              fallback=self.fallback, wait=wait, label=self.label, expect=self.expect,
                              progress=progress)


_CSRC = Path(__file__).with_name("csrc")

# The fused kernel (tgattn.engine.native loads it): a unit per seam (csrc/ops.h), listed longest first,
# as .ninja_log of the build measured in docs/engine.md timed them, for ninja starts them in this order
# (then the short ones fill the cores at the end).
FUSED = Extension(
    name="tgattn_fused",
    sources=tuple(_CSRC / f for f in (
        "backward_bfloat16.cpp", "backward_half.cpp", "backward.cpp", "forward.cpp", "maps.cpp", "ops.cpp", "graph.cpp",
    )),
    headers=tuple(sorted(_CSRC.glob("*.h"))),
    cflags=("-O3", "-march=native", "-fopenmp", "-ffp-contract=fast"),
    ldflags=("-fopenmp",),
    fallback="the CSR backend",
    label="the fused C++ kernel",
    expect="about 65 s on 2 idle cores, 113 s on one (measured, docs/engine.md)",
)

EXTENSIONS = (FUSED,)  # every C++ extension of the package: what prebuild builds


def prebuild(*, progress: bool = True) -> float:
    """Builds every C++ extension of the package (:data:`EXTENSIONS`) ahead of its first use, so that
    no call waits on a compiler; a no-op, well under a second, where they are built. ``python -m
    tgattn build`` runs it.

    Args:
        progress: log each build's progress (default: True; see :func:`load_extension`).

    Returns:
        the wall seconds it took.

    Raises:
        RuntimeError: naming the extension that could not be built (the warning says why).

    Example:
        >>> _ = prebuild(progress=False)  # builds what is missing (once per machine, torch and source)
        >>> seconds = prebuild()  # built: only the check, nothing logged
    """
    start = time.perf_counter()
    for ext in EXTENSIONS:
        if not ext.load(progress=progress):
            raise RuntimeError(f"tgattn: could not build {ext.label or ext.name} (see the warning above)")
    return time.perf_counter() - start


def _cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _jobs(units: int) -> str:
    """How many of the ``units`` the build compiles at a time."""
    jobs = os.environ.get("MAX_JOBS", "")
    return f"{units} units, {jobs} at a time (MAX_JOBS)" if jobs.isdigit() else f"{units} units on {_cores()} cores"


def _last_build(folder: Path, name: str, units: int) -> str:
    """How long the latest finished build of ``name`` with as many units took in ``folder``'s root
    (another version of its sources), from its ``built.json``; "" when there is none."""
    best: Optional[Tuple[float, dict]] = None
    for done in folder.parent.glob(f"{name}-*/{_DONE}"):
        try:
            record, when = json.loads(done.read_text()), done.stat().st_mtime
        except (OSError, ValueError):
            continue
        if record.get("units", 1) == units and "seconds" in record and (best is None or when > best[0]):
            best = when, record
    if best is None:
        return ""
    record = best[1]
    cores = f" on {record['cores']} cores" if "cores" in record else ""
    return f"{record['seconds']:.0f} s{cores}"


class _Progress:
    """While a build of several units runs: a line per unit whose object file appeared, and at least
    every :data:`HEARTBEAT_S` seconds one with the units in the compiler (processes in the build folder
    whose arguments name the unit: Linux's ``/proc``; elsewhere the units left)."""

    def __init__(self, folder: Path, units: Sequence[Path], start: float, say):
        self.folder, self.units, self.start, self.say = folder, list(units), start, say
        self.done: List[Path] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="tgattn-build-progress", daemon=True)

    def __enter__(self):
        if self.say is not None:
            self.thread.start()
        return self

    def __exit__(self, kind, *exc):
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join()
            if kind is None:
                self._scan()  # units finished since the last look

    def _scan(self) -> bool:
        """Says which units finished since the last look; whether any did."""
        news = [u for u in self.units if u not in self.done and (self.folder / f"{u.stem}.o").exists()]
        for unit in news:
            self.done.append(unit)
            self.say("tgattn: [%d/%d] compiled %s (%.0f s)", len(self.done), len(self.units), unit.name,
                     time.perf_counter() - self.start)
        return bool(news)

    def _watch(self) -> None:
        quiet_since = time.perf_counter()
        while not self.stop.wait(0.5):
            now = time.perf_counter()
            if self._scan():
                quiet_since = now
            elif now - quiet_since >= HEARTBEAT_S:
                quiet_since = now
                left = [u for u in self.units if u not in self.done]
                busy = _compiling(self.folder, left)
                what = ("linking" if not left else f"compiling {', '.join(u.name for u in busy)}" if busy
                        else f"{len(left)} left")
                self.say("tgattn: [%d/%d] %.0f s, %s", len(self.done), len(self.units), now - self.start, what)


def _compiling(folder: Path, units: Sequence[Path]) -> List[Path]:
    """Those of ``units`` that a process working in ``folder`` (ninja runs the compiler there) has
    among its arguments: the units in the compiler now (none where there is no ``/proc``)."""
    here, wanted = os.path.realpath(folder), {os.fsencode(u): u for u in units}
    busy = set()
    try:
        entries = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return []
    for pid in entries:
        try:
            if os.readlink(f"/proc/{pid}/cwd") != here:
                continue
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                args = fh.read().split(b"\0")
        except OSError:
            continue
        busy.update(wanted[a] for a in args if a in wanted)
    return [u for u in units if u in busy]


def _load_built(folder: Path, library: Path) -> bool:
    """Load ``library`` if a finished build left it; a damaged one is rebuilt."""
    if not ((folder / _DONE).is_file() and library.is_file()):
        return False
    try:
        torch.ops.load_library(str(library))
    except OSError:
        (folder / _DONE).unlink(missing_ok=True)
        return False
    return True


@contextmanager
def _exclusive(path: Path, wait: float) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path``; the kernel drops it when the holder dies.

    The holder writes its pid and host into the file, for the message of whoever waits.

    Raises:
        TimeoutError: after ``wait`` seconds of another live holder.
    """
    import fcntl

    with open(path, "a+") as fh:
        deadline, waited = time.monotonic() + wait, False
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                fh.seek(0)
                holder = fh.read().strip() or "another process"
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"waited {wait:g} s for {path}, held by {holder}") from None
                if not waited:
                    logger.warning("tgattn: waiting up to %g s for the build in %s by %s", wait, path.parent, holder)
                    waited = True
                time.sleep(0.2)
        fh.truncate(0)
        fh.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
        fh.flush()
        try:
            yield
        finally:
            fh.truncate(0)
            fcntl.flock(fh, fcntl.LOCK_UN)
