"""The GPU suite's attention measurements: every case of :mod:`~tgattn.bench.gpu.cases` with every peer of
:mod:`~tgattn.bench.gpu.peers`, forward and forward + backward, within a time budget.

Per case it also plans the edge set's tiles as the ``tc`` backend does (the share of edges on
tensor cores) and asks the cost model (``tile_cost.predict``) for the ``tc`` path's time and its
roofline.

The budget (:class:`Clock`): before each measurement the suite estimates its cost
(:class:`Estimates`: a Flex compile, as long as the last one of the same ``mask_mod`` and mode
took, else :data:`FLEX_COMPILE_S`; a call's time from the same peer at the case's smaller size,
scaled by the edges, or by ``n**2`` for SDPA, or from the forward for the backward) and skips it,
with a note on its row, when that cost is more than the time left, or when one call would take
more than :data:`SLOW_CALL_S`.
"""
from __future__ import annotations

import gc
import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ...engine.bands import BandStructure, band_structure
from ..attention import _bytes_needed, _inputs
from .cases import Case
from .launch import launch_options
from .peers import FLASH_PEERS, FLEX_PEERS, GROUPED, TRITON_FLEX_PEERS, Built, Inputs, NotAvailable, build
from .summary import MODES, case_rows
from ..measure import best_time, run_once

# A cold compile of FlexAttention for one mask_mod (estimates until a run measures them: the
# first_s column of a flex row holds the compile and the first call)
FLEX_COMPILE_S = {"fwd": 25.0, "fwd+bwd": 50.0}
SLOW_CALL_S = 8.0  # a peer whose one call would take longer is not run at that size
MEASURE_S = 3.0  # timed repeats stop after this many seconds (at least one runs)
DENSE_PEERS = ("sdpa_mask", "sdpa_dense", "flex_fa4_dense")  # whose time grows as n**2, not as the edges


class Clock:
    """The seconds left of a budget that started at ``start`` (``time.perf_counter()``).

    Example:
        >>> clock = Clock(60.0)
        >>> 59.0 < clock.left() <= 60.0, clock.left(reserve=50.0) <= 10.0
        (True, True)
    """

    def __init__(self, budget_s: float, start: Optional[float] = None):
        self.budget_s = budget_s
        self.deadline = (time.perf_counter() if start is None else start) + budget_s

    def left(self, reserve: float = 0.0) -> float:
        return self.deadline - reserve - time.perf_counter()


@dataclass
class Plan:
    """A case's tile plan and the cost model's predictions (ms per mode), or why there are none."""

    columns: Dict[str, object] = field(default_factory=dict)
    predicted: Dict[str, Dict[str, float]] = field(default_factory=dict)  # mode -> {tiles, gather, total, roofline} ms
    note: str = ""


def card_of(device_name: str) -> str:
    """The cost model's card for a device name (``"h200"`` for an H200, else ``"h100"``).

    Example:
        >>> card_of("NVIDIA H200"), card_of("NVIDIA H100 80GB HBM3"), card_of("CPU x86_64 (dry run)")
        ('h200', 'h100', 'h100')
    """
    return "h200" if "H200" in device_name.upper() else "h100"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _seconds(fn, device: torch.device) -> Tuple[float, object]:
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - t0, out


def _plan_tiles(s, case: Case, dtype: torch.dtype, group: int = 1):
    """The plan the ``tc`` backend makes of structure ``s`` for this case's inputs, and makes it the
    same way (:func:`~tgattn.engine.triton.tc.plan_for_inputs`: its blocks, rows of queries x
    ``group`` heads that share a key head, its break-even fill, its scattered remainder)."""
    from ...engine.triton.tc import plan_for_inputs

    return plan_for_inputs(s, dtype, case.dim, group)[0]


