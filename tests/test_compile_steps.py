"""A compiled molecule training step: no graph break, and no recompilation across batches of new sizes.

Each batch brings a never-seen ``edge_index`` of its own size (a mini-batch GNN's step). Compiled
with ``dynamic=True``, the step is one graph for every batch (Dynamo's counters), in the default mode
and in ``mode="reduce-overhead"``; handed prepared sets (:func:`tgattn.prepare`) instead, one more
graph, again for every size, whose op finds each set's analysis in the engine's cache (made once, by
``prepare``). The losses equal the eager step's. ``torch._dynamo.explain`` finds no
graph break, over a tensor and over a prepared set. (The backward runs outside the compiled
function: Dynamo does not trace ``Tensor.backward``; AOTAutograd compiles the backward graph.)
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tgattn
from tgattn import GraphAttentionConv, engine
from tgattn.bench.models import molecule_batches


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = GraphAttentionConv(16, 8, heads=2)
        self.conv2 = GraphAttentionConv(16, 4, heads=1)

    def forward(self, x, edge_index):
        return self.conv2(torch.relu(self.conv1(x, edge_index)), edge_index)


def _batches(count=3):
    """Batches of 3 molecule-sized graphs: new edges, new sizes."""
    g = torch.Generator().manual_seed(0)
    found = []
    for _, ei, _ in molecule_batches(count, graphs=3):
        n = int(ei.max()) + 1
        found.append((torch.randn(n, 16, generator=g), ei, torch.randn(n, 4, generator=g)))
    assert len({x.shape[0] for x, _, _ in found}) == count  # sizes differ
    return found


def _loss(net):
    return lambda x, edges, y: F.mse_loss(net(x, edges), y)


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


@pytest.mark.slow  # traces the step twice (about 10 s)
def test_the_step_has_no_graph_break_over_a_new_edge_index_or_a_prepared_set():
    torch.manual_seed(0)
    loss = _loss(Net())
    x, ei, y = _batches(1)[0]
    for edges in (ei, tgattn.prepare(ei, x.shape[0], x.shape[0])):
        explained = torch._dynamo.explain(loss)(x, edges, y)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0)


@pytest.mark.slow  # compiles the step and its backward, two modes (about 60 s on 2 loaded cores)
@pytest.mark.parametrize("mode", [None, "reduce-overhead"], ids=["default", "reduce-overhead"])
def test_the_step_compiles_once_for_batches_of_new_sizes(mode):
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    torch.manual_seed(0)
    net = Net()
    compiled = torch.compile(_loss(net), mode=mode, dynamic=True)
    eager = _loss(net)
    batches = _batches()
    for x, ei, y in batches:
        got = compiled(x, ei.clone(), y)  # a never-seen edge_index
        got.backward()
        torch.testing.assert_close(got, eager(x, ei, y), atol=1e-5, rtol=1e-5)
        assert _graphs() == 1
    misses = engine.CACHE.misses
    for x, ei, y in batches:
        compiled(x, tgattn.prepare(ei, x.shape[0], x.shape[0]), y).backward()
        assert _graphs() == 2  # the prepared form: one graph more, for every size
    assert not counters["recompiles"]
    assert engine.CACHE.misses == misses  # the op finds each prepared set's analysis: none made twice
