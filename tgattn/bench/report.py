"""CSV, plot, ratio table and target check for the attention benchmark; the CSV files and figures
of every benchmark go through :func:`write_csv`, :func:`read_rows` and :func:`figure`."""
from __future__ import annotations

import csv
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

FIELDS = ("pattern", "n", "edges", "density", "heads", "dim", "peer", "mode", "ms", "peak_mb", "note")


def write_csv(rows: List[dict], path: Path, fields: Sequence[str] = FIELDS) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: row.get(k) for k in fields})


def read_rows(path: Path) -> List[dict]:
    """The rows of a CSV file with a header line, as dicts of strings (an empty cell is ``""``).

    Example:
        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / "runs.csv"
        >>> write_csv([dict(model="gat", ms=1.5), dict(model="tgattn")], path, ["model", "ms"])
        >>> read_rows(path)
        [{'model': 'gat', 'ms': '1.5'}, {'model': 'tgattn', 'ms': ''}]
    """
    with open(path) as f:
        return list(csv.DictReader(f))


@contextmanager
def figure(path: Path, nrows: int = 1, ncols: int = 1, *, dpi: int = 110, rect=None, **subplots) -> Iterator[tuple]:
    """``(fig, axes)`` of ``matplotlib.pyplot.subplots(nrows, ncols, **subplots)`` on the Agg
    backend (no display needed); when the block ends the figure is laid out
    (``tight_layout(rect=rect)``) and saved to ``path`` (its folder made), and closed in any case.

    Example:
        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / "plots" / "line.png"
        >>> with figure(path, figsize=(3, 2)) as (fig, ax):
        ...     _ = ax.plot([1, 2], [3, 4])
        >>> path.stat().st_size > 0
        True
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(nrows, ncols, **subplots)
    try:
        yield fig, axes
        fig.tight_layout(rect=rect)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)


def read_csv(path: Path) -> List[dict]:
    """The attention benchmark's CSV file back as rows, sizes as ints and times as floats or None."""
    rows = read_rows(path)
    for row in rows:
        for key in ("n", "edges", "heads", "dim"):
            row[key] = int(row[key])
        for key in ("density", "ms", "peak_mb"):
            row[key] = float(row[key]) if row[key] not in ("", "None") else None
    return rows


def _index(rows: List[dict]) -> Dict[Tuple[str, int, str, str], dict]:
    return {(r["pattern"], r["n"], r["mode"], r["peer"]): r for r in rows}


def ratio_table(rows: List[dict], peers: Sequence[str]) -> str:
    """One line per (pattern, n, mode): tgattn's time and each peer's time / tgattn's time.

    A ratio above 1 means tgattn is faster; ``-`` = the peer did not run (see the CSV note).
    """
    idx = _index(rows)
    others = [p for p in peers if p != "tgattn"]
    head = f"{'pattern':<12} {'n':>6} {'E':>9} {'mode':<7} {'tgattn ms':>9} {'peak MB':>8} {'backend':<6} " + " ".join(
        f"{p[:10]:>10}" for p in others
    )
    lines = [head, "-" * len(head)]
    keys = sorted({(r["pattern"], r["n"], r["mode"]) for r in rows}, key=lambda k: (k[0], k[1], k[2]))
    for pattern, n, mode in keys:
        mine = idx.get((pattern, n, mode, "tgattn"))
        if mine is None or mine["ms"] is None:
            continue
        backend = (mine.get("note") or "").split(";")[0].replace("backend=", "")
        cells = []
        for p in others:
            r = idx.get((pattern, n, mode, p))
            cells.append(f"{r['ms'] / mine['ms']:>9.2f}x" if r and r["ms"] else f"{'-':>10}")
        peak = f"{mine['peak_mb']:>8.1f}" if mine["peak_mb"] is not None else f"{'-':>8}"
        lines.append(
            f"{pattern:<12} {n:>6} {mine['edges']:>9} {mode:<7} {mine['ms']:>9.1f} {peak} {backend:<6} " + " ".join(cells)
        )
    return "\n".join(lines)


