"""``python -m tgattn.bench.gpu --suite``: the GPU suite's code on the CPU (its dry run), its peers
against the dense oracle, its time guard, its tile-plan columns (through stand-ins of the planner
and the cost model under the tc backend's names) and its summary and targets."""
import csv
import warnings

import pytest
import torch

from tgattn import builders
from tgattn.bench.gpu import cases as gpu_cases, launch as gpu_launch, peers as gpu_peers, suite as gpu_suite
from tgattn.bench.gpu.cases import SIZES, Case, case, suite_cases
from tgattn.bench.gpu.command import main
from tgattn.bench.gpu.summary import ATTENTION_FIELDS, CASE_FIELDS, case_rows, suite_targets
from tgattn.engine.analysis import analyse

pytest.importorskip("matplotlib")
pytest.importorskip("torch_geometric")


def _read(path):
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_dry_run_writes_every_case_peer_and_mode_with_a_time_or_a_reason(tmp_path, capsys):
    cases = ["window64", "block_local", "indexer_gqa", "molecules"]
    # a budget no loaded machine exhausts: the default (450 s of wall clock) would skip cases under load
    assert main(["--suite", "--dry-run", "--no-gnn", "--no-progress", "--out", str(tmp_path), "--cases", *cases,
                 "--budget-s", "86400"]) == 0
    rows, per_case = _read(tmp_path / "suite_attention.csv"), _read(tmp_path / "suite_cases.csv")
    assert (tmp_path / "suite.png").stat().st_size > 0 and not (tmp_path / "suite_steps.csv").exists()
    assert tuple(rows[0]) == ATTENTION_FIELDS and tuple(per_case[0]) == CASE_FIELDS
    assert [(r["pattern"], r["peer"], r["mode"]) for r in rows] == [
        (c, p, m) for c in cases for p in gpu_peers.SUITE_PEERS for m in ("fwd", "fwd+bwd")]
    assert [(r["pattern"], r["mode"]) for r in per_case] == [(c, m) for c in cases for m in ("fwd", "fwd+bwd")]
    assert all(r["ms"] or r["note"] for r in rows)  # what did not run says why
    ran = {(r["pattern"], r["peer"], r["mode"]) for r in rows if r["ms"]}
    for c in cases:  # SDPA everywhere, both modes; Flex on the edge set forward (a CPU has no Flex backward)
        assert {(c, p, m) for p in ("sdpa_mask", "sdpa_dense") for m in ("fwd", "fwd+bwd")} | {(c, "flex_edges", "fwd")} <= ran
    assert {("window64", "flex", "fwd"), ("block_local", "flex", "fwd")} <= ran
    # the gather path through Triton's interpreter: the first case and the grouped-query one
    assert {(c, "triton", m) for c in ("window64", "indexer_gqa") for m in ("fwd", "fwd+bwd")} <= ran
    note = {(r["pattern"], r["peer"], r["mode"]): r["note"] for r in rows}
    assert note[("block_local", "triton", "fwd")].startswith("skipped: dry run")
    assert note[("indexer_gqa", "flex", "fwd")].startswith("not available: no simple mask_mod")
    assert "calls of 1 heads" in note[("indexer_gqa", "triton", "fwd")] or "one call" in note[("indexer_gqa", "triton", "fwd")]
    assert {r["kv_heads"] for r in rows if r["pattern"] == "indexer_gqa"} == {"1"}
    # a tc row without a time says why (the dry run's interpreter runs the first and grouped cases only)
    for r in rows:
        if r["peer"] == "tc" and not r["ms"]:
            assert r["note"].startswith(("not available", "skipped: dry run"))
    assert all(r["tc_share"] or r["plan_note"] for r in per_case)
    assert {r["device"] for r in rows + per_case} == {rows[0]["device"]} and "dry run" in rows[0]["device"]
    out = capsys.readouterr().out
    assert "dry run" in out and "window64 n=64 fwd+bwd: Flex kernel / tc >= 1" in out


def test_dry_run_past_its_budget_skips_every_case_with_a_note(tmp_path):
    assert main(["--suite", "--dry-run", "--no-progress", "--out", str(tmp_path), "--cases", "window64", "random1%",
                 "--budget-s", "0.001"]) == 0
    rows, steps = _read(tmp_path / "suite_attention.csv"), _read(tmp_path / "suite_steps.csv")
    assert rows and all(r["note"].startswith("skipped: time budget") and not r["ms"] for r in rows)
    assert {r["pattern"] for r in rows} == {"window64", "random1%"}
    assert steps and all(not r["ms"] and r["note"] for r in steps)
    assert {r["note"].split(" (")[0] for r in steps if r["variant"] == "new_edges"} == {"skipped: time budget"}


