"""``python -m tgattn.bench.engine_scaling``: its probes measure what they say (no timing asserted)."""
import sys

import pytest

from tgattn import builders
from tgattn.bench.engine_scaling import command as engine_scaling, sections as engine_sections


@pytest.mark.slow  # a child process or a build: tens of seconds
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_memory_probe_sees_what_the_call_allocates():
    # in a fresh process, as the benchmark runs it: a used heap would serve the call from freed pages
    got = engine_scaling._in_subprocess(2048, "fwd+bwd", "fused", heads=2, dim=16)
    assert got["edges"] == builders.window(2048, 64).shape[1]
    # at least the output and the three gradients, [n, H, d] float32 each
    assert got["peak_gb"] * 2**30 >= 4 * 2048 * 2 * 16 * 4 and got["seconds"] > 0


def test_summary_reports_the_ratios():
    rows = [
        dict(section="ratios", pattern="window64", n=64, backend="fused", mode=m, threads=1, ms=t, cpu_ms=t)
        for m, t in (("fwd", 2.0), ("fwd+bwd", 7.0))
    ]
    rows += [
        dict(section="scaling", pattern="window64", n=n, edges=n, heads=1, backend="fused", mode="fwd", threads=1,
             ns_per_edge_head=x * 1e6 / n, cpu_ms=x, sys_ms=y)
        for n, x, y in ((1000, 5.0, 0.0), (2000, 12.0, 1.6))
    ]
    text = engine_scaling.summary(rows)
    assert "backward / forward 2.50" in text
    assert "ns per edge-head 5000.0, 6000.0: max / min 1.20" in text
    assert "ns per edge-head less sys 5000.0, 5200.0: max / min 1.04" in text


def test_cli_writes_a_csv(tmp_path, capsys):
    args = ["--sections", "ratios", "--heads", "1", "--dim", "4", "--rounds", "1", "--out", str(tmp_path)]
    assert engine_scaling.main(args) == 0
    lines = (tmp_path / "engine_scaling.csv").read_text().strip().splitlines()
    assert len(lines) == 1 + 3 * 2 * 2  # header; 3 patterns x (fused, auto) x (fwd, fwd+bwd)
    assert "backward / forward" in capsys.readouterr().out


def test_auto_section_times_every_backend_that_runs_the_set_and_names_the_best():
    from tgattn import engine
    from tgattn.bench.patterns import patterns

    rows = engine_sections.auto_vs_best([64], heads=1, dim=4, rounds=1)
    for name, pattern in patterns().items():
        s = engine.structure_of(pattern.make(64), 64, 64)
        expected = {b for b in ("dense", "tile", "fused", "csr") if engine.plan(s, b) == b} | {"auto"}
        for mode in ("fwd", "fwd+bwd"):
            mine = {r["backend"]: r for r in rows if r["pattern"] == name and r["mode"] == mode}
            assert set(mine) == expected
            best = min((b for b in mine if b != "auto"), key=lambda b: mine[b]["cpu_ms"])
            ratio = mine["auto"]["cpu_ms"] / mine[best]["cpu_ms"]
            assert mine["auto"]["note"] == f"auto runs {engine.plan(s)}; best {best}; auto / best {ratio:.2f}"


@pytest.mark.slow  # a child process or a build: tens of seconds
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_warm_probe_times_a_second_call_per_edge_and_head():
    (row,) = engine_scaling.memory(2, 16, ((2048, "fwd"),), warm=True)
    assert row["edges"] == builders.window(2048, 64).shape[1] and row["cpu_ms"] > 0
    # per edge and head from the second call's CPU time (cpu_ms is rounded to 0.1 ms)
    assert abs(row["ns_per_edge_head"] - row["cpu_ms"] * 1e6 / (row["edges"] * 2)) <= 0.05e6 / (row["edges"] * 2) + 1e-3
    assert "second call" in row["note"]


def test_cache_section_times_both_states_and_restores_the_limit():
    from tgattn.engine import cache_info, fused

    if not fused.available():
        pytest.skip("no C++ toolchain here")
    limit = cache_info()["limit"]
    rows = engine_sections.cache_on_off(64, heads=1, dim=4, rounds=1)
    assert cache_info()["limit"] == limit
    got = {(r["pattern"], r["mode"], r["note"]) for r in rows}
    assert got == {(p, m, f"cache {s}") for p in engine_sections.CACHE_PATTERNS for m in ("fwd", "fwd+bwd")
                   for s in ("on", "off")}
    text = engine_scaling.summary(rows)
    assert text.count("cache on / off") == 2 * len(engine_sections.CACHE_PATTERNS)


def test_floor_section_times_the_backward_and_both_read_floors():
    from tgattn.engine import fused

    if not fused.available():
        pytest.skip("no C++ toolchain here")
    rows = engine_sections.backward_floor(64, heads=1, dim=4, rounds=1)
    assert {(r["pattern"], r["note"]) for r in rows} == {
        (p, note) for p in engine_sections.RATIO_PATTERNS
        for note in ("fused backward", "floor caller layout", "floor head-major")}
    assert engine_scaling.summary(rows).count("fused backward / floor") == 2 * len(engine_sections.RATIO_PATTERNS)