def _over(idx, pattern, n, mode, a, b) -> Optional[float]:
    """Time of peer a / time of peer b, both measured in this run."""
    ra, rb = idx.get((pattern, n, mode, a)), idx.get((pattern, n, mode, b))
    if not ra or not rb or not ra["ms"] or not rb["ms"]:
        return None
    return ra["ms"] / rb["ms"]


def _ratio(idx, pattern, n, mode, peer) -> Optional[float]:
    return _over(idx, pattern, n, mode, peer, "tgattn")


def verdict(value: Optional[float], ok, verdicts: bool = True) -> str:
    """``met`` / ``NOT met`` for a measured value; empty when not measured or ``verdicts`` is off.

    A single timed repeat is too noisy to judge a target by: the command lines then print the
    numbers alone (``verdicts=False``).

    Example:
        >>> verdict(12.0, lambda r: r >= 10), verdict(12.0, lambda r: r >= 10, verdicts=False), verdict(None, bool)
        ('met', '', '')
    """
    if value is None or not verdicts:
        return ""
    return "met" if ok(value) else "NOT met"


SINGLE_REPEAT_NOTE = "(one timed repeat: numbers only, no verdicts; run without --quick / with --repeats >= 2 to judge the targets)"


def targets(rows: List[dict], window: str = "window64", *, verdicts: bool = True) -> str:
    """The issue's targets, each with its measured value (``n/a`` when not in this run).

    Args:
        rows: the sweep's rows.
        window: the window pattern the window targets refer to (default: ``"window64"``).
        verdicts: print ``met`` / ``NOT met`` beside each value (default: ``True``); off for a
            single timed repeat, which is too noisy to judge by.
    """
    idx = _index(rows)
    out = [] if verdicts else [SINGLE_REPEAT_NOTE]

    def line(text, value, ok, fmt="{:.2f}x"):
        shown = "n/a" if value is None else fmt.format(value)
        out.append(f"{text:<62} {shown:>12}  {verdict(value, ok, verdicts)}".rstrip())

    line(f"{window} n=4096 fwd: TransformerConv / tgattn >= 50", _ratio(idx, window, 4096, "fwd", "transformerconv"), lambda r: r >= 50)
    line(f"{window} n=4096 fwd: dense masked / tgattn >= 5", _ratio(idx, window, 4096, "fwd", "sdpa_mask"), lambda r: r >= 5)
    line(f"{window} n=4096 fwd: compiled Flex / tgattn >= 1", _ratio(idx, window, 4096, "fwd", "flex"), lambda r: r >= 1)
    line(f"{window} n=4096 fwd+bwd: dense masked / tgattn >= 5", _ratio(idx, window, 4096, "fwd+bwd", "sdpa_mask"), lambda r: r >= 5)
    for pattern in sorted({r["pattern"] for r in rows if r["pattern"].startswith(("random", "topk"))}):
        ns = sorted({r["n"] for r in rows if r["pattern"] == pattern and r["peer"] == "sdpa_mask" and r["ms"]})
        for mode in ("fwd", "fwd+bwd"):
            if ns:
                line(f"{pattern} n={ns[-1]} {mode}: dense masked / tgattn >= 10", _ratio(idx, pattern, ns[-1], mode, "sdpa_mask"), lambda r: r >= 10)
                ceiling = _over(idx, pattern, ns[-1], mode, "sdpa_mask", "floor")
                if ceiling is not None:  # what reading the gathered rows alone would allow
                    out.append(f"  {'ceiling: dense masked / reads-only floor':<60} {ceiling:>11.2f}x")
    for pattern in ("full", "causal"):
        ns = sorted({r["n"] for r in rows if r["pattern"] == pattern and r["peer"] == "sdpa" and r["ms"]})
        for n in ns:
            for mode in ("fwd", "fwd+bwd"):
                r = _ratio(idx, pattern, n, mode, "sdpa")
                line(f"{pattern} n={n} {mode}: tgattn / dense SDPA <= 1.25", None if r is None else 1 / r, lambda x: x <= 1.25)
    per_edge = {
        r["n"]: r["ms"] / r["edges"] for r in rows
        if r["pattern"] == window and r["peer"] == "tgattn" and r["mode"] == "fwd+bwd" and r["ms"] and 1024 <= r["n"] <= 65536
    }
    if len(per_edge) > 1:
        spread = max(per_edge.values()) / min(per_edge.values())
        line(f"{window} fwd+bwd time per edge, n {min(per_edge)}..{max(per_edge)}: max/min <= 1.5", spread, lambda x: x <= 1.5)
    big = idx.get((window, 131072, "fwd+bwd", "tgattn"))
    if big and big["ms"]:
        peak = f", peak extra {big['peak_mb']:.0f} MB" if big["peak_mb"] else ""
        out.append(f"{window} n=131072 fwd+bwd completes: {big['ms'] / 1e3:.2f} s{peak}")
    return "\n".join(out)


