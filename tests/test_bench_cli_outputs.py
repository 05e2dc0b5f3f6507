"""Benchmark command lines keep the shipped results put and judge no target from one repeat.

* Every command line with an ``--out`` folder writes outside the checkout by default
  (``$TGATTN_RUNS/<name>``, else ``~/.cache/tgattn/runs/<name>``), so a benchmark run never
  overwrites the results committed under ``data/``.
* ``python -m tgattn.bench --quick`` (one timed repeat) prints the measured values without
  ``met`` / ``NOT met``; with repeats it judges them.

No benchmark runs here: the parsed arguments are caught, and the sweep returns fixed rows.
"""
import argparse
import importlib
import re

import pytest

from conftest import REPO
from tgattn.bench import __main__ as bench_main
from tgattn.bench import attention, report

# Each command line that takes --out, and the folder name of its default.
OUT_CLIS = {
    "tgattn.bench.__main__": "bench",
    "tgattn.bench.big_graphs": "big_graphs",
    "tgattn.bench.distributed": "distributed",
    "tgattn.bench.engine_scaling.command": "engine_scaling",
    "tgattn.bench.gat_example": "gat_example",
    "tgattn.bench.gnn.command": "gnn",
    "tgattn.bench.gpu.command": "gpu",
    "tgattn.bench.gpu_compiled": "gpu_compiled",
    "tgattn.bench.half": "half",
    "tgattn.bench.graph_transformers.command": "graph_transformers",
    "tgattn.bench.hf": "hf",
    "tgattn.bench.never_seen": "never_seen",
    "tgattn.bench.planetoid": "planetoid",
    "tgattn.distributed.gnn": "distributed",
    "tgattn.distributed.gpt": "distributed",
}


class _Parsed(Exception):
    pass


def _parsed_args(module: str, monkeypatch, argv=()) -> argparse.Namespace:
    """The namespace ``module.main(argv)`` parses, caught before the command runs."""
    main = importlib.import_module(module).main
    parse = argparse.ArgumentParser.parse_args

    def catch(parser, args=None, namespace=None):
        raise _Parsed(parse(parser, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", catch)
    with pytest.raises(_Parsed) as caught:
        main(list(argv))
    return caught.value.args[0]


def test_every_command_line_with_an_out_folder_is_listed():
    modules = {
        ".".join(path.relative_to(REPO).with_suffix("").parts)
        for path in (REPO / "tgattn").rglob("*.py")
        if re.search(r"add_argument\(\s*\"--out\"", path.read_text())
    }
    # not benchmarks: the checkpoint folder to train into, the picture to draw, the study's folder (required)
    assert modules - {"tgattn.lm.__main__", "tgattn.analysis.show", "tgattn.analysis.fidelity_command"} == set(OUT_CLIS)


@pytest.mark.parametrize("module", sorted(OUT_CLIS))
def test_default_out_folder_is_outside_the_checkout(module, monkeypatch, tmp_path):
    monkeypatch.setenv("TGATTN_RUNS", str(tmp_path / "runs"))
    assert str(_parsed_args(module, monkeypatch).out) == str(tmp_path / "runs" / OUT_CLIS[module])

    monkeypatch.delenv("TGATTN_RUNS")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    out = _parsed_args(module, monkeypatch).out
    assert str(out) == str(tmp_path / "home" / ".cache" / "tgattn" / "runs" / OUT_CLIS[module])
    assert REPO not in out.resolve().parents


def _rows():
    """window64 at n = 4096, tgattn 1 ms: TransformerConv 60x (met), dense masked 3x (not met)."""
    def row(peer, mode, ms):
        return dict(pattern="window64", n=4096, edges=524224, density=0.03, heads=8, dim=64, peer=peer, mode=mode,
                    ms=ms, peak_mb=None, note="backend=fused" if peer == "tgattn" else "")

    return [row(p, m, ms) for p, ms in (("tgattn", 1.0), ("transformerconv", 60.0), ("sdpa_mask", 3.0))
            for m in ("fwd", "fwd+bwd")]


@pytest.mark.parametrize("argv, judged", [(["--quick"], False), (["--repeats", "1"], False), ([], True)])
def test_one_timed_repeat_prints_numbers_without_verdicts(argv, judged, monkeypatch, tmp_path, capsys):
    repeats = []

    def sweep(patterns, sizes, peers, **kw):
        repeats.append(kw["repeats"])
        return _rows()

    monkeypatch.setattr(attention, "sweep", sweep)
    monkeypatch.setattr(report, "plot", lambda rows, path, device: None)
    assert bench_main.main([*argv, "--patterns", "window64", "--out", str(tmp_path), "--no-progress"]) == 0
    assert repeats == [3 if judged else 1]
    out = capsys.readouterr().out
    lines = {line[:62].strip(): line[62:].split() for line in out.splitlines() if line.startswith("window64 n=4096")}
    assert lines["window64 n=4096 fwd: TransformerConv / tgattn >= 50"] == (["60.00x", "met"] if judged else ["60.00x"])
    assert lines["window64 n=4096 fwd: dense masked / tgattn >= 5"] == (["3.00x", "NOT", "met"] if judged else ["3.00x"])
    assert ("one timed repeat: numbers only" in out) != judged
    assert bool(re.search(r"\bmet\b", out)) == judged
