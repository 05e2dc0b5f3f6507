"""The tables and the plot of :mod:`tgattn.bench.graph_transformers`: ``results.csv`` (one row per
data set and model), ``results.md`` (with the scaling points and the published anchors) and
``graph_transformers.png``, from the rows of ``runs.csv`` and ``scaling.csv``.
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Dict, List

from ..report import figure, read_rows, write_csv

ANCHORS = (
    "Published anchors (not rerun here): GPS on ZINC (500k parameter budget) 0.070 ± 0.004 test MAE (Rampasek et "
    "al., NeurIPS 2022). Exphormer (Shirzad et al., ICML 2023): Peptides-Struct 0.2481 ± 0.0007 MAE, Peptides-Func "
    "0.6527 ± 0.0043 AP, CIFAR10 74.75 ± 0.19 %, MalNet-Tiny 94.02 ± 0.21 %, Amazon Computers 91.47 ± 0.17 % "
    "(as indexed by Papers with Code); its normalisation is exp(clamp(s, -5, 5)) / (sum + 1e-6), not the exact "
    "softmax used here. GAT on the public Planetoid split: 83.0 ± 0.7 % (Cora), 72.5 ± 0.7 % (CiteSeer) "
    "(Velickovic et al., ICLR 2018). GPS below GAT on citation graphs elsewhere too: Buterez et al. (Nat. Commun. "
    "2025, Table 4, MCC) report GPS 0.64 ± 0.04 vs GAT 0.75 ± 0.01 on Cora, 0.54 ± 0.01 vs 0.59 ± 0.03 on CiteSeer."
)


def summarize(runs: List[Dict]) -> List[Dict]:
    """One row per (dataset, model): metric mean ± std, times, and the time ratio to GPS with PyG's MHA."""
    rows = []
    for key in dict.fromkeys((r["dataset"], r["model"]) for r in runs):
        sel = [r for r in runs if (r["dataset"], r["model"]) == key]
        vals = [float(r["value"]) for r in sel]
        diffs = [float(r["max_abs_diff_vs_mha"]) for r in sel if r["max_abs_diff_vs_mha"] != ""]
        rows.append({"dataset": key[0], "model": key[1], "metric": sel[0]["metric"], "runs": len(sel),
                     "mean": statistics.mean(vals), "std": statistics.stdev(vals) if len(vals) > 1 else 0.0,
                     "ms_per_epoch": statistics.mean(float(r["ms_per_epoch"]) for r in sel),
                     "min_ms_per_epoch": min(float(r["min_ms_per_epoch"]) for r in sel),
                     "peak_mb": max(float(r["peak_mb"]) for r in sel),
                     "max_abs_diff_vs_mha": max(diffs) if diffs else ""})
    for row in rows:
        mha = [r for r in rows if r["dataset"] == row["dataset"] and r["model"] == "gps_mha"]
        row["speedup_vs_mha"] = mha[0]["min_ms_per_epoch"] / row["min_ms_per_epoch"] if mha else ""
    return rows