def plot(rows: List[dict], path: Path, device: str = "CPU", dtype: str = "fp32") -> None:
    """One panel per pattern. Over several n: time against n, solid = forward, dashed =
    forward+backward. At a single n: one bar per peer and mode (light = forward). ``dtype``
    names the inputs' precision in the title."""
    import matplotlib
    import matplotlib.lines
    import matplotlib.ticker

    patterns = sorted({r["pattern"] for r in rows})
    peers = list(dict.fromkeys(r["peer"] for r in rows))
    single = len({r["n"] for r in rows}) == 1
    cols = min(4, len(patterns))
    nrows = -(-len(patterns) // cols)
    colors = dict(zip(peers, matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]))
    ncol = min(len(peers), 3 * cols)  # the legend's columns; its rows get room below the panels
    legend = 0.25 * -(-len(peers) // ncol)
    height = 3.2 * nrows + legend
    with figure(path, nrows, cols, figsize=(4 * cols, height), squeeze=False, rect=(0, (legend + 0.05) / height, 1, 1)) \
            as (fig, axes):
        for ax, pattern in zip(axes.flat, patterns):
            if single:
                _bars(ax, [r for r in rows if r["pattern"] == pattern], peers, colors)
                ax.set_title(f"{pattern}, n = {rows[0]['n']}")
                continue
            for peer in peers:
                for mode, style in (("fwd", "-"), ("fwd+bwd", "--")):
                    pts = sorted((r["n"], r["ms"]) for r in rows if r["pattern"] == pattern and r["peer"] == peer and r["mode"] == mode and r["ms"])
                    if pts:
                        ax.plot(*zip(*pts), style, marker="o", ms=3, color=colors[peer], label=peer if mode == "fwd" else None)
            ax.set(xscale="log", yscale="log", title=pattern, xlabel="n (tokens)", ylabel="ms")
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.grid(alpha=0.3)
        for ax in list(axes.flat)[len(patterns):]:
            ax.axis("off")
        handles = [matplotlib.lines.Line2D([], [], color=colors[p], marker="s" if single else "o", ms=5 if single else 3,
                                           lw=0 if single else 1.5, label=p) for p in peers]
        fig.legend(handles=handles, loc="lower center", ncol=ncol, fontsize=8,
                   bbox_to_anchor=(0.5, -0.01))
        how = "light: forward, dark: forward+backward" if single else "solid: forward, dashed: forward+backward"
        fig.suptitle(f"attention core, H=8, d=64, {dtype}, {device}\n({how})", fontsize=10)


def _bars(ax, rows: List[dict], peers: Sequence[str], colors: dict) -> None:
    """Horizontal bars of time (log scale), one pair per peer that ran, tgattn on top."""
    import matplotlib.ticker

    ran = [p for p in peers if any(r["peer"] == p and r["ms"] for r in rows)]
    ms = {(r["peer"], r["mode"]): r["ms"] for r in rows if r["ms"]}
    for y, peer in enumerate(reversed(ran)):
        for mode, dy, alpha in (("fwd", 0.2, 0.45), ("fwd+bwd", -0.2, 1.0)):
            if (peer, mode) in ms:
                ax.barh(y + dy, ms[(peer, mode)], height=0.38, color=colors[peer], alpha=alpha)
    ax.set_yticks(range(len(ran)), list(reversed(ran)), fontsize=8)
    ax.set(xscale="log", xlabel="ms")
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.grid(alpha=0.3, axis="x")