def plan_case(case: Case, s, dtype: torch.dtype, card: str, group: int = 1) -> Plan:
    """The tile plan of the case's edge set, analysed as ``s`` (:func:`_plan_tiles`: share of edges
    on tensor cores, tile counts, planning ms; a band's from its rows' key ranges) and ``predict``'s
    times per mode (forward + backward: the forward's and the backward's added). ``group``: query
    heads packed into a tile's rows (1: the heads run apart, as in the calls per head group)."""
    from ...engine.triton.tile_cost import CARDS, predict

    plan = Plan()
    s = _fresh(s) if isinstance(s, BandStructure) else replace(s, extras={})  # planned anew: timed
    seconds, tiles = _seconds(lambda: _plan_tiles(s, case, dtype, group), s.rowptr.device)
    plan.columns = dict(tc_share=tiles.tc_share, tc_edges=tiles.tc_edges, n_full=tiles.n_full, n_partial=tiles.n_partial,
                        block_m=tiles.block_m, block_n=tiles.block_n, plan_ms=seconds * 1e3,
                        launch=launch_options(dtype, case.dim, tiles.block_m * group, tiles.block_n),  # a tile's rows: queries x group
                        # the tiles' forward products (4 d a cell and head: Q K^T, P V) and the card's peak
                        tile_gflop=(tiles.n_full + tiles.n_partial) * tiles.block_m * tiles.block_n * (case.heads // group)
                        * 4 * case.dim / 1e9, peak_tflops=CARDS[card].half_flops / 1e12)
    fwd, bwd = ({key[:-2]: value * 1e3 for key, value in predict(  # "tiles_s" -> "tiles" ms
        tiles, heads=case.heads // group, head_dim=case.dim, dtype=dtype, backward=backward, card=card).items()}
        for backward in (False, True))
    plan.predicted = {"fwd": fwd, "fwd+bwd": {key: fwd[key] + bwd[key] for key in fwd}}
    return plan


def _fresh(s: BandStructure) -> BandStructure:
    """A band's analysis made again, nothing derived yet."""
    return band_structure(s.band, s.n_q, s.n_k, s.rowptr.device)


def new_edge_set(edge_index: Optional[torch.Tensor], case: Case, dtype: torch.dtype, device: torch.device):
    """What a never-seen edge set costs the ``tc`` path before its first kernel: the engine's
    analysis (of the band, where the case is one: ``prepare_band``'s) and the tile plan, at the
    case's head grouping."""
    from ...engine import analyse

    if case.band is not None:
        return lambda: _plan_tiles(band_structure(case.band, case.n, case.n, device), case, dtype, case.groups)
    return lambda: _plan_tiles(analyse(edge_index, case.n, case.n), case, dtype, case.groups)


class Estimates:
    """Seconds a measurement will cost, from what this run measured so far.

    Example:
        >>> from tgattn.bench.gpu.cases import case
        >>> small, big = case("window64", 1024), case("window64", 4096)
        >>> est = Estimates()
        >>> est.compile_s(small, "flex", "fwd", cuda=True) == FLEX_COMPILE_S["fwd"]  # nothing seen: the default
        True
        >>> est.record(small, 100_000, "flex", "fwd", ms=2.0, first_s=12.002)
        >>> round(est.compile_s(big, "flex", "fwd", cuda=True), 3), est.call_s(big, 400_000, "flex", "fwd")
        (12.0, 0.008)
    """

    def __init__(self):
        self.calls: Dict[Tuple[str, str, str], Tuple[float, float]] = {}  # (case, peer, mode) -> (work, seconds a call)
        self.compiles: Dict[tuple, float] = {}  # Flex (peer, mask_mod, mode, grouped) -> its last compile's seconds

    @staticmethod
    def work(case: Case, edges: int, peer: str) -> float:
        return float(case.n) ** 2 if peer in DENSE_PEERS else float(edges)

    @staticmethod
    def _compile_key(case: Case, peer: str, mode: str) -> tuple:
        mask = {"flex": case.name, "flex_fa4": case.name, "flex_fa4_dense": "none"}.get(peer, "edges")  # its mask_mod
        return (peer, mask, mode, case.groups > 1)

    def call_s(self, case: Case, edges: int, peer: str, mode: str) -> Optional[float]:
        """A call's expected seconds: the same case and peer at a smaller size, scaled by the work,
        else this case's forward times 3 for the backward; ``None`` when nothing tells."""
        seen = self.calls.get((case.name, peer, mode))
        if seen is not None:
            work, seconds = seen
            return seconds * self.work(case, edges, peer) / max(work, 1.0)
        if mode == "fwd+bwd":
            fwd = self.calls.get((case.name, peer, "fwd"))
            if fwd is not None and fwd[0] == self.work(case, edges, peer):
                return 3.0 * fwd[1]
        return None

    def compile_s(self, case: Case, peer: str, mode: str, cuda: bool) -> float:
        """A Flex peer's compile before its first call at this size: what the last one of its
        ``mask_mod`` and mode took (seconds a compile with dynamic shapes skips), else
        :data:`FLEX_COMPILE_S`."""
        if not cuda or peer not in FLEX_PEERS:
            return 0.0
        return self.compiles.get(self._compile_key(case, peer, mode), FLEX_COMPILE_S[mode])

    def record(self, case: Case, edges: int, peer: str, mode: str, ms: float, first_s: float) -> None:
        self.calls[(case.name, peer, mode)] = (self.work(case, edges, peer), ms / 1e3)
        if peer in FLEX_PEERS:
            self.compiles[self._compile_key(case, peer, mode)] = max(first_s - ms / 1e3, 0.0)


def _skip(estimates: Estimates, clock: Clock, reserve: float, case: Case, edges: int, peer: str, mode: str,
          repeats: int, cuda: bool) -> str:
    """Why not to run this measurement now (``""``: run it)."""
    call = estimates.call_s(case, edges, peer, mode)
    if cuda and call is not None and call > SLOW_CALL_S:  # (a dry run's interpreter takes seconds a call)
        return f"skipped: one call would take ~{call:.0f} s (from this run's smaller size or forward)"
    cost = estimates.compile_s(case, peer, mode, cuda) + (call or 0.0) * (2 + repeats)
    left = clock.left(reserve)
    if cost > left or left <= 0:
        return f"skipped: time budget ({cost:.0f} s needed, {max(left, 0):.0f} s left of {clock.budget_s:.0f} s)"
    return ""


def _measure(built: Built, backward: bool, leaves, grad, repeats: int) -> Tuple[float, float]:
    """``(ms, first_s)``: the best of ``repeats`` timed calls after a warm-up (none: the first call
    itself), and the first call's seconds (compiles included)."""
    t0 = time.perf_counter()
    run_once(built.call, backward, leaves, grad)
    first = time.perf_counter() - t0
    if repeats == 0:
        return first * 1e3, first
    return best_time(built.call, backward, leaves, grad, repeats=repeats, budget_s=MEASURE_S), first


def _setup_ms(built: Built, device: torch.device) -> Optional[float]:
    if built.setup is None:
        return 0.0
    built.setup()  # warm: a compiled create_block_mask compiles here
    return _seconds(built.setup, device)[0] * 1e3


def _flex_function(device: torch.device, static: bool):
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention  # the dry run: eager (a CPU compile takes minutes)
    torch._dynamo.config.cache_size_limit = 64  # past the limit dynamo would run Flex eagerly, silently
    return torch.compile(flex_attention, dynamic=not static)


@dataclass
class Run:
    """What every case of one suite run shares: where and how it measures, its budget, what it
    learnt so far (call times, compiles, Flex's kernel options)."""

    device: torch.device
    dtype: torch.dtype
    card: str
    repeats: int
    clock: Clock
    reserve: float
    estimates: Estimates
    flex: object = None
    flash: object = None  # flex_attention compiled with static shapes for the FLASH backend (it inlines the masks' ints)
    flex_options: Dict[str, dict] = field(default_factory=dict)
    broken: Dict[Tuple[str, str], str] = field(default_factory=dict)  # (FLASH peer, mode) -> its failure, not retried

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def memory(self) -> float:
        return 0.75 * torch.cuda.get_device_properties(self.device).total_memory if self.cuda else 2.0**34


def run_case(case: Case, peers: Sequence[str], run: Run, skipped: Optional[Dict[str, str]] = None
             ) -> Tuple[List[dict], List[dict]]:
    """``(rows, cases)`` of one case: a row per (peer, mode), and per mode the case's plan,
    predictions and ratios (:func:`~tgattn.bench.gpu.summary.case_rows`). ``skipped``: peers not
    to run, each with its rows' note.
    """
    from ... import prepare
    from ...edgeset import prepare_band

    device, dtype = run.device, run.dtype
    # A band past the suite's list size makes no edge list: its peers that need one say so.
    banded = None if case.band is None else prepare_band(case.n, lo=case.band.lo, hi=case.band.hi,
                                                         lengths=case.band.lengths, device=device)
    edge_index = case.make(device) if case.listed else None
    listed = None if edge_index is None else prepare(edge_index, case.n, case.n)
    analysed = banded if banded is not None else listed  # the band's analysis where the case is one
    edges = analysed.num_edges
    base = dict(pattern=case.name, family=case.family, n=case.n, edges=edges, density=edges / case.n**2,
                heads=case.heads, kv_heads=case.kv_heads, dim=case.dim, dtype=str(dtype).replace("torch.", ""))
    q, _, _, grad = _inputs(case.n, case.heads, case.dim, device=device, dtype=dtype)
    _, k, v, _ = _inputs(case.n, case.kv_heads, case.dim, seed=1, device=device, dtype=dtype)
    x = Inputs(case, edge_index, listed, banded, q, k, v, run.flex,
               prepare=new_edge_set(edge_index, case, dtype, device), flex_options=run.flex_options, flash=run.flash)
    rows = []
    for peer in peers:
        rows += _peer_rows(peer, x, grad, run, base, (skipped or {}).get(peer, ""))
    _ratios(rows)
    grouped = any(r["peer"] == "tc" and GROUPED in r["note"] for r in rows)
    plan = plan_case(case, analysed.structure, dtype, run.card, case.groups if grouped else 1)
    del q, k, v, grad, x, edge_index, listed, banded, analysed
    if run.cuda:
        torch.cuda.empty_cache()
    return rows, case_rows(base, plan.columns, plan.predicted, plan.note, rows)


SMALL_FLEX = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 32,
              "num_stages": 1}  # Flex's tiles when Inductor's default config asks more shared memory than a GPU has


def _peer_rows(peer: str, x: Inputs, grad, run: Run, base: dict, why: str) -> List[dict]:
    """The rows of one peer on one case, forward and forward + backward (``why``: not run)."""
    case, edges = x.case, base["edges"]
    built = None
    why = why or _skip(run.estimates, run.clock, run.reserve, case, edges, peer, "fwd", run.repeats, run.cuda)
    if not why:  # building costs too (a mask, a compiled create_block_mask): not for a peer the budget skips
        try:
            built = build(peer, x)
        except NotAvailable as err:
            why = f"not available: {err}"
        except Exception as err:  # a peer that fails to build here (no compiler, a dtype it refuses, out of memory)
            why = _failed(err)
            _recover(peer, run.device)
    rows, setup = [], None
    for mode in MODES:
        backward = mode == "fwd+bwd"
        row = dict(base, peer=peer, mode=mode, ms=None, first_s=None, setup_ms=None, note=why)
        rows.append(row)
        if built is None:
            continue
        notes = [built.note] if built.note else []
        row["note"] = built.note
        if backward and not built.backward:
            continue
        if peer == "sdpa_mask" and _bytes_needed(peer, case.n, edges, case.heads, case.dim, backward, run.cuda,
                                                 x.q.element_size()) > run.memory:
            row["note"] = "skipped: does not fit in memory"
            continue
        skip = run.broken.get((peer, mode)) or _skip(run.estimates, run.clock, run.reserve, case, edges, peer, mode,
                                                     run.repeats, run.cuda)
        if skip:
            row["note"] = skip
            continue
        try:
            if setup is None:
                setup = _setup_ms(built, run.device)
            row["setup_ms"] = setup
            try:
                row["ms"], row["first_s"] = _measure(built, backward, (x.q, x.k, x.v), grad, run.repeats)
            except Exception as err:
                if peer not in TRITON_FLEX_PEERS or "out of resource" not in str(err) or peer in run.flex_options:
                    raise
                _recover(peer, run.device)  # Inductor's default tiles did not fit: Flex's smaller ones, from now on
                run.flex_options[peer] = SMALL_FLEX
                built = build(peer, x)
                row["ms"], row["first_s"] = _measure(built, backward, (x.q, x.k, x.v), grad, run.repeats)
                row["note"] = built.note
            run.estimates.record(case, edges, peer, mode, row["ms"], row["first_s"])
        except Exception as err:  # e.g. Flex failing to compile, out of memory
            row["note"] = "; ".join([_failed(err)] + notes)
            _recover(peer, run.device)
            if peer in FLASH_PEERS and not isinstance(err, torch.OutOfMemoryError):
                # once: each failure resets dynamo, which would cost every Flex peer its compiles again
                run.broken[(peer, mode)] = f"skipped: failed at {case.name} n={case.n} ({_failed(err)[8:60]}...)"
    return rows


def _failed(err: Exception) -> str:
    """A failure's note, on one line."""
    return f"failed: {type(err).__name__}: {' '.join(str(err).split())[:160]}"


def _recover(peer: str, device: torch.device) -> None:
    """After a failure: a failed compile must not leave dynamo running Flex eagerly for the next
    case, nor a failed allocation its cached blocks."""
    if peer in FLEX_PEERS:
        torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _ratios(rows: List[dict]) -> None:
    """Each row's time over the ``tc`` row's of its mode (``ratio``), and the same with each side's
    setup for a new edge set added (``ratio_setup``): above 1 the tensor-core path is faster."""
    tc = {r["mode"]: r for r in rows if r["peer"] == "tc" and r["ms"]}
    for r in rows:
        mine = tc.get(r["mode"])
        if mine is None or not r["ms"]:
            continue
        r["ratio"] = r["ms"] / mine["ms"]
        if r["setup_ms"] is not None and mine["setup_ms"] is not None:
            r["ratio_setup"] = (r["ms"] + r["setup_ms"]) / (mine["ms"] + mine["setup_ms"])


CASE_MIN_S = 5.0  # a case does not start with less time left (its edge set and plan take seconds)
DRY_RUN_INTERPRETED = ("tc", "triton")  # through Triton's interpreter: seconds a call, first case only


def attention_suite(cases: Sequence[Case], peers: Sequence[str], *, device: torch.device, dtype: torch.dtype,
                    device_name: str, repeats: int, clock: Clock, reserve: float = 0.0, static_flex: bool = False,
                    progress: bool = True, on_case: Optional[Callable[[List[dict], List[dict]], None]] = None
                    ) -> Tuple[List[dict], List[dict]]:
    """``(rows, cases)`` of every case in turn (:func:`run_case`), until the budget's time less
    ``reserve`` runs out: the cases left then get rows whose note says so. On a CPU (the dry run)
    each peer runs once; tgattn's Triton paths, through the interpreter, in the first case and the
    first grouped-query case only. A case that runs out of the card's memory gets rows saying so,
    and the suite goes on; ``on_case(rows, cases)`` is called after each case (to write partial CSVs).
    """
    from tqdm.auto import tqdm

    cuda = device.type == "cuda"
    run = Run(device, dtype, card_of(device_name), repeats if cuda else 0, clock, reserve, Estimates(),
              _flex_function(device, static_flex) if any(p in FLEX_PEERS for p in peers) else None,
              _flex_function(device, True) if any(p in FLASH_PEERS for p in peers) else None)
    rows: List[dict] = []
    cases_out: List[dict] = []
    grouped = [c.name for c in cases if c.groups > 1]
    interpreted = set() if cuda else {c.name for c in cases[:1]} | set(grouped[:1])
    for case in tqdm(cases, desc="gpu suite", disable=not progress):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")  # the dry run's eager Flex
            try:
                got, per_mode = _case_or_skip(case, peers, run, interpreted)
            except torch.OutOfMemoryError as err:  # one case too big for the card must not lose the others
                got, per_mode = _skipped(case, peers, run, f"failed: out of memory ({str(err).splitlines()[0][:80]})")
        if cuda:
            gc.collect()
            torch.cuda.empty_cache()
        rows += got
        cases_out += per_mode
        if on_case is not None:
            on_case(rows, cases_out)
        if not progress:
            print(f"gpu suite: {case.name} n={case.n} done, {run.clock.left():.0f} s of the budget left", flush=True)
    for r in rows + cases_out:
        r["device"] = device_name
    return rows, cases_out


def _skipped(case: Case, peers: Sequence[str], run: Run, note: str) -> Tuple[List[dict], List[dict]]:
    """Rows of a case that did not run, each with ``note`` saying why."""
    base = dict(pattern=case.name, family=case.family, n=case.n, heads=case.heads, kv_heads=case.kv_heads,
                dim=case.dim, dtype=str(run.dtype).replace("torch.", ""))
    return ([dict(base, peer=peer, mode=mode, note=note) for peer in peers for mode in MODES],
            [dict(base, mode=mode, plan_note=note) for mode in MODES])


def _case_or_skip(case: Case, peers: Sequence[str], run: Run, interpreted: set) -> Tuple[List[dict], List[dict]]:
    """:func:`run_case`, or rows saying why the case did not start (the budget)."""
    left = run.clock.left(run.reserve)
    if left < CASE_MIN_S:
        return _skipped(case, peers, run, f"skipped: time budget ({max(left, 0):.0f} s left of {run.clock.budget_s:.0f} s)")
    skipped = {} if run.cuda or case.name in interpreted else {
        p: "skipped: dry run (Triton's interpreter takes seconds a call: first and grouped-query cases only)"
        for p in DRY_RUN_INTERPRETED}
    if case.family == "gnn" and run.cuda:
        skipped.update({p: GNN_FLEX_NOTE for p in FLEX_PEERS})
    return run_case(case, peers, run, skipped)


# GNN-sized sets are judged against the gather path; Flex's compiles for them cost the budget ~30 s
GNN_FLEX_NOTE = ("skipped: a GNN set is judged against the gather path (Flex on its edge BlockMask ran 200-340x "
                 "slower than tc on the H100, data/gpu/h100_suite)")

