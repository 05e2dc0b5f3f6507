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

An extension of several translation units (the fused kernel: :data:`FUSED`, and its float16 /
bfloat16 part :data:`FUSED_HALF`, built on first need) is compiled by ninja, one unit a core at
most, the longest first, and the build says how far it is: what it builds and how long the last
build of the extension here took (``built.json``, else the measurement the caller quotes), a
line per unit compiled, a line at least every :data:`~tgattn.engine.build_progress.HEARTBEAT_S` seconds with the units in
the compiler, each with the share of the compiler's work done (the units' measured CPU
seconds), and the time it took. :func:`prebuild` builds extensions ahead of their first use
(``python -m tgattn build``).
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import socket
import sys
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Optional, Sequence, Tuple, Union

import torch

from .build_progress import Progress

logger = logging.getLogger(__name__)

WAIT_S = 600.0  # the longest wait for another process's build of the same folder
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
    cpu: Sequence[float] = (),
    progress: bool = True,
) -> bool:
    """Load the extension built from C++ ``sources``, compiling it first if no process has.

    Args:
        name: the extension's name (the library is ``<name>_<hash>.so`` in :func:`build_dir`).
        sources: the C++ file, or the files, each a translation unit (ninja compiles them side
            by side: ``MAX_JOBS`` at a time if set, else as many as the cores, never more).
        headers: the headers they include (default: none), part of the build folder's key.
        cflags, ldflags: extra compiler and linker flags (default: none).
        fallback: what the caller does without the extension, for the warning (default: "").
        wait: seconds to wait for another live process building the same folder before
            giving up (default: :data:`WAIT_S`).
        label, expect: what the extension is and how long its build takes, measured, for the
            notice when no build of it here recorded its time (default: its name, no time).
        cpu: the compiler's CPU seconds per unit, measured (default: none, each unit alike): the
            units start longest first, and the progress is their share of the total.
        progress: log the build's progress (default: True); False logs nothing but failures.

    Returns:
        ``True`` once the library is loaded (its ``TORCH_LIBRARY`` ops are registered);
        ``False``, with one warning saying why, when it cannot be built or loaded.

    A build logs (``logging``, level WARNING: shown without any logging set up) one line before
    it starts, with what it builds and how long the last build of ``name`` here took, then, for
    several units, a line per unit compiled and at least every
    :data:`~tgattn.engine.build_progress.HEARTBEAT_S` seconds one
    with the share of the compiler's work done and the units in the compiler, and one at the end
    with the time it took.
    """
    try:
        return _build_and_load(name, _paths(sources), headers=headers, cflags=cflags, ldflags=ldflags, wait=wait,
                               label=label, expect=expect, cpu=cpu, progress=progress)
    except Exception as err:  # no compiler, no ninja, a read-only cache, a stuck build: fall back, loudly once
        warnings.warn(f"tgattn: {name} unavailable ({type(err).__name__}: {err})" + (f"; using {fallback}" if fallback else ""))
        return False


def _build_and_load(name: str, units: List[Path], *, headers: Paths, cflags: Sequence[str], ldflags: Sequence[str],
                    wait: float, label: str, expect: str, cpu: Sequence[float], progress: bool) -> bool:
    """:func:`load_extension`, raising what stops it."""
    say = logger.warning if progress else (lambda *args: None)
    if cpu and len(cpu) != len(units):
        raise ValueError(f"cpu={list(cpu)}: expected one measured time per unit ({len(units)})")
    units, weights = _longest_first(units, cpu)  # ninja starts them in this order
    folder = build_dir(name, units, headers=headers, cflags=cflags, ldflags=ldflags)
    library = folder / f"{name}_{folder.name[-16:]}.so"
    if _load_built(folder, library):
        return True
    folder.mkdir(parents=True, exist_ok=True)
    jobs = _jobs(len(units))
    with _exclusive(folder / "build.lock", wait):
        if _load_built(folder, library):  # built by the process we waited for
            return True
        (folder / "lock").unlink(missing_ok=True)  # torch's lock file: stale, since we hold ours
        for stale in folder.glob("*.o"):  # an interrupted build's: the progress counts fresh ones
            stale.unlink()
        last = _last_build(folder, name, len(units))
        estimate = f"the last build here took {last}" if last else expect
        say("tgattn: compiling %s for this machine (once%s%s; cached in %s)", label or name,
            f", {estimate}" if estimate else "", f"; {_say_jobs(len(units), jobs)}" if len(units) > 1 else "", folder)
        start = time.perf_counter()
        from torch.utils import cpp_extension

        with Progress(folder, units, start, say if len(units) > 1 else None, weights), _max_jobs(jobs):
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
        f"{_say_jobs(len(units), jobs)}; " if len(units) > 1 else "", folder)
    return True


