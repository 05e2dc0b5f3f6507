"""How far a build of several units is (:func:`tgattn.engine.build.load_extension`'s progress lines).

A line per unit whose object file appeared, and at least every :data:`HEARTBEAT_S` seconds one with the
units in the compiler, each with the share of the compiler's work done: the measured CPU seconds of the
units compiled, and the CPU the compiler has spent so far on those in it (Linux's ``/proc``).
"""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import List, Optional, Sequence

HEARTBEAT_S = 10.0  # the longest silence of a build with progress on


class Progress:
    """While a build of several units runs: a line per unit whose object file appeared, and at least
    every :data:`HEARTBEAT_S` seconds one with the units in the compiler (processes in the build folder
    whose arguments name the unit: Linux's ``/proc``; elsewhere the units left). Each line gives the share
    of the compiler's work done: the measured CPU seconds of the units compiled (``weights``) and the CPU
    the compiler has spent so far on those in it, out of the measured total."""

    def __init__(self, folder: Path, units: Sequence[Path], start: float, say, weights: Sequence[float] = ()):
        self.folder, self.units, self.start, self.say = folder, list(units), start, say
        self.weights = dict(zip(self.units, weights or [1.0] * len(self.units)))
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

    def share(self, busy: Optional[dict] = None) -> float:
        """The share of the work done, in percent: the units compiled, and those in ``busy`` (unit: CPU
        seconds so far) up to 95 % of their measured time each (a unit may take longer than measured)."""
        total = sum(self.weights.values())
        done = sum(self.weights[u] for u in self.done)
        done += sum(min(seconds, 0.95 * self.weights[u]) for u, seconds in (busy or {}).items() if u not in self.done)
        return 100.0 * done / total

    def _scan(self) -> bool:
        """Says which units finished since the last look; whether any did."""
        news = [u for u in self.units if u not in self.done and (self.folder / f"{u.stem}.o").exists()]
        # the share counts the units still in the compiler too, as the heartbeat's does
        busy = compiling(self.folder, [u for u in self.units if u not in self.done and u not in news]) if news else {}
        for unit in news:
            self.done.append(unit)
            self.say("tgattn: [%d/%d] %.0f%% compiled %s (%.0f s)", len(self.done), len(self.units), self.share(busy),
                     unit.name, time.perf_counter() - self.start)
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
                busy = compiling(self.folder, left)
                what = ("linking" if not left else f"compiling {', '.join(u.name for u in busy)}" if busy
                        else f"{len(left)} left")
                self.say("tgattn: [%d/%d] %.0f%% %.0f s, %s", len(self.done), len(self.units), self.share(busy),
                         now - self.start, what)


def compiling(folder: Path, units: Sequence[Path]) -> dict:
    """Those of ``units`` that a process working in ``folder`` (ninja runs the compiler there) has
    among its arguments, with the CPU seconds those processes have used: the units in the compiler now,
    in the order given (none where there is no ``/proc``)."""
    here, wanted = os.path.realpath(folder), {os.fsencode(u): u for u in units}
    busy: dict = {}
    try:
        entries = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return {}
    tick = os.sysconf("SC_CLK_TCK")
    for pid in entries:
        try:
            if os.readlink(f"/proc/{pid}/cwd") != here:
                continue
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                args = fh.read().split(b"\0")
            with open(f"/proc/{pid}/stat", "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[1].split()  # after the command's name, which may hold spaces
        except OSError:
            continue
        seconds = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        for unit in {wanted[a] for a in args if a in wanted}:
            busy[unit] = busy.get(unit, 0.0) + seconds
    return {u: busy[u] for u in units if u in busy}