def markdown(rows: List[Dict], scaling: List[Dict], command: str) -> str:
    lines = ["# Graph transformers on tgattn", "", f"Command: `{command}`", "",
             "| dataset | model | metric | mean ± std | runs | ms / epoch (mean) | min ms / epoch | "
             "speed-up vs GPS-MHA (min) | peak MB / step | max abs diff vs MHA at init |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        scale = 100.0 if r["metric"] == "accuracy" else 1.0
        speed = f"{r['speedup_vs_mha']:.2f}x" if r["speedup_vs_mha"] != "" else "-"
        diff = f"{r['max_abs_diff_vs_mha']:.1e}" if r["max_abs_diff_vs_mha"] != "" else "-"
        lines.append(f"| {r['dataset']} | {r['model']} | {r['metric']}{' (%)' if scale > 1 else ''} | "
                     f"{scale * r['mean']:.3f} ± {scale * r['std']:.3f} | {r['runs']} | {r['ms_per_epoch']:.1f} | "
                     f"{r['min_ms_per_epoch']:.1f} | {speed} | {r['peak_mb']:.1f} | {diff} |")
    lines += ["", "Scaling (one training step of one layer, one graph of n nodes, D = 32, H = 4; peak = peak RSS "
              "above the RSS before the inputs were built, in a fresh process):", "",
              "| model | n | ms / step | peak MB | note |", "|---|---|---|---|---|"]
    for r in scaling:
        ms = f"{r['ms']:.1f}" if r["ms"] is not None else "-"
        mb = f"{r['peak_mb']:.1f}" if r["peak_mb"] is not None else "-"
        lines.append(f"| {r['model']} | {r['n']} | {ms} | {mb} | {r['note']} |")
    return "\n".join(lines + ["", ANCHORS, ""])


def plot(rows: List[Dict], scaling: List[Dict], path: Path) -> None:
    """``graph_transformers.png``: min ms per epoch of each data set and model; ms and peak MB per
    training step against the nodes per graph (points not run: predicted, or out of memory)."""
    with figure(path, 1, 3, figsize=(15, 4)) as (_, axes):
        datasets = list(dict.fromkeys(r["dataset"] for r in rows))
        models = list(dict.fromkeys(r["model"] for r in rows))
        width = 0.8 / max(len(models), 1)
        for k, model in enumerate(models):
            vals = [next((r["min_ms_per_epoch"] for r in rows if r["dataset"] == d and r["model"] == model), 0) for d in datasets]
            axes[0].bar([i + k * width for i in range(len(datasets))], vals, width, label=model)
        axes[0].set_xticks([i + 0.4 - width / 2 for i in range(len(datasets))], datasets)
        axes[0].set_ylabel("min ms / epoch")
        axes[0].set_yscale("log")
        axes[0].legend(fontsize=8)
        for model in dict.fromkeys(r["model"] for r in scaling):
            pts = [r for r in scaling if r["model"] == model and r["ms"] is not None]
            line = axes[1].plot([r["n"] for r in pts], [r["ms"] for r in pts], "o-", label=model)[0]
            axes[2].plot([r["n"] for r in pts], [r["peak_mb"] for r in pts], "o-", label=model, color=line.get_color())
            # not run: predicted from the last measured size (hollow), out of memory under the cap (x)
            for r in scaling:
                if r["model"] != model or r["ms"] is not None or r.get("predicted_ms") in (None, ""):
                    continue
                oom = r["note"].startswith("out of memory")
                axes[1].plot(r["n"], float(r["predicted_ms"]), "o", mfc="none", color=line.get_color())
                axes[2].plot(r["n"], float(r["predicted_mb"]), "x" if oom else "o", mfc="none", ms=9 if oom else 6,
                             color=line.get_color())
        axes[1].set_title("hollow: predicted (not run)", fontsize=9)
        axes[2].set_title("x: out of memory under the cap (at the predicted need)", fontsize=9)
        for ax, label in ((axes[1], "ms / training step"), (axes[2], "peak MB / training step")):
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("nodes per graph")
            ax.set_ylabel(label)
            ax.legend(fontsize=8)


def read_scaling(path: Path) -> List[Dict]:
    """``scaling.csv`` back as :func:`~tgattn.bench.graph_transformers.scaling.measure_scaling` rows (numbers as
    floats, blanks as None); no rows where there is no such file."""
    if not path.exists():
        return []
    numbers = ("ms", "peak_mb", "predicted_ms", "predicted_mb")
    return [{**r, "n": int(r["n"]), **{k: float(r[k]) if r.get(k) else None for k in numbers}} for r in read_rows(path)]


def write_tables(out: Path, runs: List[Dict], scaling: List[Dict], command: str, written=()) -> int:
    """``results.csv``, ``results.md`` (naming ``command``) and the plot from the runs and scaling
    rows; prints the table, then names them after the ``written`` files of ``out`` that came before."""
    rows = summarize(runs)
    write_csv(rows, out / "results.csv", list(rows[0]))
    (out / "results.md").write_text(markdown(rows, scaling, command))
    plot(rows, scaling, out / "graph_transformers.png")
    sys.stdout.write(markdown(rows, scaling, command))
    names = [*written, "results.csv", "results.md", "graph_transformers.png"]
    print(f"\nwrote {', '.join(str(out / name) for name in names)}")
    return 0
