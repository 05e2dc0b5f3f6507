"""The analysis cache and the prepared sets' derived data under threads: several threads on fresh
and shared edge sets, with a cache of one or two entries (every store evicts), get the dense
oracle's results and raise nothing, and what a prepared set derives is made once.

Threads switch every microsecond, and a tracer hands the interpreter lock to another thread at
every bytecode of the caches' own code, so that threads meet inside the caches' bookkeeping:
without that, they switch almost only inside torch's operators (which release the lock) and
the unguarded caches failed in 1 run of 6 (a tight loop of 2,000 rounds), not in every run.
"""
import sys
import threading
import time
import types

import pytest
import torch

from tgattn import builders
from tgattn.engine import analysis, edgeset
from tgattn.functional import graph_attention
from tgattn.verify import random_edges

from engine_helpers import TOL, inputs, max_err, oracle

THREADS = 4
ROUNDS = 10


def _code_of(*classes) -> set:
    """The code objects of the classes' functions and of the functions nested in them."""
    todo = [f.__code__ for cls in classes for f in vars(cls).values() if isinstance(f, types.FunctionType)]
    seen = set()
    while todo:
        code = todo.pop()
        seen.add(code)
        todo += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    return seen


CACHE_CODE = _code_of(analysis.TensorKeyed, type(analysis.CACHE), analysis.Structure, edgeset.EdgeSet) | {
    edgeset.self_looped.__code__, edgeset._holds_input.__code__}


def _yield_at_each_opcode(frame, event, arg):
    if event == "opcode":
        time.sleep(0)  # releases the interpreter lock
    return _yield_at_each_opcode


def _trace_caches(frame, event, arg):
    if frame.f_code in CACHE_CODE:
        frame.f_trace_opcodes = True
        return _yield_at_each_opcode
    return None


def _in_threads(work) -> list:
    """Runs ``work(t)`` in ``THREADS`` threads at once, interleaved inside the caches' code;
    returns what they raised."""
    raised = []
    start = threading.Barrier(THREADS)

    def body(t):
        sys.settrace(_trace_caches)
        try:
            start.wait()
            work(t)
        except BaseException as e:  # noqa: B036 - handed to the main thread
            raised.append(e)
        finally:
            sys.settrace(None)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=body, args=(t,)) for t in range(THREADS)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    finally:
        sys.setswitchinterval(interval)
    return raised


@pytest.mark.parametrize("capacity", [1, 2])
def test_graph_attention_in_threads_on_fresh_and_shared_edge_sets(monkeypatch, capacity):
    monkeypatch.setattr(analysis.CACHE, "capacity", capacity)
    n = 12
    q, k, v, _ = inputs(n, n, heads=2, dk=4)
    q, k, v = (t.detach() for t in (q, k, v))
    shared = builders.window(n, 2)
    want_shared = oracle(q, k, v, shared)
    errors = []

    def work(t):
        for r in range(ROUNDS):
            fresh = random_edges(n, n, 0.3, seed=1000 * t + r)
            for edge_index in (fresh, shared):
                got = graph_attention(q, k, v, edge_index)
                want = want_shared if edge_index is shared else oracle(q, k, v, edge_index)
                errors.append(max_err(got, want))
            s = edgeset.structure_of(fresh, n, n)
            assert s.num_edges == fresh.shape[1] and torch.equal(s.src, fresh[0]) and torch.equal(s.dst, fresh[1])

    raised = _in_threads(work)
    assert raised == []
    assert len(errors) == THREADS * ROUNDS * 2 and max(errors) <= TOL[torch.float64]


def test_self_looped_sets_in_threads(monkeypatch):
    """Fresh and shared tensors through the cache's self-looped entries, with one entry (every store
    evicts): each thread gets the right looped set."""
    monkeypatch.setattr(analysis.CACHE, "capacity", 1)
    shared = builders.window(10, 1)
    seen = []

    def work(t):
        for r in range(ROUNDS * 2):
            for edge_index in (random_edges(10, 10, 0.3, seed=1000 * t + r), shared):
                looped = edgeset.self_looped(edge_index, 10).edge_index
                want = torch.cat([edge_index[:, edge_index[0] != edge_index[1]], torch.arange(10).expand(2, -1)], 1)
                seen.append(torch.equal(looped, want))

    assert _in_threads(work) == []
    assert len(seen) == THREADS * ROUNDS * 4 and all(seen)


def test_a_prepared_set_derives_once_in_threads():
    """Threads asking a shared prepared set for the same derived data at once: made once, one object."""
    es = edgeset.prepare(builders.window(10, 1), 10, 10)
    made, probes, looped = [], [], []

    def make():
        made.append(1)
        time.sleep(1e-3)  # the others arrive meanwhile
        return object()

    def work(t):
        for _ in range(ROUNDS):
            probes.append(es.derived("probe", make))
            looped.append(edgeset.self_looped(es, 10))

    assert _in_threads(work) == []
    assert made == [1] and len({id(p) for p in probes}) == 1 and len({id(s) for s in looped}) == 1
