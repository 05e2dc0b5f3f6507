"""``python -m tgattn.bench`` end to end on a tiny case: CSV rows, ratios and targets."""
import pytest

from tgattn import builders, engine
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


@pytest.mark.slow
def test_floor_peer_and_the_ceiling_it_sets(tmp_path, capsys):
    from tgattn.engine import fused

    if not fused.available():
        pytest.skip("the floor runs on the fused kernel's library")
    assert main(["--patterns", "random0.05", "--sizes", "128", "--peers", "tgattn", "sdpa_mask", "floor",
                 "--repeats", "1", "--no-progress", "--no-memory", "--out", str(tmp_path), "--name", "floor"]) == 0
    rows = {(r["peer"], r["mode"]): r["ms"] for r in read_csv(tmp_path / "floor.csv")}
    assert all(rows[("floor", mode)] > 0 for mode in ("fwd", "fwd+bwd"))
    lines = capsys.readouterr().out.splitlines()
    for mode in ("fwd", "fwd+bwd"):
        i = next(i for i, line in enumerate(lines) if line.startswith(f"random0.05 n=128 {mode}: dense masked / tgattn"))
        assert "ceiling: dense masked / reads-only floor" in lines[i + 1]
        shown = float(lines[i + 1].split()[-1].rstrip("x"))
        assert shown == pytest.approx(rows[("sdpa_mask", mode)] / rows[("floor", mode)], rel=0.01)
