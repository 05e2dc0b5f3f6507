"""``python -m tgattn.bench.never_seen`` runs end to end at a tiny size and reports its ratios
from its own rows (no timing asserted)."""
import csv

from tgattn.bench import never_seen


def test_cli_writes_the_ratios_and_parts(tmp_path, capsys):
    argv = ["--cases", "molecules_distinct", "indexer_topk", "--n", "256", "--k", "16", "--rounds", "2", "--parts",
            "--out", str(tmp_path)]
    assert never_seen.main(argv) == 0
    with open(tmp_path / "never_seen.csv") as f:
        rows = list(csv.DictReader(f))
    parts = ["never-seen", "prepared", "cached", "validate", "sort", "classify", "plan", "analysis", "run", "same_edges"]
    assert [(r["case"], r["part"]) for r in rows] == [(c, p) for c in ("molecules_distinct", "indexer_topk") for p in parts]
    assert all(float(r["cpu_ms"]) >= 0 for r in rows) and {r["backend"] for r in rows} <= {"fused", "csr"}
    mine = {(r["case"], r["part"]): r for r in rows}
    assert mine[("indexer_topk", "cached")]["nodes"] == "256" and mine[("molecules_distinct", "cached")]["note"] == "distinct edges"
    out = capsys.readouterr().out
    ratios = [line for line in out.splitlines() if "x (<= 1.05)" in line]  # one line per case, judged
    assert [line.split(" (N = ")[0] for line in ratios] == ["molecules_distinct", "indexer_topk"]
    assert all(" met; " in line or " NOT met; " in line for line in ratios) and "wrote" in out


def test_summary_judges_the_target_and_one_round_does_not():
    rows = [dict(case="molecules", nodes=10, edges=20, heads=8, dim=8, backend="fused", part=p, cpu_ms=ms, note="n")
            for p, ms in (("never-seen", 1.05), ("prepared", 1.0), ("cached", 1.02))]
    assert never_seen.summary(rows).endswith("= 1.05x (<= 1.05) met; cached 1.020 ms (1.03x)")
    rows[0]["cpu_ms"] = 1.2
    assert never_seen.summary(rows).endswith("= 1.20x (<= 1.05) NOT met; cached 1.020 ms (1.18x)")
    assert "met" not in never_seen.summary(rows, verdicts=False).splitlines()[-1]


def test_distinct_molecules_have_no_repeated_edge():
    n, edge_index = never_seen.molecule_edges(distinct=True)
    _, raw = never_seen.molecule_edges()
    key = edge_index[0] * n + edge_index[1]  # sorted by source, then target, each edge once
    assert bool((key[1:] > key[:-1]).all()) and set(key.tolist()) == set((raw[0] * n + raw[1]).tolist())
    assert key.numel() < raw.shape[1]  # the batch as made repeats some edges