def test_help_names_the_suite_and_its_cases(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0 and "--suite" in out and "random1%" in out and "timeout_s" in out


def test_suite_order_runs_every_case_once_before_any_twice():
    names = [(c.name, c.n) for c in suite_cases()]
    assert [name for name, _ in names[: len(SIZES)]] == list(SIZES) and len(set(names)) == len(names)
    assert len(names) == sum(map(len, SIZES.values()))
    assert max(n for _, n in names) == 1 << 17 and {("causal", 32768), ("causal", 65536)} <= set(names)


def test_cases_are_the_sets_their_flex_mask_mods_state():
    for name in ("window64", "window256", "causal", "documents", "block_local"):
        c = case(name, 600)
        ei = c.make(torch.device("cpu"))
        qi, kj = torch.meshgrid(torch.arange(600), torch.arange(600), indexing="ij")
        assert torch.equal(c.mask_mod(torch.device("cpu"))(0, 0, qi, kj), builders.to_mask(ei, 600, 600)), name
    assert case("causal", 64).causal and not case("window64", 64).causal
    gqa = case("indexer_gqa", 64, dry_run=True)
    ei = gqa.make(torch.device("cpu"))
    assert gqa.groups == 4 and bool((ei[0] <= ei[1]).all())  # causal top-k
    assert int(torch.bincount(ei[1], minlength=64).max()) == 16  # the dry run's 16 keys a query


def _gqa_inputs(dtype=torch.float64):
    ei = builders.window(16, 3)  # no empty row: SDPA's boolean mask would give NaN there
    c = Case("g", "indexer", 16, lambda device: ei, heads=4, kv_heads=2, dim=8)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(16, 4, 8, generator=g, dtype=dtype)
    k, v = (torch.randn(16, 2, 8, generator=g, dtype=dtype) for _ in range(2))
    mask = builders.to_mask(ei, 16, 16)
    # the oracle: query head h reads key head h // 2 (SDPA's enable_gqa), each head attended densely under the mask
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    scores = torch.einsum("ihd,jhd->hij", q, kk) / 8**0.5
    ref = torch.einsum("hij,jhd->ihd", scores.masked_fill(~mask, float("-inf")).softmax(-1), vv)
    return c, ei, q, k, v, ref


def _as_nhd(out):
    return out[0].transpose(0, 1) if out.dim() == 4 else out


@pytest.mark.parametrize("peer", ["sdpa_mask", "flex_edges", "triton"])
def test_grouped_query_peers_equal_the_dense_oracle(peer):
    from torch.nn.attention.flex_attention import flex_attention

    from tgattn.engine.triton.attention import interpreter_ready

    c, ei, q, k, v, ref = _gqa_inputs()
    if peer == "triton" and not interpreter_ready():
        pytest.skip("Triton's interpreter is not on (TRITON_INTERPRET=1 before triton is imported)")
    x = gpu_peers.Inputs(c, ei, ei, None, q, k, v, flex_attention)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager Flex: "called without torch.compile"
        out = _as_nhd(gpu_peers.build(peer, x).call())
    assert out.shape == ref.shape and (out - ref).abs().max() <= 1e-10


def test_a_backend_this_checkout_lacks_is_not_available_with_the_reason(monkeypatch):
    import tgattn.functional

    c, ei, q, k, v, _ = _gqa_inputs()
    x = gpu_peers.Inputs(c, ei, ei, None, q, k, v, None)
    monkeypatch.setattr(tgattn.functional, "BACKENDS", tuple(b for b in tgattn.functional.BACKENDS if b != "tc"))
    with pytest.raises(gpu_peers.NotAvailable, match="no backend 'tc'"):
        gpu_peers.build("tc", x)


def test_tile_columns_and_predictions_come_from_the_contract_names(monkeypatch):
    """plan_tiles / choose_blocks / predict stand-ins (tile counts from a recount, a fixed
    prediction: the forward's, or the backward's alone): the case rows carry their share, counts
    and milliseconds, forward + backward the sum of both predictions."""
    seen = {}

    class Plan:
        def __init__(self, ptr, col, nq, nk, block_m, block_n):
            self.block_m, self.block_n = block_m, block_n
            self.rest_ptr, self.rest_col = torch.zeros(nq + 1, dtype=torch.long), col[:0]  # nothing scattered
            rows = torch.repeat_interleave(torch.arange(nq), ptr.diff())
            tiles = torch.unique((rows // block_m) * nk + col // block_n, return_counts=True)[1]
            self.num_edges, self.n_full = col.numel(), int((tiles == block_m * block_n).sum())
            self.n_partial, self.tc_edges = int((tiles < block_m * block_n).sum()), int(tiles[tiles == block_m * block_n].sum())

        @property
        def tc_share(self):
            return self.tc_edges / self.num_edges

    def plan_structure(s, *, block_m, block_n, min_fill=None):
        seen["blocks"], seen["min_fill"] = (block_m, block_n), min_fill
        return Plan(s.rowptr.long(), s.src, s.n_q, s.n_k, block_m, block_n)

    def predict(plan, *, heads, head_dim, dtype, backward=False, card="h100"):
        seen.setdefault("calls", []).append((heads, head_dim, dtype, backward, card))
        return {"tiles_s": 1e-3, "gather_s": 2e-3, "total_s": 3e-3 * (1 + backward), "roofline_s": 1e-3}

    from tgattn.engine.triton import tc, tile_cost  # the suite plans as the tc backend does: through its names

    monkeypatch.setattr(tc, "plan_structure", plan_structure)
    monkeypatch.setattr(tc, "choose_blocks", lambda dtype, d: (16, 16))
    monkeypatch.setattr(tc, "break_even_fill", lambda *shape: None)
    monkeypatch.setattr(tile_cost, "predict", predict)
    c = case("block_local", 512)  # blocks of 256: every 16 x 16 tile full
    s = analyse(c.make(torch.device("cpu")), 512, 512)
    plan = gpu_suite.plan_case(c, s, torch.bfloat16, "h200")
    assert plan.note == "" and seen["blocks"] == (16, 16) and seen["min_fill"] is None  # no break-even: the default
    assert plan.columns["tc_share"] == 1.0 and plan.columns["n_partial"] == 0 and plan.columns["n_full"] == 2 * 16 * 16
    assert seen["calls"] == [(8, 64, torch.bfloat16, False, "h200"), (8, 64, torch.bfloat16, True, "h200")]
    tiles_flop = 2 * 16 * 16 * 16 * 16 * 8 * 4 * 64  # every tile of 16 x 16, 8 heads, 4 d a cell
    assert plan.columns["tile_gflop"] == pytest.approx(tiles_flop / 1e9) and plan.columns["peak_tflops"] == 989.0
    rows = [dict(peer="tc", mode="fwd+bwd", ms=18.0), dict(peer="tc", mode="fwd", ms=4.0)]
    fwd, both = case_rows(dict(pattern="block_local", n=512), plan.columns, plan.predicted, plan.note, rows)
    assert fwd["tile_peak_pct"] == pytest.approx(100 * tiles_flop / 4e-3 / 989e12)  # forward: its own time
    assert both["tile_peak_pct"] == pytest.approx(100 * 2.5 * tiles_flop / 14e-3 / 989e12)  # backward: 18 - 4 ms
    assert fwd["pred_ms"] == pytest.approx(3.0) and both["pred_ms"] == pytest.approx(9.0)
    assert both["pred_tiles_ms"] == pytest.approx(2.0) and both["roofline_ms"] == pytest.approx(2.0)
    assert both["tc_over_pred"] == pytest.approx(2.0) and both["tc_over_roofline"] == pytest.approx(9.0)
    # grouped-query heads packed into the tiles' rows: a quarter of the rows a tile, a quarter of the heads
    seen.clear()
    labels = []
    monkeypatch.setattr(gpu_suite, "launch_options", lambda *key: labels.append(key) or "")
    gpu_suite.plan_case(c, s, torch.bfloat16, "h100", group=4)
    assert seen["blocks"] == (4, 16) and {call[0] for call in seen["calls"]} == {2}
    assert labels == [(torch.bfloat16, 64, 16, 16)]  # the options' key: a tile's rows (4 queries x 4 heads)


def test_ratios_divide_by_the_tc_row_of_the_same_mode_with_and_without_setup():
    rows = [dict(peer="tc", mode="fwd", ms=2.0, setup_ms=1.0), dict(peer="flex", mode="fwd", ms=4.0, setup_ms=5.0),
            dict(peer="flex", mode="fwd+bwd", ms=8.0, setup_ms=5.0), dict(peer="triton", mode="fwd", ms=None, setup_ms=None)]
    gpu_suite._ratios(rows)
    assert rows[1]["ratio"] == 2.0 and rows[1]["ratio_setup"] == 3.0 and rows[0]["ratio"] == 1.0
    assert "ratio" not in rows[2] and "ratio" not in rows[3]  # no tc time in that mode; no time of its own


def test_the_guard_skips_a_slow_call_and_what_the_budget_cannot_hold():
    small, big = case("window64", 1024), case("window64", 65536)
    est = gpu_suite.Estimates()
    est.record(small, 100_000, "triton", "fwd", ms=200.0, first_s=0.3)
    clock = gpu_suite.Clock(1000.0)
    assert gpu_suite._skip(est, clock, 0.0, big, 100_000 * 64, "triton", "fwd", 3, True).startswith("skipped: one call")
    assert gpu_suite._skip(est, clock, 0.0, small, 100_000, "triton", "fwd", 3, True) == ""
    # a Flex compile not seen yet costs FLEX_COMPILE_S: more than 30 s left of the budget are needed
    assert gpu_suite._skip(est, gpu_suite.Clock(30.0), 0.0, small, 100_000, "flex", "fwd+bwd", 3, True).startswith(
        "skipped: time budget")
    assert gpu_suite._skip(est, gpu_suite.Clock(30.0), 0.0, small, 100_000, "flex", "fwd+bwd", 3, False) == ""


def test_targets_judge_each_family_by_its_own_peer():
    cases = [
        dict(pattern="documents", family="structured", n=16384, mode="fwd", flex=1.1, flex_fa4=1.05),
        dict(pattern="window256", family="structured", n=131072, mode="fwd", flex=1.4, tile_peak_pct=24.4),
        dict(pattern="random1%", family="scattered", n=16384, mode="fwd", triton=1.5, sdpa_dense=0.9),
        dict(pattern="indexer_gqa", family="indexer", n=16384, mode="fwd+bwd", triton=2.5),
        dict(pattern="graph16", family="gnn", n=131072, mode="fwd", triton=1 / 1.02),
        dict(pattern="molecules", family="gnn", n=98000, mode="fwd+bwd", triton=None),
    ]
    steps = [dict(variant="new_edges", model="tgattn", vs_gat=0.65), dict(variant="cuda_graph", model="tgattn", vs_gat=0.55)]
    lines = {line[:70].strip(): line[70:].split() for line in suite_targets(cases, steps).splitlines()}
    assert lines["documents n=16384 fwd: Flex kernel / tc >= 1"] == ["1.05x", "met"]  # the fastest Flex: FA4's
    assert lines["window256 n=131072 fwd: Flex kernel / tc >= 1.3"] == ["1.40x", "met"]
    assert lines["window256 n=131072 fwd: the forward's tiles at >= 25 % of the peak"] == ["24", "%", "NOT", "met"]
    assert "documents n=16384 fwd: (Flex + mask) / (tc + plan) >= 2" not in lines  # setup counted from 65k
    assert lines["random1% n=16384 fwd: min(gather, dense SDPA) / tc >= 1"] == ["0.90x", "NOT", "met"]
    assert lines["indexer_gqa n=16384 fwd+bwd: gather / tc >= 2"] == ["2.50x", "met"]
    assert lines["graph16 n=131072 fwd: tc / gather <= 1.05"] == ["1.02x", "met"]
    assert lines["molecules n=98000 fwd+bwd: tc / gather <= 1.05"] == ["n/a"]
    assert lines["molecules, new edge set each step: tgattn / GATConv <= 0.7"] == ["0.65x", "met"]
    assert lines["molecules, fixed batch, torch.cuda.graph: tgattn / GATConv <= 0.5"] == ["0.55x", "NOT", "met"]
    assert lines["molecules, prepared each step: tgattn / GATConv <= 0.7"] == ["n/a"]


@pytest.mark.slow
def test_molecule_steps_on_a_cpu_run_eagerly_and_say_why_the_rest_did_not():
    from tgattn.bench.gpu.steps import molecule_steps

    rows = molecule_steps("cpu", gpu_suite.Clock(600.0), graphs=4, rounds=1)
    got = {(r["variant"], r["model"]): r for r in rows}
    assert set(got) == {(v, m) for v in ("new_edges", "fixed_eager", "cuda_graph", "compiled") for m in ("gat", "tgattn")} | {
        ("new_edges", "tgattn_prepared")}
    assert got[("new_edges", "gat")]["vs_gat"] == 1.0 and got[("new_edges", "tgattn")]["ms"] > 0
    assert got[("cuda_graph", "gat")]["note"] == "not available: CUDA graphs need a GPU"
    assert got[("compiled", "gat")]["ms"] > 0 and "eager" in got[("compiled", "gat")]["note"]
    assert all(r["ms"] or r["note"] for r in rows)
    assert {r["graphs"] for r in rows} == {4}


def test_scattered_cases_plan_no_tile_and_tc_runs_them_on_the_gather_path_alone(monkeypatch):
    """random / top-k 1 %: every tile under the break-even (tiles pay from ~3 % full, data/gpu/h100_suite),
    so the plan holds no tile and ``tc`` calls the gather path itself: no tile launch, no merge."""
    pytest.importorskip("triton")
    from tgattn.engine.triton import tc

    calls = []
    monkeypatch.setattr(tc, "triton_attention", lambda *args, **kwargs: calls.append(args) or ("gathered", None))
    monkeypatch.setattr(tc.TileAttention, "apply", lambda *args: pytest.fail("a plan without tiles ran the tiles"))
    for name in ("random1%", "topk1%"):
        c = case(name, 2048)
        s = analyse(c.make(torch.device("cpu")), c.n, c.n)
        plan = gpu_suite._plan_tiles(s, c, torch.bfloat16)
        assert plan.n_full + plan.n_partial == 0 and plan.tc_share == 0.0, name
        q = torch.randn(c.n, 2, 64, dtype=torch.bfloat16)
        assert tc.tc_attention(q, q, q, s, None, 0.125) == ("gathered", None) and len(calls) == 1
        calls.clear()


def test_flex_on_its_flash_backend_says_in_one_line_why_it_cannot_run_here():
    c, ei, q, k, v, _ = _gqa_inputs()
    why = gpu_peers.flash_backend_missing(q)
    assert why and "\n" not in why and ("FLASH" in why or "flash_attn" in why)
    for peer in ("flex_fa4", "flex_fa4_dense"):
        with pytest.raises(gpu_peers.NotAvailable, match=why.split("(")[0][:30]):
            gpu_peers.build(peer, gpu_peers.Inputs(c, ei, ei, None, q, k, v, None))


@pytest.mark.slow  # ~10 s: the tc path through Triton's interpreter at 64 x 64 tiles
def test_a_band_past_the_list_size_runs_without_an_edge_list(monkeypatch):
    """causal past the list size: tc over prepare_band's set, SDPA's mask from the band, and the
    peers that need the edge list say why they did not run."""
    from tgattn.engine.triton.attention import interpreter_ready

    if not interpreter_ready():
        pytest.skip("Triton's interpreter is not on (TRITON_INTERPRET=1 before triton is imported)")
    monkeypatch.setattr(gpu_cases, "EDGE_LIST_MAX", 0)
    made = []
    c = case("causal", 64, heads=2, dim=16)
    c = Case(**{**c.__dict__, "make": lambda device: made.append(1)})  # an edge list must not be asked for
    rows, per_case = gpu_suite.attention_suite([c], gpu_peers.SUITE_PEERS, device=torch.device("cpu"),
                                               dtype=torch.bfloat16, device_name="cpu", repeats=0,
                                               clock=gpu_suite.Clock(86400.0), progress=False)
    got = {(r["peer"], r["mode"]): r for r in rows}
    assert not made and got[("tc", "fwd+bwd")]["ms"] and "prepare_band" in got[("tc", "fwd")]["note"]
    for peer in ("triton", "flex_edges"):
        assert got[(peer, "fwd")]["note"].startswith("not available: no edge list at 2,080 edges")
    assert got[("sdpa_mask", "fwd")]["ms"] and "from the band" in got[("sdpa_mask", "fwd")]["note"]
    assert [r["edges"] for r in per_case] == [64 * 65 // 2] * 2 and per_case[0]["tc_share"] == 1.0


def test_the_suite_runs_the_launch_option_sweep_first_and_tc_then_reads_its_table(monkeypatch, tmp_path):
    """Through a stand-in sweep: it runs within the budget left, and tc then reads the sweep's table
    (the real table reader, on the table the stand-in wrote)."""
    from tgattn.engine.triton import tile_config

    seen = {}

    def tune(out, *, dry_run, budget_s):
        seen.update(out=out, dry_run=dry_run, budget_s=budget_s)
        rows = [dict(card="NVIDIA H200", dtype="bfloat16", head_dim=64, block_m=64, block_n=64, kernel=kernel,
                     num_warps=8, num_stages=4) for kernel in tile_config.KERNELS]
        with open(out / "tile_configs.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, tile_config.TABLE_FIELDS)
            writer.writeheader()
            writer.writerows(rows)
        return [dict(kernel="forward", num_warps=8, num_stages=4, ms=1.0)], rows

    monkeypatch.setattr(gpu_launch.tune, "tune", tune)
    monkeypatch.setitem(tile_config.TABLE_IN_FORCE, "path", tile_config.TABLE_IN_FORCE["path"])  # undone after the test
    assert gpu_launch.tune_sweep(torch.device("cpu"), gpu_suite.Clock(50.0), tmp_path, dry_run=True)[1].startswith(
        "skipped: dry run")
    rows, note = gpu_launch.tune_sweep(torch.device("cpu"), gpu_suite.Clock(50.0), tmp_path, dry_run=False, reserve=20.0)
    assert rows == [dict(kernel="forward", num_warps=8, num_stages=4, ms=1.0)] and note.startswith("ran within")
    assert not seen["dry_run"] and seen["out"] == tmp_path and 25.0 < seen["budget_s"] <= 30.0  # the budget less the reserve
    tuned = tile_config.tile_config(torch.bfloat16, 64, 64, 64, arch=90, card="NVIDIA H200")  # tc's table from here on
    assert (tuned.forward, tuned.dq, tuned.dkdv) == ((8, 4),) * 3
    assert tile_config.tile_config(torch.bfloat16, 64, 64, 64, arch=90, card="none").forward == (4, 3)
    assert gpu_launch.tune_sweep(torch.device("cpu"), gpu_suite.Clock(10.0), tmp_path, dry_run=False,
                                 reserve=20.0) == ([], "skipped: time budget (10 s left of 10 s)")
    monkeypatch.setattr(gpu_launch.tune, "tune", lambda out, **kwargs: 1 / 0)
    assert gpu_launch.tune_sweep(torch.device("cpu"), gpu_suite.Clock(50.0), tmp_path, dry_run=False) == (
        [], "failed: ZeroDivisionError: division by zero")


def test_case_rows_name_the_launch_options_the_tile_kernels_ran_with(monkeypatch):
    from tgattn.engine.triton import tile_config

    tuned = tile_config.TileConfig(forward=(8, 4), dq=(4, 2), dkdv=(8, 5), dkdv_split=2)
    monkeypatch.setattr(tile_config, "tile_config",
                        lambda dtype, head_dim, rows, keys: tuned if (rows, keys) == (64, 64) else None)
    assert gpu_launch.launch_options(torch.bfloat16, 64, 64, 64) == (
        "forward 8w 4s, dq 4w 2s, dkdv 8w 5s (2 programs a key block)")


def test_a_flash_peer_that_fails_says_so_on_one_line_and_is_not_retried(monkeypatch):
    calls = []

    def broken(peer, x):
        def call():
            calls.append(x.case.n)
            raise RuntimeError("BACKEND='FLASH' but flash attention cannot be used:\n  NYI")
        return gpu_peers.Built(call)

    monkeypatch.setattr(gpu_suite, "build", broken)
    cases = [case("window64", 64, heads=2, dim=16), case("window64", 128, heads=2, dim=16)]
    rows, _ = gpu_suite.attention_suite(cases, ["flex_fa4"], device=torch.device("cpu"), dtype=torch.float32,
                                        device_name="cpu", repeats=0, clock=gpu_suite.Clock(86400.0), progress=False)
    notes = [r["note"] for r in rows]
    assert notes[0] == "failed: RuntimeError: BACKEND='FLASH' but flash attention cannot be used: NYI"
    assert notes[2].startswith("skipped: failed at window64 n=64 (RuntimeError: BACKEND='FLASH'")
    assert calls == [64, 64]  # forward and forward + backward once each, at the first case only
