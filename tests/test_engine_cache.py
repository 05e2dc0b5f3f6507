"""The fused kernels' cache of freed buffers: a reused block carries nothing of its last use,
the limit and ``empty_cache`` hand memory back, ``TGATTN_CPU_CACHE`` is read strictly."""
import os

import pytest
import torch

from tgattn.engine import fused, native
from tgattn.functional import graph_attention
from tgattn.verify import random_edges

from engine_helpers import TOL, inputs, max_err, oracle

needs_kernel = pytest.mark.skipif(
    not fused.available() and not os.environ.get("CI"), reason="no C++ toolchain here (CI requires one)"
)


def _with_empty_rows_and_keys(n_q: int, n_k: int, p: float) -> torch.Tensor:
    """Random edges, none into every 7th query and none from every 5th key: rows and keys
    whose outputs and gradients are zeros written by the kernel, not left from the block's
    last use."""
    src, dst = random_edges(n_q, n_k, p, seed=3)
    keep = (dst % 7 != 0) & (src % 5 != 0)
    return torch.stack([src[keep], dst[keep]])


def _attend(q, k, v, edge_index, bias, grad_out):
    out = graph_attention(q, k, v, edge_index, bias=bias, backend="fused")
    wrt = (q, k, v) if bias is None else (q, k, v, bias)
    return out, torch.autograd.grad(out, wrt, grad_out)


@needs_kernel
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize(
    "dtype, dim, p", [(torch.float64, 64, 0.01), (torch.float32, 32, 0.003)], ids=["f64-long-rows", "f32-short-rows"]
)
def test_a_reused_buffer_holds_nothing_of_its_last_use(dtype, dim, p, with_bias):
    # Outputs and gradients of 1.2-2.7 MB each come from the cache; the first call's are
    # filled with NaN and freed, so the second call gets those very blocks back. Fresh pages
    # from the system are zeros, which would hide an unwritten row; reused ones are not.
    fused.empty_cache()  # blocks left by earlier tests in this process would serve the first call
    n_q, n_k, heads = 1300, 1200, 8 if dtype == torch.float32 else 4
    edge_index = _with_empty_rows_and_keys(n_q, n_k, p)
    q, k, v, grad_out = inputs(n_q, n_k, heads=heads, dk=dim, dtype=dtype)
    bias = None
    if with_bias:
        bias = torch.randn(edge_index.shape[1], heads, dtype=dtype)
        bias[torch.rand(edge_index.shape[1]) < 0.2] = float("-inf")
        bias.requires_grad_()
    out, grads = _attend(q, k, v, edge_index, bias, grad_out)
    for t in (out, *grads):
        t.detach().fill_(float("nan"))
    del out, grads, t
    hits = fused.cache_info()["hits"]
    out, grads = _attend(q, k, v, edge_index, bias, grad_out)
    assert fused.cache_info()["hits"] >= hits + 4  # out, dq, dk, dv at least
    ref = oracle(q, k, v, edge_index, bias)
    ref_grads = torch.autograd.grad(ref, (q, k, v) if bias is None else (q, k, v, bias), grad_out)
    assert max_err(out, ref) <= TOL[dtype]
    for got, want in zip(grads, ref_grads):
        assert max_err(got, want) <= 10 * TOL[dtype]


@needs_kernel
def test_limit_and_empty_cache_hand_the_free_blocks_back():
    q, k, v, _ = inputs(1100, 1000, heads=4, dk=64)
    edge_index = random_edges(1100, 1000, 0.01, seed=0)
    limit = fused.cache_info()["limit"]
    try:
        torch.ops.tgattn_fused.cache_limit(0)
        assert fused.cache_info()["held"] == 0
        out = graph_attention(q, k, v, edge_index, backend="fused")
        del out
        assert fused.cache_info()["held"] == 0  # freed at once
        torch.ops.tgattn_fused.cache_limit(limit)
        out = graph_attention(q, k, v, edge_index, backend="fused")
        nbytes = out.untyped_storage().nbytes()
        del out
        assert fused.cache_info()["held"] >= nbytes
        fused.empty_cache()
        assert fused.cache_info()["held"] == 0
    finally:
        torch.ops.tgattn_fused.cache_limit(limit)
    with pytest.raises(RuntimeError, match="got -1"):
        torch.ops.tgattn_fused.cache_limit(-1)


@needs_kernel
def test_free_blocks_stay_within_the_most_ever_in_use():
    # Calls of eight sizes, each freed before the next: a cache that kept every block would
    # hold all eight sizes; bounded by the bytes in use at once, it holds about one call's.
    fused.empty_cache()
    sizes = []
    for n in range(1100, 1900, 100):
        q, k, v, _ = inputs(n, n, heads=4, dk=64)
        out = graph_attention(q, k, v, random_edges(n, n, 0.005, seed=n), backend="fused")
        sizes.append(out.untyped_storage().nbytes())
        del out
        info = fused.cache_info()
        assert info["held"] <= info["peak"]
    assert info["live"] == 0
    assert info["held"] < sum(sizes) / 2


@needs_kernel
def test_an_output_from_the_cache_behaves_like_any_tensor():
    q, k, v, _ = inputs(1100, 1000, heads=4, dk=64)
    out = graph_attention(q, k, v, random_edges(1100, 1000, 0.01, seed=0), backend="fused").detach()
    before = out.clone()
    out.resize_(3000, 4, 64)  # a storage that grows, as torch's own do
    assert torch.equal(out[:1100], before)
    out.share_memory_()  # moved to shared memory for torch.multiprocessing; the block goes back
    assert out.is_shared() and torch.equal(out[:1100], before)
    with torch.inference_mode():
        assert graph_attention(q, k, v, random_edges(1100, 1000, 0.01, seed=0), backend="fused").is_inference()


@pytest.mark.parametrize("raw, expected", [("0", 0), ("4096", 4096), (" 512m ", 512 * 2**20), ("1.5G", 3 * 2**29),
                                           ("", None), (None, None)])
def test_cache_limit_from_env(raw, expected):
    assert fused.cache_limit_from_env(raw) == expected


@pytest.mark.parametrize("raw", ["-1", "lots", "8T", "nan", "inf", "G"])
def test_a_bad_cache_limit_names_the_value(raw):
    with pytest.raises(ValueError, match=f"TGATTN_CPU_CACHE='{raw}'"):
        fused.cache_limit_from_env(raw)


def test_a_bad_cache_limit_raises_on_every_first_use(monkeypatch):
    monkeypatch.setenv("TGATTN_CPU_CACHE", "lots")
    monkeypatch.setitem(native._state, "tried", False)
    for _ in range(2):  # not once and then silently ignored
        with pytest.raises(ValueError, match="TGATTN_CPU_CACHE='lots'"):
            fused.available()
    assert native._state["tried"] is False
