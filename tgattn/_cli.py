"""Shared pieces of tgattn's command lines: lazy exports, argument types, the plot extra, one-line errors.

Lazy exports (PEP 562, :func:`lazy_exports`): a package names its public objects, each imported
on first use, so that ``import tgattn`` and every ``--help`` cost no torch or PyG import; the
first ``tgattn.GraphAttention`` imports :mod:`tgattn.nn.attention` and keeps the result.

Every command line turns bad input into argparse's one-line ``error:`` and exit status 2:
values are checked as they are parsed (the types below), settings when the command starts,
and a ``ValueError`` or ``OSError`` from the command itself (a damaged checkpoint, a prompt
outside the vocabulary, a folder that cannot be written) ends the same way instead of in a
traceback.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import math
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

# The backends tgattn.functional.graph_attention accepts (it re-exports this tuple): defined here,
# where no torch is imported, so that ``python -m tgattn verify --help`` lists them at once.
BACKENDS = ("auto", "gather", "dense", "tile", "fused", "csr", "triton", "tc")


def lazy_exports(package: str, exports: Dict[str, str]) -> Tuple[Callable[[str], object], Callable[[], List[str]]]:
    """``(__getattr__, __dir__)`` for ``package``.

    Args:
        package: the package's ``__name__``.
        exports: public name -> the submodule (relative to ``package``) that defines it; a
            name equal to its submodule's is the submodule itself. Other submodules are
            imported on attribute access too (``tgattn.engine``), as an eager package did.

    Example:
        >>> getattr_, dir_ = lazy_exports("json", {"JSONDecoder": "decoder", "scanner": "scanner"})
        >>> getattr_("JSONDecoder").__name__, getattr_("scanner").__name__, "JSONDecoder" in dir_()
        ('JSONDecoder', 'json.scanner', True)
    """

    def __getattr__(name: str):
        if name.startswith("_"):
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        target = exports.get(name, name)
        try:
            module = importlib.import_module(f"{package}.{target}")
        except ModuleNotFoundError as err:
            if err.name != f"{package}.{target}":
                raise
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        value = module if target == name else getattr(module, name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> List[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__


def _number(kind: type, rule: str, ok: Callable) -> Callable[[str], object]:
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"must be {rule} (got {text!r})")
        if kind is float and not math.isfinite(value):  # inf passes a range check, then overflows in the command
            raise argparse.ArgumentTypeError(f"must be finite (got {text!r})")
        return value

    return parse


positive_int = _number(int, "an integer >= 1", lambda v: v >= 1)
non_negative_int = _number(int, "an integer >= 0", lambda v: v >= 0)
seed_int = _number(int, "an integer in [0, 2**63)", lambda v: 0 <= v < 2**63)
positive_float = _number(float, "a number > 0", lambda v: v > 0)  # NaN fails the comparison, inf the finiteness
non_negative_float = _number(float, "a number >= 0", lambda v: v >= 0)


def int_in(low: int, high: int) -> Callable[[str], int]:
    """The argument type of an integer in ``[low, high]``.

    Example:
        >>> int_in(1, 1024)("8")
        8
    """
    return _number(int, f"an integer in [{low}, {high}]", lambda v: low <= v <= high)


def positive_ints(text: str) -> List[int]:
    """A comma-separated list of integers >= 1: ``"256,1024"`` -> ``[256, 1024]``.

    Example:
        >>> positive_ints("256,1024")
        [256, 1024]
    """
    return [positive_int(part) for part in text.split(",")]


def device_name(text: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:N``, checked before torch is imported (``torch.device`` of a typo is a traceback).

    Example:
        >>> device_name("cuda:1")
        'cuda:1'
    """
    if not re.fullmatch(r"cpu|cuda(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"must be cpu, cuda or cuda:N (got {text!r})")
    return text


def boolean(text: str) -> bool:
    """``true/false``, ``yes/no``, ``on/off`` or ``1/0`` (any case); anything else is an error.

    Example:
        >>> boolean("True"), boolean("0")
        (True, False)
    """
    value = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}
    if text.lower() not in value:
        raise argparse.ArgumentTypeError(f"must be true or false (got {text!r})")
    return value[text.lower()]


def runs_dir(name: str) -> Path:
    """The default output folder of a benchmark: ``$TGATTN_RUNS/<name>``, else ``~/.cache/tgattn/runs/<name>``.

    Outside any checkout, so that running a benchmark never overwrites the results the project
    ships under ``data/``; pass ``--out data/<name>`` to replace those on purpose.

    Example:
        >>> os.environ["TGATTN_RUNS"] = "/tmp/tgattn-runs"
        >>> runs_dir("bench").as_posix()
        '/tmp/tgattn-runs/bench'
        >>> del os.environ["TGATTN_RUNS"]
        >>> runs_dir("bench").relative_to(Path.home()).as_posix()
        '.cache/tgattn/runs/bench'
    """
    root = os.environ.get("TGATTN_RUNS") or Path("~/.cache/tgattn/runs")
    return Path(root).expanduser() / name


def out_help(name: str) -> str:
    """``--out``'s help text for a benchmark writing to :func:`runs_dir` ``(name)``."""
    return f"output folder (default: $TGATTN_RUNS/{name}, else ~/.cache/tgattn/runs/{name})"


def check_writable(folder, option: str = "--out") -> None:
    """Create ``folder`` and write a byte in it; an ``OSError`` naming ``option`` and the folder when that fails.

    For commands that write their results at the end of a long run: a folder that cannot be
    written (read-only, on a full disk, ``/dev/full``, under a file) is found before the work.

    Example:
        >>> check_writable("/dev/full")
        Traceback (most recent call last):
        ...
        OSError: --out /dev/full is not a folder
    """
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise OSError(f"{option} {folder} is not a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".tgattn-write-test-") as fh:
            fh.write(b"x")
            fh.flush()
            os.fsync(fh.fileno())  # a full disk may refuse only here
    except OSError as err:
        raise OSError(f"{option} {folder} cannot be written: {err.strerror or err}") from None


def missing_plot_extra() -> Optional[str]:
    """The error to show when matplotlib is not installed, else ``None``."""
    if importlib.util.find_spec("matplotlib") is None:
        return 'this command draws with matplotlib, which is not installed: pip install "tgattn[plot]"'
    return None


def run(parser: argparse.ArgumentParser, command: Callable[[argparse.Namespace], int], args) -> int:
    """``command(args)``; a ``ValueError`` or ``OSError`` becomes a one-line error and exit status 2."""
    try:
        return command(args)
    except (ValueError, OSError) as err:
        message = " ".join(str(err).split()) or type(err).__name__
        print(f"{parser.prog}: error: {message}", file=sys.stderr)
        return 2
