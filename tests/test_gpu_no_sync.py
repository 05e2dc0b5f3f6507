"""The CUDA route's steady state makes no host sync, shown without a GPU (``tests/host_reads.py``:
the CPU taken for a device, Triton's interpreter for the GPU, the syncing ops recorded).

The first call on an edge set validates and analyses it and may sync; later calls must not,
forward and backward. A prepared set (:func:`tgattn.prepare`) was validated and analysed where it
was prepared: no call on it syncs or allocates by data-dependent sizes, the first one included.
"""
import pytest
import torch

import tgattn
from tgattn import builders, engine
from tgattn.engine import analysis
from tgattn.engine import edgeset
from tgattn.functional import graph_attention

from engine_helpers import inputs, max_err, oracle
from host_reads import cpu_as_cuda, recording  # noqa: F401  (a fixture)



def _edges():
    """A window with two far edges, unsorted (the engine keeps a permutation)."""
    ei = torch.cat([builders.window(24, 2), torch.tensor([[23, 0], [0, 23]])], dim=1)
    return ei[:, torch.randperm(ei.shape[1], generator=torch.Generator().manual_seed(0))]


def _step(q, k, v, ei, bias, grad_out, **options):
    out = graph_attention(q, k, v, ei, bias=bias, **options)
    return out, torch.autograd.grad(out, (q, k, v, bias), grad_out)


@pytest.mark.parametrize("options", [dict(), dict(dropout_p=0.2)], ids=["plain", "dropout"])
def test_second_call_forward_and_backward_make_no_host_sync(cpu_as_cuda, monkeypatch, options):
    ei = _edges()
    q, k, v, grad_out = inputs(24, 24, heads=2, dk=8)
    bias = torch.randn(ei.shape[1], 2, dtype=torch.float64, requires_grad=True)
    with recording() as first:
        _step(q, k, v, ei, bias, grad_out, **options)
    assert first.syncs  # validation and analysis read the edges: the recorder sees syncs
    with recording() as second:
        out, grads = _step(q, k, v, ei, bias, grad_out, **options)
    assert second.syncs == []
    assert engine.CACHE.hits == 1 and engine.CACHE.misses == 1
    if not options:  # the route is the real one: same numbers as the oracle
        ref = oracle(q, k, v, ei, bias)
        assert max_err(out, ref) <= 1e-10
        for g, r in zip(grads, torch.autograd.grad(ref, (q, k, v, bias), grad_out)):
            assert max_err(g, r) <= 1e-10


@pytest.mark.parametrize("make", [lambda: builders.causal(24), lambda: builders.full([12, 12]), lambda: builders.causal([8, 16])], ids=["causal", "packed", "packed_unequal"])
def test_sdpa_route_second_call_makes_no_host_sync(cpu_as_cuda, make):
    ei = make()
    q, k, v, grad_out = inputs(24, 24, heads=2, dk=8)
    bias = torch.randn(ei.shape[1], 2, dtype=torch.float64, requires_grad=True)
    _step(q, k, v, ei, bias, grad_out)
    with recording() as rec:
        _step(q, k, v, ei, bias, grad_out)
    assert rec.syncs == []


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's inf - inf
def test_plus_inf_bias_gives_nan_in_its_query_only_on_a_device(cpu_as_cuda, monkeypatch):
    """The +inf check would sync: on a device +inf makes its query's row NaN, nothing else."""
    ei = builders.window(20, 2)
    q, k, v, _ = inputs(20, 20, heads=2, dk=4)
    bias = torch.zeros(ei.shape[1], dtype=torch.float64)
    graph_attention(q, k, v, ei, bias=bias)  # analysed
    bias[(ei[1] == 7).nonzero()[0]] = float("inf")
    with recording() as rec:
        out = graph_attention(q, k, v, ei, bias=bias)
    assert rec.syncs == []
    assert torch.equal(out.isnan().flatten(1).any(1), torch.arange(20) == 7)


def test_device_cache_sees_in_place_writes_through_torch(cpu_as_cuda):
    ei = builders.window(20, 1)
    q, k, v, _ = inputs(20, 20, heads=2, dk=4)
    graph_attention(q, k, v, ei)
    graph_attention(q, k, v, ei)
    assert (engine.CACHE.hits, engine.CACHE.misses) == (1, 1)
    row = ei[0]  # a view shares the version counter
    row[5] = 0  # edge (0, 5) now, instead of (4, 5)
    out = graph_attention(q, k, v, ei)
    assert engine.CACHE.misses == 2
    assert max_err(out, oracle(q, k, v, ei)) <= 1e-10


