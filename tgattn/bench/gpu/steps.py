"""Issue 49's GPU case in the suite: one training step (forward, backward, Adam) of the GAT paper's
two-layer network, 8 heads of 8 channels, on batches of 128 molecule-sized graphs, GATConv
against tgattn's ``GraphAttentionConv``.

Variants (the ``variant`` column):

* ``new_edges``: a new batch, so a new edge set, every step (the models interleaved step by
  step); ``tgattn_prepared`` calls ``tgattn.prepare`` on each batch inside its step;
* ``fixed_eager``: one batch every step, eagerly (tgattn over the batch's prepared edge set): the
  baseline of the two below;
* ``cuda_graph``: the whole step captured once with ``torch.cuda.graph`` (Adam ``capturable``)
  and replayed;
* ``compiled``: the network under ``torch.compile(mode="reduce-overhead")`` (CUDA graphs of
  Inductor's kernels; in a dry run ``backend="eager"``, which runs on a CPU in seconds).

``vs_gat`` is a row's time over GATConv's ``new_edges`` step (the issue's targets: tgattn
<= 0.7x with a new edge set each step, <= 0.5x with CUDA graphs over a fixed batch).
"""
from __future__ import annotations

import time
from typing import Callable, Dict, List, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .suite import Clock
from ..measure import interleaved

STEP_FIELDS = ("variant", "model", "graphs", "nodes", "edges", "ms", "first_s", "vs_gat", "note", "device")
HEADS, CHANNELS, FEATURES, CLASSES = 8, 8, 64, 16
# Seconds a variant's row may take on a GPU (estimates; a compile of the network dominates): a row
# starts only with that much of the budget left, else its note says it was skipped
STEP_S = {"new_edges": 10.0, "fixed_eager": 5.0, "cuda_graph": 10.0, "compiled": 60.0}


class Prepared(nn.Module):
    """``net`` called with ``prepare(edge_index, n, n)`` of each batch, prepared inside the call."""

    def __init__(self, net: nn.Module, prepare: Callable):
        super().__init__()
        self.net, self.prepare = net, prepare

    def forward(self, x, edge_index):
        return self.net(x, self.prepare(edge_index, x.shape[0], x.shape[0]))


def train_steps(nets: Dict[str, nn.Module], batches: Sequence[tuple], device, repeats: int) -> Dict[str, float]:
    """Minimum ms of one optimizer step of each net, the nets in turn on ``batches[r]`` in round
    ``r`` (:func:`~tgattn.bench.measure.interleaved`: round 0 warms up; the GPU synchronised
    before the clocks start and before they stop)."""
    opts = {model: torch.optim.Adam(net.parameters(), lr=0.005) for model, net in nets.items()}

    def step(model: str):
        def run(r: int) -> None:
            x, edge_index, y, mask = batches[r]
            opts[model].zero_grad()
            F.cross_entropy(nets[model](x, edge_index)[mask], y[mask]).backward()
            opts[model].step()

        return run

    for net in nets.values():
        net.train()
    sync = (lambda: torch.cuda.synchronize(device)) if torch.device(device).type == "cuda" else None
    wall, _, _ = interleaved({model: step(model) for model in nets}, repeats, sync=sync)
    return {model: seconds * 1e3 for model, seconds in wall.items()}


def network(model: str, device) -> nn.Module:
    """GATConv's (``"gat"``) or tgattn's (``"tgattn"``) network, initialised from seed 0."""
    from ..models import MODELS, Net

    torch.manual_seed(0)
    return Net(MODELS[model], FEATURES, CLASSES, hidden=CHANNELS, heads=HEADS).to(device).train()


def _time(make: Callable[[], Callable[[int], None]], device, rounds: int) -> Tuple[float, float]:
    """``(ms, first_s)``: the seconds to make the step and run it once (captures, compiles), then
    the best of ``rounds`` steps."""
    sync = (lambda: torch.cuda.synchronize(device)) if torch.device(device).type == "cuda" else None
    t0 = time.perf_counter()
    step = make()
    step(0)
    if sync:
        sync()
    first = time.perf_counter() - t0
    wall, _, _ = interleaved({"step": step}, rounds, sync=sync)
    return wall["step"] * 1e3, first


