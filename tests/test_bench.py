"""``python -m tgattn.bench`` end to end on a tiny case: CSV rows, ratios and targets.

No test here depends on timing: they check which rows exist and, with fixed times, the
arithmetic and format of the report.
"""
import sys

import pytest

from conftest import one_line_error
from tgattn import builders, engine
from tgattn.bench import attention
from tgattn.bench.__main__ import main
from tgattn.bench.report import read_csv, targets


@pytest.mark.slow
def test_bench_tiny_run(tmp_path, capsys):
    assert main(["--patterns", "window64", "causal", "--sizes", "96", "--peers", "tgattn", "gather", "sdpa_mask", "sdpa",
                 "--repeats", "1", "--no-progress", "--out", str(tmp_path), "--name", "tiny"]) == 0
    rows = read_csv(tmp_path / "tiny.csv")
    assert (tmp_path / "tiny.png").stat().st_size > 0
    timed = {(r["pattern"], r["peer"], r["mode"]) for r in rows if r["ms"] is not None and r["ms"] > 0}
    for pattern in ("window64", "causal"):
        for peer in ("tgattn", "gather", "sdpa_mask"):
            assert (pattern, peer, "fwd") in timed and (pattern, peer, "fwd+bwd") in timed
    assert ("causal", "sdpa", "fwd") in timed and ("window64", "sdpa", "fwd") not in timed
    mine = [r for r in rows if r["peer"] == "tgattn"]
    assert all(r["peak_mb"] is not None and r["peak_mb"] > 0 for r in mine)
    window_backend = engine.plan(engine.analyse(builders.window(96, 64), 96, 96))  # tile or fused, by measured fill
    assert {r["pattern"]: r["note"].split(";")[0] for r in mine} == {
        "window64": f"backend={window_backend}",
        "causal": "backend=dense",
    }
    out = capsys.readouterr().out
    assert "window64" in out and "tgattn ms" in out
    assert "causal n=96 fwd: tgattn / dense SDPA" in targets(rows)


def _row(pattern, n, peer, mode, ms):
    return dict(pattern=pattern, n=n, edges=n * n // 20, density=0.05, heads=8, dim=64, peer=peer, mode=mode,
                ms=ms, peak_mb=None, note="")


def test_the_floor_sets_a_ceiling_of_dense_masked_over_floor():
    # only the largest n counts; a ratio below 1 prints with 2 decimals like any other
    times = {(64, "sdpa_mask"): 1.0, (64, "floor"): 0.1, (64, "tgattn"): 0.5,
             (128, "sdpa_mask"): 0.67, (128, "floor"): 2.0, (128, "tgattn"): 0.9}
    rows = [_row("random0.05", n, peer, mode, ms * (3 if mode == "fwd+bwd" else 1))
            for (n, peer), ms in times.items() for mode in ("fwd", "fwd+bwd")]
    lines = targets(rows).splitlines()
    for mode in ("fwd", "fwd+bwd"):
        i = next(i for i, line in enumerate(lines) if line.startswith(f"random0.05 n=128 {mode}: dense masked / tgattn"))
        assert lines[i].split()[-3:] == ["0.74x", "NOT", "met"]  # 0.67 / 0.9
        assert lines[i + 1].split() == ["ceiling:", "dense", "masked", "/", "reads-only", "floor", "0.34x"]  # 0.67 / 2.0
    without_floor = targets([r for r in rows if r["peer"] != "floor"])
    assert "ceiling" not in without_floor and "random0.05 n=128 fwd: dense masked / tgattn" in without_floor


@pytest.mark.slow
def test_floor_peer_runs_and_its_ceiling_is_printed(tmp_path, capsys, monkeypatch):
    from tgattn.bench import attention
    from tgattn.bench.measure import run_once
    from tgattn.engine import fused

    if not fused.available():
        pytest.skip("the floor runs on the fused kernel's library")
    # Every peer really runs (once per mode); the times are fixed so that the check is exact.
    # tgattn fwd, fwd+bwd, then sdpa_mask, then floor: a ceiling of 0.335, shown as 0.34x
    fixed = iter([1.0, 3.0, 0.67, 2.01, 2.0, 6.0])

    def timed(fn, backward, leaves, grad, **kw):
        run_once(fn, backward, leaves, grad)
        return next(fixed)

    monkeypatch.setattr(attention, "best_time", timed)
    assert main(["--patterns", "random0.05", "--sizes", "128", "--peers", "tgattn", "sdpa_mask", "floor",
                 "--repeats", "1", "--no-progress", "--no-memory", "--out", str(tmp_path), "--name", "floor"]) == 0
    rows = {(r["peer"], r["mode"]): r for r in read_csv(tmp_path / "floor.csv")}
    assert all(rows[("floor", mode)]["note"] == "" for mode in ("fwd", "fwd+bwd"))
    assert [rows[(p, m)]["ms"] for p in ("tgattn", "sdpa_mask", "floor") for m in ("fwd", "fwd+bwd")] == [
        1.0, 3.0, 0.67, 2.01, 2.0, 6.0]
    lines = capsys.readouterr().out.splitlines()
    for mode, shown in (("fwd", "0.34x"), ("fwd+bwd", "0.33x")):  # 0.67 / 2.0 and 2.01 / 6.0 (0.33499...)
        i = next(i for i, line in enumerate(lines) if line.startswith(f"random0.05 n=128 {mode}: dense masked / tgattn"))
        assert "ceiling: dense masked / reads-only floor" in lines[i + 1]
        assert lines[i + 1].split()[-1] == f"{rows[('sdpa_mask', mode)]['ms'] / rows[('floor', mode)]['ms']:.2f}x" == shown


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--sizes", "-4"], "argument --sizes: must be an integer >= 1 (got '-4')"),
        (["--sizes", "0"], "argument --sizes: must be an integer >= 1 (got '0')"),
        (["--threads", "0"], "argument --threads: must be an integer >= 1 (got '0')"),
        (["--repeats", "0"], "argument --repeats: must be an integer >= 1 (got '0')"),
        (["--patterns", "spiral"], "unknown pattern(s) ['spiral']"),
        (["--peers", "nope"], "argument --peers: invalid choice: 'nope'"),
        (["--out", "/proc/no/such"], "--out: cannot create the folder '/proc/no/such'"),
    ],
)
def test_bad_arguments_are_one_line_errors_before_the_sweep(cli, monkeypatch, argv, message):
    monkeypatch.setattr(attention, "sweep", None)  # never reached
    status, err = cli(main, ["--patterns", "causal", *argv] if "--patterns" not in argv else argv)
    assert status == 2 and one_line_error(err, "python -m tgattn.bench").startswith(message)


def test_without_matplotlib_the_extra_is_named_before_the_sweep(cli, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    monkeypatch.setattr(attention, "sweep", None)
    status, err = cli(main, ["--quick", "--out", str(tmp_path)])
    assert status == 2 and 'pip install "tgattn[plot]"' in one_line_error(err, "python -m tgattn.bench")