def test_device_stamp_follows_the_version_counter(cpu_as_cuda):
    t = torch.arange(6).view(2, 3)
    stamp = analysis.device_stamp(t)
    assert stamp is not None and analysis.device_stamp(t) == stamp
    t.detach()[0, 0] = 5  # a detached alias shares the counter
    assert analysis.device_stamp(t) != stamp
    with torch.inference_mode():
        assert analysis.device_stamp(torch.arange(3)) is None  # no counter: compared by contents


def test_self_looped_sets_on_a_device_are_checked_by_stamp(cpu_as_cuda):
    ei = torch.tensor([[0, 1], [1, 0]])
    made = edgeset.self_looped(ei, 2)
    with recording() as rec:
        assert edgeset.self_looped(ei, 2) is made
    assert rec.syncs == []
    ei[0, 0] = 1
    assert edgeset.self_looped(ei, 2).edge_index.tolist() == [[1, 0, 1], [0, 0, 1]]  # (1, 1) is a loop now


def test_layers_second_step_makes_no_host_sync(cpu_as_cuda):
    """``GraphAttention`` and ``GraphAttentionConv`` (self-loops added: a derived edge set) in a
    training step: the steady state syncs nothing, the derived set is made once."""
    from tgattn import GraphAttention, GraphAttentionConv

    torch.manual_seed(0)
    ei = builders.window(24, 2, causal=True)
    x = torch.randn(24, 16, requires_grad=True)
    for layer in (GraphAttention(16, 2), GraphAttentionConv(16, 8, heads=2, add_self_loops=True)):
        layer(x, ei).square().sum().backward()
        with recording() as rec:
            layer(x, ei).square().sum().backward()
        assert rec.syncs == []
    assert engine.CACHE.misses == 1  # the edge set, analysed once (its self-looped twin: made once, below)
    assert engine.CACHE.lookup(ei, ("self_loops", 24), lambda *_: True) is not None


@pytest.mark.parametrize("options", [dict(), dict(dropout_p=0.2)], ids=["plain", "dropout"])
def test_first_call_on_a_prepared_set_makes_no_host_sync(cpu_as_cuda, options):
    """Prepared outside the step (validation and analysis sync there, once), the step itself reads
    nothing back and makes nothing of a data-dependent size, from its first call, forward and backward."""
    ei = _edges()
    es = tgattn.prepare(ei, 24, 24)
    q, k, v, grad_out = inputs(24, 24, heads=2, dk=8)
    bias = torch.randn(ei.shape[1], 2, dtype=torch.float64, requires_grad=True)
    for _ in range(2):
        with recording() as rec:
            out, grads = _step(q, k, v, es, bias, grad_out, **options)
        assert rec.syncs == []
    assert engine.CACHE.misses == 0  # no lookup either
    if not options:
        ref = oracle(q, k, v, ei, bias)
        assert max_err(out, ref) <= 1e-10
        for g, r in zip(grads, torch.autograd.grad(ref, (q, k, v, bias), grad_out)):
            assert max_err(g, r) <= 1e-10


def test_layers_on_a_prepared_set_make_no_host_sync(cpu_as_cuda):
    """``GraphAttention`` and ``GraphAttentionConv`` (self-loops added) over a prepared set: the looped
    set is derived once, on the first step; every later step syncs nothing."""
    from tgattn import GraphAttention, GraphAttentionConv

    torch.manual_seed(0)
    es = tgattn.prepare(builders.window(24, 2, causal=True), 24, 24)
    x = torch.randn(24, 16, requires_grad=True)
    for layer in (GraphAttention(16, 2), GraphAttentionConv(16, 8, heads=2, add_self_loops=True)):
        with recording() as first:
            layer(x, es).square().sum().backward()
        if isinstance(layer, GraphAttention):
            assert first.syncs == []
        with recording() as rec:
            layer(x, es).square().sum().backward()
        assert rec.syncs == []
    assert engine.CACHE.misses == 0