def _eager(net: nn.Module, x, edges, y) -> Callable[[int], None]:
    opt = torch.optim.Adam(net.parameters(), lr=0.005)

    def step(r: int) -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(net(x, edges), y).backward()
        opt.step()

    return step


def _graphed(net: nn.Module, x, edges, y) -> Callable[[int], None]:
    """The whole step captured once (after three steps on a side stream), then replayed."""
    opt = torch.optim.Adam(net.parameters(), lr=0.005, capturable=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # lets autograd and Adam allocate their state outside the capture
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(net(x, edges), y).backward()
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        F.cross_entropy(net(x, edges), y).backward()
        opt.step()
    return lambda r: graph.replay()


def _compiled(net: nn.Module, x, edges, y, cuda: bool) -> Callable[[int], None]:
    model = torch.compile(net, mode="reduce-overhead") if cuda else torch.compile(net, backend="eager")
    opt = torch.optim.Adam(net.parameters(), lr=0.005)

    def step(r: int) -> None:
        torch.compiler.cudagraph_mark_step_begin()  # the last step's graph outputs may be overwritten
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x, edges), y).backward()
        opt.step()

    return step


def molecule_steps(device, clock: Clock, *, graphs: int = 128, rounds: int = 20) -> List[dict]:
    """One row per (variant, model) of the molecule step (see the module), each within ``clock``'s
    time: a variant is skipped, with a note, when less than its :data:`STEP_S` is left."""
    from ..models import molecule_batches

    cuda = torch.device(device).type == "cuda"
    from ... import prepare

    batches = [(x.to(device), ei.to(device), y.to(device), slice(None))
               for x, ei, y in molecule_batches(rounds + 1, graphs=graphs, features=FEATURES)]
    nodes, edges = batches[0][0].shape[0], batches[0][1].shape[1]
    rows: List[dict] = []

    def row(variant, model, ms=None, first_s=None, note=""):
        rows.append(dict(variant=variant, model=model, graphs=graphs, nodes=nodes, edges=edges, ms=ms, first_s=first_s,
                         note=note))

    def budget(variant: str) -> str:
        left = clock.left()
        return "" if left >= STEP_S[variant] else f"skipped: time budget ({max(left, 0):.0f} s left, ~{STEP_S[variant]:.0f} s needed)"

    models = {model: network(model, device) for model in ("gat", "tgattn")}
    models["tgattn_prepared"] = Prepared(network("tgattn", device), prepare)
    ms = {} if budget("new_edges") else train_steps(models, batches, device, rounds)
    for model in ("gat", "tgattn", "tgattn_prepared"):
        row("new_edges", model, ms.get(model), note=budget("new_edges"))

    x, edge_index, y, _ = batches[0]
    fixed = {"tgattn": prepare(edge_index, nodes, nodes), "gat": edge_index}
    variants = [("fixed_eager", lambda net, e: _eager(net, x, e, y), ""),
                ("cuda_graph", lambda net, e: _graphed(net, x, e, y), "" if cuda else "not available: CUDA graphs need a GPU"),
                ("compiled", lambda net, e: _compiled(net, x, e, y, cuda), "")]
    for variant, make, why in variants:
        for model in ("tgattn", "gat"):  # tgattn first: a failed capture of GATConv's step comes last
            note = why or budget(variant)
            if note:
                row(variant, model, note=note)
                continue
            try:
                got, first = _time(lambda: make(network(model, device), fixed[model]), device, rounds)
                row(variant, model, got, first, "backend='eager' (dry run)" if variant == "compiled" and not cuda else "")
            except Exception as err:  # a step that cannot be captured or compiled: its row says why
                row(variant, model, note=f"failed: {type(err).__name__}: {str(err)[:120]}")
                if cuda:
                    torch.cuda.synchronize(device)
    gat = next((r["ms"] for r in rows if r["variant"] == "new_edges" and r["model"] == "gat"), None)
    for r in rows:
        r["vs_gat"] = r["ms"] / gat if r["ms"] and gat else None
    return rows