@dataclass(frozen=True)
class Extension:
    """A C++ extension of the package: what :func:`load_extension` takes, less ``wait`` and ``progress``,
    and the extension whose library it links against (``needs``: loaded first, its library added to the
    link)."""

    name: str
    sources: Tuple[Path, ...]
    headers: Tuple[Path, ...] = ()
    cflags: Tuple[str, ...] = ()
    ldflags: Tuple[str, ...] = ()
    fallback: str = ""
    label: str = ""
    expect: str = ""
    cpu: Tuple[float, ...] = ()
    needs: Optional["Extension"] = None

    def library(self) -> Path:
        """Where its built library is (or will be)."""
        folder = build_dir(self.name, _longest_first(list(self.sources), self.cpu)[0], headers=self.headers, cflags=self.cflags, ldflags=self._ldflags())
        return folder / f"{self.name}_{folder.name[-16:]}.so"

    def _ldflags(self) -> Tuple[str, ...]:
        return self.ldflags + ((str(self.needs.library()),) if self.needs else ())

    def load(self, *, progress: bool = True, wait: float = WAIT_S) -> bool:
        """:func:`load_extension` of this extension (of ``needs`` first)."""
        if self.needs and not self.needs.load(progress=progress, wait=wait):
            return False
        return load_extension(self.name, self.sources, headers=self.headers, cflags=self.cflags,
                              ldflags=self._ldflags(), fallback=self.fallback, wait=wait, label=self.label,
                              expect=self.expect, cpu=self.cpu, progress=progress)

    def build(self, *, progress: bool = True, wait: float = WAIT_S) -> bool:
        """:meth:`load`, raising what stops the build instead of warning."""
        if self.needs:
            self.needs.build(progress=progress, wait=wait)
        return _build_and_load(self.name, list(self.sources), headers=self.headers, cflags=self.cflags,
                               ldflags=self._ldflags(), wait=wait, label=self.label, expect=self.expect, cpu=self.cpu,
                               progress=progress)


_CSRC = Path(__file__).with_name("csrc")
_HOST = ("ops.cpp", "graph.cpp", "maps.cpp")  # host.cpp's parts: in the key as its headers are
_FLAGS = dict(headers=tuple(sorted([*_CSRC.glob("*.h"), *(_CSRC / f for f in _HOST)])),
              cflags=("-O3", "-march=native", "-fopenmp", "-ffp-contract=fast"), ldflags=("-fopenmp",))

# The fused kernel (tgattn.engine.native loads it): its units (csrc/ops.h), with the compiler's CPU seconds
# each took, measured alone (docs/engine.md#building-the-fused-kernel): the longest start first, and the
# progress is their share.
FUSED = Extension(
    name="tgattn_fused",
    sources=tuple(_CSRC / f for f in ("host.cpp", "backward.cpp", "forward.cpp")),
    cpu=(26.8, 23.6, 8.3),
    fallback="the CSR backend",
    label="the fused C++ kernel",
    expect="about 59 s of CPU (measured, docs/engine.md)",
    **_FLAGS,
)

# Its float16 / bfloat16 kernels, a library that links against FUSED's, built when a float16 / bfloat16
# call first needs them (tgattn.engine.native.half_available), or ahead with `python -m tgattn build --half`.
FUSED_HALF = Extension(
    name="tgattn_fused_half",
    sources=tuple(_CSRC / f for f in ("backward_half.cpp", "backward_bfloat16.cpp", "forward_half.cpp",
                                      "half_kernels.cpp")),
    cpu=(32.3, 31.5, 11.0, 2.4),
    fallback="the CSR backend",
    label="the fused C++ kernel's float16 / bfloat16 part",
    expect="about 77 s of CPU (measured, docs/engine.md)",
    needs=FUSED,
    **_FLAGS,
)

