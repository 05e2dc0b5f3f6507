"""Memory follows the edges, not the declared key count: a few edges among very many keys allocate no
array of one entry per key (tgattn.engine.touched).

16 queries over 2**20 distinct keys, 10 edges: every op the call runs, forward and backward (for q,
bias and edge terms: a gradient for k or v is the size of k by autograd's rule), is recorded under a
TorchDispatchMode and none may return a tensor with more than 64 KB of storage. Before, the fused
backward's transposed pattern (``colptr [n_k + 1]``, 4 MB here, 12 GB at 3e9 keys) and key / value
gradients, and the CSR kernels' head-major copies of k and v (32 MB each here; 96 GB at 3e9 keys in
float32) broke it. The numbers are checked against attention written out edge by edge in float64
(tests/edgewise_oracle.py, no tgattn code); every key differs, so a backend that reads another key
than its edge's fails.
"""
import functools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from edgewise_oracle import edgewise_attention
from tgattn.engine.touched import KEYS_PER_EDGE
from tgattn.functional import BACKENDS, graph_attention

N_Q, N_K, E, H, D = 16, 2**20, 10, 1, 4
GUARD = 64 * 1024  # bytes: far above what 10 edges need, far below one entry per key


class LargestOutput(TorchDispatchMode):
    """The largest storage (bytes) among the outputs of the ops run inside ``with``."""

    def __init__(self):
        super().__init__()
        self.largest = (0, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                self.largest = max(self.largest, (t.untyped_storage().nbytes(), str(func)), key=lambda x: x[0])
        return out


def _inputs():
    """q, k, v, edges, bias, edge term: k and v (32 MB each) made once, the others fresh for each call."""
    q, k, v, ei, bias, (e, w) = _made_once()
    return q.clone(), k, v, ei, bias.clone(), (e, w)


@functools.lru_cache(maxsize=1)
def _made_once():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(N_Q, H, D, generator=g, dtype=torch.float64)
    ei = torch.stack([torch.randint(0, N_K, (E,), generator=g), torch.randint(0, N_Q, (E,), generator=g)])
    ei[0, :3] = ei[0, 3]  # some keys shared by several edges
    # Every key distinct (a ramp: cheap at 2**20 keys), the touched ones random; the guard counts what ops make.
    k, v = (torch.linspace(-1, 1, N_K * H * D, dtype=torch.float64).view(N_K, H, D) * sign for sign in (1, -1))
    k[ei[0]], v[ei[0]] = (torch.randn(E, H, D, generator=g, dtype=torch.float64) for _ in range(2))
    bias = torch.randn(E, H, generator=g, dtype=torch.float64)
    e, w = torch.randn(E, 2, generator=g, dtype=torch.float64), torch.randn(H * D, 2, generator=g, dtype=torch.float64)
    return q, k, v, ei, bias, (e, w)


def _written_out(q, k, v, ei, bias, term, with_terms):
    e, w = term
    vectors = (e @ w.T).view(E, H, D) if with_terms else None
    return edgewise_attention(q, k, v, ei, bias=bias, key_term=vectors, value_term=vectors)


def _call(attend, with_terms, record=None):
    q, k, v, ei, bias, term = _inputs()
    assert len({tuple(row) for row in k[ei[0]].flatten(1).tolist()}) == len(set(ei[0].tolist()))  # distinct keys
    q, bias = q.requires_grad_(), bias.requires_grad_()
    recorder = record if record is not None else LargestOutput()
    with recorder:
        out, weights = attend(q, k, v, ei, bias, term, with_terms)
        (out.sum() + (weights * torch.arange(E).view(-1, 1)).sum()).backward()
    return out.detach(), weights.detach(), q.grad, bias.grad


def _tgattn(backend):
    def attend(q, k, v, ei, bias, term, with_terms):
        kw = dict(edge_key=term, edge_value=term) if with_terms else {}
        return graph_attention(q, k, v, ei, bias=bias, backend=backend, return_weights=True, **kw)

    return attend


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_terms", [False, True])
def test_few_edges_among_many_keys_allocate_nothing_per_key(backend, with_terms):
    assert N_K > KEYS_PER_EDGE * E
    recorder = LargestOutput()
    got = _call(_tgattn(backend), with_terms, recorder)
    assert recorder.largest[0] <= GUARD, recorder.largest
    expected = _call(_written_out, with_terms)
    for name, a, b in zip(["out", "weights", "q.grad", "bias.grad"], got, expected):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=name)


@pytest.mark.parametrize("backend", ["auto", "csr", "fused"])
def test_gradients_reach_the_touched_keys_of_a_materialised_k(backend):
    """With k and v that hold their rows, the gradients land on the touched rows and nowhere else."""
    g = torch.Generator().manual_seed(8)
    n_k = 200
    q, k, v = (torch.randn(n, H, D, generator=g, dtype=torch.float64, requires_grad=True) for n in (N_Q, n_k, n_k))
    ei = torch.stack([torch.tensor([7, 7, 150, 3, 199, 150]), torch.tensor([0, 2, 2, 5, 5, 15])])
    grads = []
    for name in (backend, "gather"):
        out = graph_attention(q, k, v, ei, backend=name)
        grads.append(torch.autograd.grad((out * out).sum(), (q, k, v)))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    touched = torch.zeros(n_k, dtype=torch.bool)
    touched[ei[0]] = True
    assert grads[0][1][~touched].abs().max() == 0 and grads[0][1][touched].abs().amax(dim=(1, 2)).min() > 0


@pytest.mark.parametrize("backend", ["auto", "fused"])
def test_grouped_heads_with_edge_terms_are_repeated_after_the_gather(backend):
    """Grouped-query k, v (one key head for two query heads) with edge terms on the fused path: the heads are
    repeated over the touched keys only, never over all of them (a [N_K, H, D] copy is 64 MB here)."""
    g = torch.Generator().manual_seed(5)
    heads = 2
    q = torch.randn(N_Q, heads, D, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, D, generator=g, dtype=torch.float64).expand(N_K, 1, D)
    v = torch.randn(1, 1, D, generator=g, dtype=torch.float64).expand(N_K, 1, D)
    ei = torch.stack([torch.randint(0, N_K, (E,), generator=g), torch.randint(0, N_Q, (E,), generator=g)])
    term = (torch.randn(E, 2, generator=g, dtype=torch.float64), torch.randn(heads * D, 2, generator=g, dtype=torch.float64))
    recorder = LargestOutput()
    with recorder:
        out = graph_attention(q, k, v, ei, backend=backend, edge_key=term, edge_value=term)
        (grad,) = torch.autograd.grad(out.sum(), q)
    assert recorder.largest[0] <= GUARD, recorder.largest
    expected = graph_attention(q, k.expand(N_K, heads, D), v.expand(N_K, heads, D), ei, backend="gather",
                               edge_key=term, edge_value=term)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(grad, torch.autograd.grad(expected.sum(), q)[0], rtol=1e-10, atol=1e-10)
