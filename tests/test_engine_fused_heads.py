"""The fused backward's heads taken together (key_pass_heads): on small sparse graphs read in place
(molecule batches) a task runs every head of a group of keys in turn. Shapes that take that loop and
shapes that do not (one head, a second key block, rows copied per head) equal the float64 CSR backend,
and the results do not depend on how the heads are split between threads."""
import os

import pytest
import torch

from tgattn.engine import fused
from tgattn.functional import graph_attention
from tgattn.verify import random_edges

from engine_helpers import inputs, max_err

needs_kernel = pytest.mark.skipif(
    not fused.available() and not os.environ.get("CI"), reason="no C++ toolchain here (CI requires one)"
)

# (nodes, heads, edges a row): 3 edges a row among 500 nodes (128 KB a tensor at H = 4, d = 16) take
# the heads together; 10 edges a row (two key blocks at H = 4), one head and 5,000 nodes (1.3 MB a
# tensor: per-head copies) do not.
SHAPES = {"together": (500, 4, 3), "three_heads": (300, 3, 2), "two_key_blocks": (500, 4, 10), "one_head": (500, 1, 3),
          "copied": (5000, 4, 3)}


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_heads_together_or_apart_equal_the_oracle(shape, dtype):
    nodes, heads, degree = shape
    ei = random_edges(nodes, nodes, degree / nodes, seed=6)
    q, k, v, grad_out = inputs(nodes, nodes, heads=heads, dk=16, dtype=dtype, seed=2)
    g = torch.Generator().manual_seed(3)
    bias = torch.randn(ei.shape[1], heads, generator=g, dtype=dtype)
    bias[torch.rand(ei.shape[1], heads, generator=g) < 0.1] = float("-inf")
    bias.requires_grad_()
    out = graph_attention(q, k, v, ei, bias=bias, backend="fused")
    exact = [t.detach().double().requires_grad_() for t in (q, k, v, bias)]
    ref = graph_attention(*exact[:3], ei, bias=exact[3], backend="csr")
    tol = 1e-5 if dtype == torch.float32 else 1e-10
    assert max_err(out.double(), ref) <= tol
    grads = torch.autograd.grad(out, (q, k, v, bias), grad_out)
    for a, b in zip(grads, torch.autograd.grad(ref, exact, grad_out.double())):
        assert max_err(a.double(), b) <= 10 * tol


@needs_kernel
def test_heads_together_give_the_same_bits_on_any_number_of_threads():
    """1, 2 and 3 threads split 4 heads into 1, 2 and 3 tasks of key_pass_heads (dropout on: each
    head's mask follows its own index)."""
    ei = random_edges(500, 500, 3 / 500, seed=7)
    q, k, v, grad_out = inputs(500, 500, heads=4, dk=16, dtype=torch.float32, seed=4)
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            torch.manual_seed(0)
            out = graph_attention(q, k, v, ei, dropout_p=0.4, backend="fused")
            results.append((out,) + torch.autograd.grad(out, (q, k, v), grad_out))
    finally:
        torch.set_num_threads(before)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))
