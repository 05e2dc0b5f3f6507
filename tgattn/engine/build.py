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
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import socket
import sys
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence, Union

import torch

logger = logging.getLogger(__name__)

WAIT_S = 600.0  # the longest wait for another process's build of the same folder
_DONE = "built.json"


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


def build_dir(name: str, source: Union[str, Path], *, cflags: Sequence[str] = (), ldflags: Sequence[str] = ()) -> Path:
    """The folder that holds the build of ``source`` with these flags for this torch, Python and CPU.

    Nothing here depends on the virtual environment (``sys.prefix``): every environment with
    the same torch shares the build.

    Example:
        >>> import tempfile
        >>> src = Path(tempfile.mkdtemp()) / "ext.cpp"
        >>> _ = src.write_text("int one() { return 1; }")
        >>> build_dir("ext", src).name.startswith("ext-torch" + torch.__version__.replace("+", "_"))
        True
    """
    digest = hashlib.sha256(Path(source).read_bytes())
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
    source: Union[str, Path],
    *,
    cflags: Sequence[str] = (),
    ldflags: Sequence[str] = (),
    fallback: str = "",
    wait: float = WAIT_S,
    label: str = "",
    expect: str = "",
) -> bool:
    """Load the extension built from one C++ ``source``, compiling it first if no process has.

    Args:
        name: the extension's name (the library is ``<name>_<hash>.so`` in :func:`build_dir`).
        source: the C++ file.
        cflags, ldflags: extra compiler and linker flags (default: none).
        fallback: what the caller does without the extension, for the warning (default: "").
        wait: seconds to wait for another live process building the same folder before
            giving up (default: :data:`WAIT_S`).
        label, expect: what the extension is and how long its build takes, for the notice
            (default: its name, no time).

    Returns:
        ``True`` once the library is loaded (its ``TORCH_LIBRARY`` ops are registered);
        ``False``, with one warning saying why, when it cannot be built or loaded.

    A build logs one line (``logging``, level WARNING: shown without any logging set up)
    before it starts, so that a long first call is not a silent one, and one after it with
    the time it took.
    """
    try:
        folder = build_dir(name, source, cflags=cflags, ldflags=ldflags)
        library = folder / f"{name}_{folder.name[-16:]}.so"
        if _load_built(folder, library):
            return True
        folder.mkdir(parents=True, exist_ok=True)
        with _exclusive(folder / "build.lock", wait):
            if _load_built(folder, library):  # built by the process we waited for
                return True
            (folder / "lock").unlink(missing_ok=True)  # torch's lock file: stale, since we hold ours
            logger.warning("tgattn: compiling %s for this machine (once%s; cached in %s)",
                           label or name, f", {expect}" if expect else "", folder)
            start = time.perf_counter()
            from torch.utils import cpp_extension

            cpp_extension.load(
                name=library.stem,
                sources=[str(source)],
                extra_cflags=list(cflags),
                extra_ldflags=list(ldflags),
                build_directory=str(folder),
                is_python_module=False,
                verbose=False,
            )
            seconds = time.perf_counter() - start
            (folder / _DONE).write_text(json.dumps({"library": library.name, "seconds": round(seconds, 1), "torch": torch.__version__}))
        logger.warning(
            "tgattn: compiled %s in %.1f s, once for this torch, CPU and source (cached in %s)", name, seconds, folder
        )
        return True
    except Exception as err:  # no compiler, no ninja, a read-only cache, a stuck build: fall back, loudly once
        warnings.warn(f"tgattn: {name} unavailable ({type(err).__name__}: {err})" + (f"; using {fallback}" if fallback else ""))
        return False


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
