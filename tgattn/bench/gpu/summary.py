"""What the GPU suite writes and prints: its CSV columns, the per-case summary (share of edges on
tensor cores, the ``tc`` path's time beside the cost model's prediction and roofline, every peer's
ratio), issue 50's and issue 49's targets with the measured values, and the rows its plot draws.

Ratios are a peer's time over the ``tc`` path's (above 1: the tensor-core path is faster);
``*_setup`` ratios add to each side what a new edge set costs it before its kernel (Flex: creating
its block mask; tgattn: the analysis and the tile plan).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from .peers import FLEX_PEERS, SUITE_PEERS
from ..report import SINGLE_REPEAT_NOTE, verdict

MODES = ("fwd", "fwd+bwd")
ATTENTION_FIELDS = ("pattern", "family", "n", "edges", "density", "heads", "kv_heads", "dim", "dtype", "peer", "mode",
                    "ms", "first_s", "setup_ms", "ratio", "ratio_setup", "note", "device")
RATIO_PEERS = tuple(p for p in SUITE_PEERS if p != "tc")
CASE_FIELDS = (("pattern", "family", "n", "edges", "heads", "kv_heads", "dim", "dtype", "mode", "tc_share", "tc_edges",
                "n_full", "n_partial", "block_m", "block_n", "launch", "plan_ms", "tile_gflop", "peak_tflops", "tile_peak_pct", "tc_ms", "gather_ms", "pred_ms", "pred_tiles_ms",
                "pred_gather_ms", "roofline_ms", "tc_over_pred", "tc_over_roofline")
               + RATIO_PEERS + tuple(f"{p}_setup" for p in FLEX_PEERS) + ("plan_note", "device"))
PREDICTED = {"pred_ms": "total", "pred_tiles_ms": "tiles", "pred_gather_ms": "gather", "roofline_ms": "roofline"}
MS = "{:.3g}"  # milliseconds in the summary: three significant digits, from microseconds to seconds


def case_rows(base: dict, columns: dict, predicted: Dict[str, Dict[str, float]], note: str, rows: Sequence[dict]) -> List[dict]:
    """One row per mode of a case: its tile plan (``columns``), the cost model's ms (``predicted[mode]``:
    ``tiles``, ``gather``, ``total``, ``roofline``), the ``tc`` row's time against them, and each
    peer's ratio from ``rows`` (the case's measurement rows).

    Example:
        >>> rows = [dict(peer="tc", mode="fwd", ms=2.0), dict(peer="triton", mode="fwd", ms=5.0, ratio=2.5)]
        >>> r = case_rows(dict(pattern="w", n=8), dict(tc_share=0.9), {"fwd": {"total": 1.0, "roofline": 0.5}}, "", rows)[0]
        >>> r["tc_ms"], r["tc_over_pred"], r["tc_over_roofline"], r["triton"], r["flex"]
        (2.0, 2.0, 4.0, 2.5, None)
    """
    out = []
    for mode in MODES:
        pred = predicted.get(mode, {})
        row = dict(base, mode=mode, plan_note=note, **columns, **{col: pred.get(key) for col, key in PREDICTED.items()})
        by_peer = {r["peer"]: r for r in rows if r["mode"] == mode}
        tc = by_peer.get("tc", {}).get("ms")
        row["tc_ms"], row["gather_ms"] = tc, by_peer.get("triton", {}).get("ms")
        row["tc_over_pred"] = tc / row["pred_ms"] if tc and row["pred_ms"] else None
        row["tc_over_roofline"] = tc / row["roofline_ms"] if tc and row["roofline_ms"] else None
        row["tile_peak_pct"] = _peak_pct(mode, columns, out[0]["tc_ms"] if out else None, tc)
        for peer in RATIO_PEERS:
            row[peer] = by_peer.get(peer, {}).get("ratio")
        for peer in FLEX_PEERS:
            row[f"{peer}_setup"] = by_peer.get(peer, {}).get("ratio_setup")
        out.append(row)
    return out


BACKWARD_FLOP = 2.5  # the backward's products over the forward's: 10 d a cell against 4 d (FlashAttention-2's count)


def _peak_pct(mode: str, columns: dict, fwd_ms: Optional[float], ms: Optional[float]) -> Optional[float]:
    """The tiles' share of the card's tensor-core peak, in %: the forward's on the forward row, the
    backward's alone on the forward + backward row (its time less the forward's), from the plan's
    ``tile_gflop`` (the forward's products) and ``peak_tflops``.

    Example:
        >>> cols = dict(tile_gflop=1.0, peak_tflops=1000.0)
        >>> _peak_pct("fwd", cols, None, 0.01), _peak_pct("fwd+bwd", cols, 0.01, 0.035)
        (10.0, 10.0)
    """
    work, peak = columns.get("tile_gflop"), columns.get("peak_tflops")
    seconds = (ms if mode == "fwd" else (ms - fwd_ms if ms and fwd_ms and ms > fwd_ms else None)) if ms else None
    if not (work and peak and seconds):
        return None
    return 100 * work * (1.0 if mode == "fwd" else BACKWARD_FLOP) * 1e9 / (seconds / 1e3) / (peak * 1e12)


def _cell(value: Optional[float], fmt: str = "{:.2f}") -> str:
    return "-" if value is None else fmt.format(value)


def summary(cases: Sequence[dict]) -> str:
    """One line per case and mode: E, the share on tensor cores, ``tc`` ms, predicted and roofline
    ms, the gather path's ms, then each peer's time over ``tc``'s ("-": did not run; the attention
    CSV says why)."""
    head = (f"{'case':<12}{'n':>7} {'mode':<8}{'E':>11} {'tc %':>6} {'tc ms':>8} {'pred':>8} {'roof':>8} {'gather':>8}"
            + "".join(f"{p[:10]:>11}" for p in RATIO_PEERS) + "".join(f"{p[:6] + '+mask':>12}" for p in FLEX_PEERS))
    lines = [head, "-" * len(head)]
    for r in cases:
        share = r.get("tc_share")
        lines.append(
            f"{r['pattern']:<12}{r['n']:>7} {r.get('mode', '-'):<8}{r.get('edges') or 0:>11} "
            f"{_cell(None if share is None else 100 * share, '{:.1f}'):>6} {_cell(r.get('tc_ms'), MS):>8} "
            f"{_cell(r.get('pred_ms'), MS):>8} {_cell(r.get('roofline_ms'), MS):>8} {_cell(r.get('gather_ms'), MS):>8}"
            + "".join(f"{_cell(r.get(p), '{:.2f}x'):>11}" for p in RATIO_PEERS)
            + "".join(f"{_cell(r.get(f'{p}_setup'), '{:.2f}x'):>12}" for p in FLEX_PEERS))
    return "\n".join(lines)


def suite_targets(cases: Sequence[dict], steps: Sequence[dict] = (), *, verdicts: bool = True) -> str:
    """Issue 56's targets per case (bfloat16, the modes named; its scattered and GNN targets are
    issue 50's) and issue 49's GPU targets, each with its measured value (``n/a`` when not
    measured) and, with ``verdicts``, met / NOT met. "Flex" is the fastest of its kernels (its
    Triton kernel on the case's or the edges' BlockMask, its FA4 backend).

    Example:
        >>> cases = [dict(pattern="window256", family="structured", n=131072, mode="fwd+bwd", flex=1.5, flex_edges=0.8,
        ...               flex_setup=2.5, flex_edges_setup=None, tile_peak_pct=21.0)]
        >>> print(suite_targets(cases))  # doctest: +NORMALIZE_WHITESPACE
        window256 n=131072 fwd+bwd: Flex kernel / tc >= 1.3 0.80x NOT met
        window256 n=131072 fwd+bwd: (Flex + mask) / (tc + plan) >= 2 2.50x met
        window256 n=131072 fwd+bwd: the backward's tiles at >= 20 % of the peak 21 % met
    """
    out = [] if verdicts else [SINGLE_REPEAT_NOTE]

    def line(text, value, ok, unit="x"):
        shown = "n/a" if value is None else (f"{value:.2f}x" if unit == "x" else f"{value:.0f} %")
        out.append(f"{text:<70} {shown:>8}  {verdict(value, ok, verdicts)}".rstrip())

    def least(*values):
        got = [v for v in values if v is not None]
        return min(got) if got else None

    for r in cases:
        where = f"{r['pattern']} n={r['n']} {r['mode']}"
        family, long = r.get("family"), r["n"] >= 65536
        if family == "structured":
            need = 1.3 if long else 1.0
            line(f"{where}: Flex kernel / tc >= {need:g}", least(r.get("flex"), r.get("flex_edges"), r.get("flex_fa4")),
                 lambda x: x >= need)
            if long and r["mode"] == "fwd+bwd":
                line(f"{where}: (Flex + mask) / (tc + plan) >= 2",
                     least(r.get("flex_setup"), r.get("flex_edges_setup"), r.get("flex_fa4_setup")), lambda x: x >= 2)
            if r["pattern"] == "window256" and r["n"] >= 131072:
                part, pct = ("forward", 25) if r["mode"] == "fwd" else ("backward", 20)
                line(f"{where}: the {part}'s tiles at >= {pct} % of the peak", r.get("tile_peak_pct"),
                     lambda x: x >= pct, unit="%")
        elif family == "scattered":
            line(f"{where}: min(gather, dense SDPA) / tc >= 1", least(r.get("triton"), r.get("sdpa_dense")), lambda x: x >= 1)
        elif family == "indexer" and r["mode"] == "fwd+bwd":
            line(f"{where}: gather / tc >= 2", r.get("triton"), lambda x: x >= 2)
        elif family == "gnn":
            triton = r.get("triton")
            line(f"{where}: tc / gather <= 1.05", None if not triton else 1 / triton, lambda x: x <= 1.05)
    step = {(r["variant"], r["model"]): r.get("vs_gat") for r in steps}
    if steps:
        line("molecules, new edge set each step: tgattn / GATConv <= 0.7", step.get(("new_edges", "tgattn")), lambda x: x <= 0.7)
        line("molecules, prepared each step: tgattn / GATConv <= 0.7", step.get(("new_edges", "tgattn_prepared")),
             lambda x: x <= 0.7)
        line("molecules, fixed batch, torch.cuda.graph: tgattn / GATConv <= 0.5", step.get(("cuda_graph", "tgattn")),
             lambda x: x <= 0.5)
        line("molecules, fixed batch, reduce-overhead: tgattn / GATConv <= 0.5", step.get(("compiled", "tgattn")),
             lambda x: x <= 0.5)
    return "\n".join(out)


def steps_table(steps: Sequence[dict]) -> str:
    """The molecule step rows: ms, first call's seconds and time over GATConv's new-edge-set step."""
    lines = [f"{'variant':<12}{'model':<17}{'ms':>9}{'first s':>9}{'/ GATConv':>11}  note"]
    for r in steps:
        lines.append(f"{r['variant']:<12}{r['model']:<17}{_cell(r.get('ms')):>9}{_cell(r.get('first_s')):>9}"
                     f"{_cell(r.get('vs_gat'), '{:.2f}x'):>11}  {r.get('note') or ''}".rstrip())
    return "\n".join(lines)


def plot_rows(rows: Sequence[dict], cases: Sequence[dict]) -> List[dict]:
    """The rows :func:`tgattn.bench.report.plot` draws: every measured row, and the cost model's
    ``tc`` prediction and roofline as two more lines ("tc predicted", "tc roofline").

    Example:
        >>> got = plot_rows([dict(pattern="w", n=8, peer="tc", mode="fwd", ms=2.0)],
        ...                 [dict(pattern="w", n=8, mode="fwd", pred_ms=1.0, roofline_ms=None)])
        >>> [(r["peer"], r["ms"]) for r in got]
        [('tc', 2.0), ('tc predicted', 1.0)]
    """
    extra = [dict(pattern=c["pattern"], n=c["n"], mode=c["mode"], peer=name, ms=c[key])
             for c in cases for key, name in (("pred_ms", "tc predicted"), ("roofline_ms", "tc roofline")) if c.get(key)]
    return [r for r in rows if r.get("ms")] + extra
