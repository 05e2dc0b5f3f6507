"""The workloads of :mod:`tgattn.bench.gnn`, each timing its models' steps interleaved into the
benchmark's rows, with the networks they train: imported by the command line once its arguments
are parsed, so that ``--help`` and a bad argument need no torch.
"""
from __future__ import annotations

from typing import Callable, Dict, Iterable, List

import torch
import torch.nn.functional as F
from torch import nn

from ..measure import interleaved
from ..models import MODELS, Net, build_model, molecule_batches

EDGE_FEATURES = 4


def _random_graph(nodes: int, degree: int, features: int, classes: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(0, nodes, (nodes * degree,), generator=g)
    dst = torch.randint(0, nodes, (nodes * degree,), generator=g)
    return torch.randn(nodes, features, generator=g), torch.stack([src, dst]), torch.randint(0, classes, (nodes,), generator=g)


def _step(net: Net, opt, x, edge_index, y, mask) -> None:
    opt.zero_grad()
    F.cross_entropy(net(x, edge_index)[mask], y[mask]).backward()
    opt.step()


def _interleaved(candidates: Dict[str, Callable[[int], None]], rounds: int, progress) -> Dict[str, float]:
    """Minimum wall ms of ``fn(round)`` per candidate, one call each per round (round 0 warms up)."""
    wall, _, _ = interleaved(candidates, rounds, on_round=lambda r: progress.update(1))
    return {name: seconds * 1e3 for name, seconds in wall.items()}


def graph_workload(name: str, models: Iterable[str], data, rounds: int, progress) -> List[dict]:
    """Train step and eval forward on one fixed graph: ``data`` (a prepared Planetoid graph), or random."""
    if name == "random100k":
        from torch_geometric.data import Data

        x, edge_index, y = _random_graph(100_000, 10, 64, 16)
        data = Data(x=x, edge_index=edge_index, y=y, train_mask=torch.ones(100_000, dtype=torch.bool))
        nets = {m: Net(MODELS[m], 64, 16) for m in models}
    else:
        nets = {m: build_model(m, data, name) for m in models}
    opts = {m: torch.optim.Adam(net.parameters(), lr=0.005) for m, net in nets.items()}
    rows = []
    train = {m: (lambda r, m=m: _step(nets[m].train(), opts[m], data.x, data.edge_index, data.y, data.train_mask)) for m in nets}

    def evaluate(m):
        def run(r):
            with torch.no_grad():
                nets[m].eval()(data.x, data.edge_index)
        return run

    if "tgattn" in nets and name != "random100k":  # (inputs per round for 100k nodes: too much memory)
        convs = (nets["tgattn"].conv1, nets["tgattn"].conv2)
        layers = [(conv.heads, conv.out_channels) for conv in convs]
        train["tgattn_engine"] = _engine_calls([(data.num_nodes, data.edge_index)] * (rounds + 1), layers, False)
    for mode, candidates in (("train", train), ("eval", {m: evaluate(m) for m in nets})):
        for m, ms in _interleaved(candidates, rounds, progress).items():
            rows.append(dict(workload=name, mode=mode, model=m, nodes=data.num_nodes, edges=data.num_edges, ms=ms))
    return rows


def molecules(models: Iterable[str], rounds: int, progress) -> List[dict]:
    """Train step on batches that bring a new edge set every step."""
    batches = list(molecule_batches(rounds + 1))
    nets = {m: Net(MODELS[m], 64, 16, hidden=16, heads=4) for m in models}
    opts = {m: torch.optim.Adam(net.parameters(), lr=0.005) for m, net in nets.items()}
    every = slice(None)

    def train(m):
        def run(r):
            x, edge_index, y = batches[r]
            _step(nets[m].train(), opts[m], x, edge_index.clone(), y, every)  # a tensor no model has seen
        return run

    candidates = {m: train(m) for m in nets}
    if "tgattn" in nets:
        candidates["tgattn_engine"] = _engine_calls([(x.shape[0], e) for x, e, _ in batches], [(4, 16), (1, 16)], True)
    x, edge_index, _ = batches[0]
    return [
        dict(workload="molecules", mode="train", model=m, nodes=x.shape[0], edges=edge_index.shape[1], ms=ms)
        for m, ms in _interleaved(candidates, rounds, progress).items()
    ]


class EdgeNet(nn.Module):
    """Two attention layers over bonds with edge features: ``conv1`` (heads concatenated), ELU, ``conv2``."""

    def __init__(self, conv1: nn.Module, conv2: nn.Module):
        super().__init__()
        self.conv1, self.conv2 = conv1, conv2

    def forward(self, x, edge_index, edge_attr):
        return self.conv2(F.elu(self.conv1(x, edge_index, edge_attr)), edge_index, edge_attr)


def edge_net(model: str, features: int = 64, channels: int = 16, heads: int = 4) -> EdgeNet:
    """The :class:`EdgeNet` of ``model`` (``gat``, ``transformer`` or ``tgattn``), ``beta=True``
    where the conv has it; ``tgattn`` takes the arguments (positional, ``TransformerConv``'s order)
    and the weights of ``transformer`` built from the same seed.

    Example:
        >>> net = edge_net("tgattn", features=8, channels=4, heads=2)
        >>> x, edge_index = torch.randn(5, 8), torch.tensor([[0, 1, 2, 3], [1, 2, 3, 4]])
        >>> net(x, edge_index, torch.randn(4, EDGE_FEATURES)).shape
        torch.Size([5, 4])
    """
    from torch_geometric.nn import GATConv, TransformerConv

    from ...nn.conv import GraphAttentionConv

    width = heads * channels
    if model == "gat":
        return EdgeNet(GATConv(features, channels, heads, edge_dim=EDGE_FEATURES),
                       GATConv(width, channels, heads, concat=False, edge_dim=EDGE_FEATURES))
    cls = {"transformer": TransformerConv, "tgattn": GraphAttentionConv}[model]
    return EdgeNet(cls(features, channels, heads, True, True, 0.0, EDGE_FEATURES),
                   cls(width, channels, heads, False, True, 0.0, EDGE_FEATURES))


def molecules_edges(models: Iterable[str], rounds: int, progress) -> List[dict]:
    """Train step of :class:`EdgeNet` on batches with 4 bond features and a new edge set every step."""
    g = torch.Generator().manual_seed(1)
    batches = [(x, ei, torch.randn(ei.shape[1], EDGE_FEATURES, generator=g), y) for x, ei, y in molecule_batches(rounds + 1)]
    nets = {}
    for m in (m for m in models if m in ("gat", "transformer", "tgattn")):
        torch.manual_seed(0)  # tgattn's weights are TransformerConv's: the same seed builds the same ones
        nets[m] = edge_net(m)
    opts = {m: torch.optim.Adam(net.parameters(), lr=0.005) for m, net in nets.items()}

    def train(m):
        def run(r):
            x, edge_index, edge_attr, y = batches[r]
            opts[m].zero_grad()
            F.cross_entropy(nets[m].train()(x, edge_index.clone(), edge_attr), y).backward()
            opts[m].step()
        return run

    x, edge_index, _, _ = batches[0]
    return [
        dict(workload="molecules_edges", mode="train", model=m, nodes=x.shape[0], edges=edge_index.shape[1], ms=ms)
        for m, ms in _interleaved({m: train(m) for m in nets}, rounds, progress).items()
    ]


def _engine_calls(graphs, layers, fresh: bool, p: float = 0.6) -> Callable[[int], None]:
    """The attention calls of the ``tgattn`` model's training step alone.

    Round r runs one :func:`~tgattn.functional.graph_attention` forward and backward per layer
    (``(heads, channels)`` each, dropout ``p``) on the self-looped edges of ``graphs[r]``
    (``(num_nodes, edge_index)``), as a never-seen tensor when ``fresh`` (then the first layer
    pays its analysis, the others find it cached, as in the model). The rest of the step
    (projections, self-loops, the other layers of the network, Adam) is left out: this row is
    the least the step costs while the engine stays as it is.
    """
    from ...edgeset import self_looped
    from ...functional import graph_attention

    g = torch.Generator().manual_seed(0)
    inputs = [[torch.randn(n, h, c, generator=g).requires_grad_() for h, c in layers for _ in "qkv"] for n, _ in graphs]
    looped = [self_looped(edge_index, n).edge_index for n, edge_index in graphs]

    def run(r):
        edge_index = looped[r].clone() if fresh else looped[r]
        for i in range(len(layers)):
            q, k, v = inputs[r][3 * i: 3 * i + 3]
            graph_attention(q, k, v, edge_index, dropout_p=p).sum().backward()
    return run


def new_edge_set_overhead(rounds: int = 100, heads: int = 8, dim: int = 16) -> dict:
    """ms of one ``graph_attention`` call on a never-seen molecule batch against a cached one.

    Example:
        >>> row = new_edge_set_overhead(rounds=2, heads=2, dim=4)
        >>> row["workload"], row["model"]
        ('overhead', 'tgattn')
    """
    from ...functional import graph_attention

    x, edge_index, _ = next(molecule_batches(1))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(x.shape[0], heads, dim, generator=g) for _ in range(3))
    # A clone is an edge set no cache has seen: made outside the timing, as a loader hands it over.
    wall, _, _ = interleaved(
        {"new": lambda ei: graph_attention(q, k, v, ei), "cached": lambda r: graph_attention(q, k, v, edge_index)},
        rounds, setup={"new": edge_index.clone},
    )
    best = {kind: seconds * 1e3 for kind, seconds in wall.items()}
    return dict(workload="overhead", mode="new_vs_cached", model="tgattn", nodes=x.shape[0], edges=edge_index.shape[1],
                ms=best["new"], vs_gat=None, vs_transformer=None, cached_ms=best["cached"],
                extra=best["new"] / best["cached"] - 1)