EXTENSIONS = (FUSED, FUSED_HALF)  # every C++ extension of the package


def prebuild(extensions: Sequence[Extension] = (FUSED,), *, progress: bool = True) -> float:
    """Builds C++ extensions of the package (default: the fused kernel, all that float32 / float64 calls
    need) ahead of their first use, so that no call waits on a compiler; a no-op, well under a second,
    where they are built. ``python -m tgattn build`` runs it (``--half``: :data:`EXTENSIONS`, all of them).

    Args:
        extensions: what to build (default: :data:`FUSED`).
        progress: log each build's progress (default: True; see :func:`load_extension`).

    Returns:
        the wall seconds it took.

    Raises:
        RuntimeError: naming the extension that could not be built and why.

    Example:
        >>> _ = prebuild(progress=False)  # builds what is missing (once per machine, torch and source)
        >>> seconds = prebuild()  # built: only the check, nothing logged
    """
    start = time.perf_counter()
    for ext in extensions:
        try:
            ext.build(progress=progress)
        except Exception as err:
            raise RuntimeError(f"could not build {ext.label or ext.name}: {type(err).__name__}: {err}") from err
    return time.perf_counter() - start


def _cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _jobs(units: int) -> int:
    """How many of the ``units`` the build compiles at a time: ``MAX_JOBS`` if set, else one a core (ninja's own
    default, cores + 2, started the three longest units together on 2 cores, each then taking three times as long)."""
    jobs = os.environ.get("MAX_JOBS", "")
    return int(jobs) if jobs.isdigit() and int(jobs) > 0 else max(1, min(units, _cores()))


def _longest_first(units: List[Path], cpu: Sequence[float]) -> Tuple[List[Path], List[float]]:
    """The units, and their measured CPU seconds (default: 1 each), longest first (ties: as given)."""
    weights = list(cpu) or [1.0] * len(units)
    order = sorted(range(len(units)), key=lambda i: -weights[i])
    return [units[i] for i in order], [weights[i] for i in order]


def _say_jobs(units: int, jobs: int) -> str:
    """The notice's words for :func:`_jobs`."""
    return f"{units} units, {jobs} at a time" + (" (MAX_JOBS)" if os.environ.get("MAX_JOBS", "").isdigit() else "")


@contextmanager
def _max_jobs(jobs: int) -> Iterator[None]:
    """``MAX_JOBS=jobs`` while torch's build runs (it hands that to ninja)."""
    before = os.environ.get("MAX_JOBS")
    os.environ["MAX_JOBS"] = str(jobs)
    try:
        yield
    finally:
        if before is None:
            del os.environ["MAX_JOBS"]
        else:
            os.environ["MAX_JOBS"] = before


def _last_build(folder: Path, name: str, units: int) -> str:
    """How long the latest finished build of ``name`` with as many units took in ``folder``'s root
    (another version of its sources), from its ``built.json``; "" when there is none."""
    best: Optional[Tuple[float, dict]] = None
    for done in folder.parent.glob(f"{name}-*/{_DONE}"):
        try:
            record, when = json.loads(done.read_text()), done.stat().st_mtime
        except (OSError, ValueError):
            continue
        if _usable(record, units) and (best is None or when > best[0]):
            best = when, record
    if best is None:
        return ""
    record = best[1]
    cores = f" on {record['cores']} cores" if _count(record.get("cores")) else ""
    return f"{record['seconds']:.0f} s{cores}"


def _count(value) -> bool:
    """Whether ``value`` is a whole number >= 1 (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _usable(record, units: int) -> bool:
    """Whether ``record`` (a ``built.json`` read back) is a finished build of ``units`` units with its time:
    another build's record may be from an older tgattn, damaged or hand-made, and is skipped then."""
    if not isinstance(record, dict) or record.get("units", 1) != units:
        return False
    seconds = record.get("seconds")
    return isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and math.isfinite(seconds) and seconds >= 0


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
