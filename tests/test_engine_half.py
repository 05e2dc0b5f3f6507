"""The fused kernel reads float16 / bfloat16 q, k, v (and dO) as they are (issue 33).

It widens them in registers, computes in float32 and writes the output, the weights and the
gradients of q, k, v in the input dtype; the log-sum-exp, a bias and its gradient are float32.
Oracle: the float64 dense attention (or the textbook path with the kernel's dropout mask) on
the same rounded inputs, at the tolerances of every other half-precision test (float16 2e-3,
bfloat16 2e-2, gradients four times those). Where the build forms a bfloat16 dot product as
float32 FMAs (as for float16), the result is also bit for bit the float32 kernel's on the
widened inputs, rounded once.
"""
import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from engine_helpers import oracle
from tgattn import builders, engine, verify
from tgattn.engine import fused
from tgattn.engine.recompute import gather_attention
from tgattn.functional import graph_attention

pytestmark = pytest.mark.skipif(
    not fused.available() and not os.environ.get("CI"), reason="no C++ toolchain here (CI requires one)"
)

HALF = [torch.float16, torch.bfloat16]
TOL = {torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _rounded(shape_q, shape_k, shape_v, dtype, seed=0):
    """q, k, v as leaves in ``dtype``, and their float64 twins (the same rounded numbers)."""
    g = torch.Generator().manual_seed(seed)
    half = [torch.randn(*s, generator=g).to(dtype).requires_grad_() for s in (shape_q, shape_k, shape_v)]
    return half, [t.detach().double().requires_grad_() for t in half]


def _check(dtype, got, ref, factor=1.0, what=""):
    tol = TOL[dtype] * factor
    torch.testing.assert_close(got.double(), ref.double(), atol=tol, rtol=tol, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", verify.CASES, ids=[c.name for c in verify.CASES])
def test_every_case_against_the_float64_oracle(case, dtype):
    ei, n_q, n_k = case.make()
    (q, k, v), leaves64 = _rounded((n_q, 4, 16), (n_k, 4, 16), (n_k, 4, 16), dtype)
    go = torch.randn(n_q, 4, 16, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = graph_attention(q, k, v, ei, backend="fused")
    assert out.dtype == dtype
    grads = torch.autograd.grad(out, (q, k, v), go)
    ref = oracle(*leaves64, ei)
    ref_grads = torch.autograd.grad(ref, leaves64, go.double())
    _check(dtype, out, ref, what="out")
    for name, g, r in zip("qkv", grads, ref_grads):
        assert g.dtype == dtype
        _check(dtype, g, r, 4, f"d{name}")


# (name, edges, n, heads, d_k, d_v): long rows and keys (groups of 16 queries, sums over
# groups), rows and keys of 1 to 8 edges (the eight-lane paths), head sizes off the vector
# width, fewer than 8 heads (several key blocks: dq summed apart) and 8 (one block: dq rounded
# as it is copied), few edges among many nodes (rows read in place, dq summed where it goes).
SHAPES = [
    ("window", lambda: builders.window(300, 20), 300, 2, 64, 64),
    ("short-rows", lambda: builders.window(200, 1), 200, 8, 16, 16),
    ("random-odd-d", lambda: verify.random_edges(150, 150, 0.2, seed=3), 150, 3, 13, 21),
    ("random-8-heads", lambda: verify.random_edges(256, 256, 0.1, seed=4), 256, 8, 24, 8),
    ("few-among-many", lambda: torch.randint(0, 5000, (2, 60), generator=torch.Generator().manual_seed(5)), 5000, 2, 16, 16),
]


@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
def test_bias_with_minus_inf_returned_weights_and_their_gradients(shape, dtype):
    _, make, n, heads, dk, dv = shape
    ei = make()
    (q, k, v), (q64, k64, v64) = _rounded((n, heads, dk), (n, heads, dk), (n, heads, dv), dtype, seed=2)
    g = torch.Generator().manual_seed(6)
    e = ei.shape[1]
    bias = torch.randn(e, heads, generator=g)
    bias[torch.rand(e, heads, generator=g) < 0.2] = float("-inf")
    go, gw = torch.randn(n, heads, dv, generator=g).to(dtype), torch.randn(e, heads, generator=g).to(dtype)
    bias32 = bias.clone().requires_grad_()
    out, w = graph_attention(q, k, v, ei, bias=bias32, return_weights=True, backend="fused")
    assert out.dtype == w.dtype == dtype
    grads = torch.autograd.grad((out, w), (q, k, v, bias32), (go, gw))
    bias64 = bias.double().requires_grad_()
    ref, ref_w = graph_attention(q64, k64, v64, ei, bias=bias64, return_weights=True, backend="gather")
    ref_grads = torch.autograd.grad((ref, ref_w), (q64, k64, v64, bias64), (go.double(), gw.double()))
    _check(dtype, out, ref, what="out")
    _check(dtype, w, ref_w, what="weights")
    for name, got, r in zip(("dq", "dk", "dv", "dbias"), grads, ref_grads):
        assert got.dtype == (torch.float32 if name == "dbias" else dtype)
        _check(dtype, got, r, 4, name)


@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
@pytest.mark.parametrize("heads", [2, 8])
def test_dropout_keeps_the_kernels_mask(dtype, heads):
    """The same edges as the float32 kernel drops (the mask is a hash of seed, head and edge),
    checked against the textbook path in float64 with that mask."""
    n, d, p = 120, 16, 0.3
    ei = builders.window(n, 12)
    (q, k, v), leaves64 = _rounded((n, heads, d), (n, heads, d), (n, heads, d), dtype, seed=7)
    go = torch.randn(n, heads, d, generator=torch.Generator().manual_seed(8)).to(dtype)
    torch.manual_seed(11)
    out = graph_attention(q, k, v, ei, dropout_p=p, backend="fused")
    grads = torch.autograd.grad(out, (q, k, v), go)
    torch.manual_seed(11)
    seed = int(torch.randint(0, 2**62, ()))  # as fused_attention draws it
    s = engine.structure_of(ei, n, n)
    keep = fused.dropout_keep(heads, s.num_edges, p, seed).T.double() / (1 - p)  # [E, H], sorted order
    ref, _ = gather_attention(*leaves64, s.src, s.dst, n, None, d**-0.5, keep)
    ref_grads = torch.autograd.grad(ref, leaves64, go.double())
    assert 0 < (keep == 0).double().mean() < 1
    _check(dtype, out, ref, what="out")
    for name, got, r in zip("qkv", grads, ref_grads):
        _check(dtype, got, r, 4, f"d{name}")


@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
def test_same_bits_as_the_float32_kernel_rounded_once(shape, dtype):
    """The kernels are the float32 kernels on the same numbers with each result rounded once to
    the input dtype: within half an ulp of the input dtype (eps / 2 relative) of the float32
    twin's result, plus the float32 roundings by which the two builds of a sum may differ
    (GCC fuses multiply-adds by context) and float16's subnormal spacing. A rounding to the
    input dtype on the way (dk / dv over groups of queries, dq over keys and key blocks) is
    off by more. The backward's twin is given what the half-precision forward saved (its
    output, in the input dtype); the log-sum-exp is the same float32. Not for bfloat16 where
    the build forms its dot products natively (AVX512-BF16: another order of float32 sums,
    whose roundings a score's cancellation magnifies); the oracle tests cover it."""
    if dtype == torch.bfloat16 and "bfloat16: dot products" in torch.ops.tgattn_fused.half_paths():
        pytest.skip("this build forms bfloat16 dot products natively (another summation order)")
    _, make, n, heads, dk, dv = shape
    s = engine.structure_of(make(), n, n)
    g = torch.Generator().manual_seed(10)
    q, k = (torch.randn(n, heads, dk, generator=g).to(dtype) for _ in range(2))
    v, go = (torch.randn(n, heads, dv, generator=g).to(dtype) for _ in range(2))
    gw = torch.randn(heads, s.num_edges, generator=g).to(dtype)
    bias = torch.randn(s.num_edges, heads, generator=g)
    colptr, row_t, perm_t = fused.backward_pattern(s, True)
    ops = torch.ops.tgattn_fused

    def run(q, k, v, go, gw, out=None, w=None):
        fwd = ops.forward(q, k, v, s.rowptr, s.src, bias, 0.3, 0.2, 7, True)
        out = fwd[0] if out is None else out
        w = fwd[2] if w is None else w
        return fwd, ops.backward(go, q, k, v, out, fwd[1], w, gw, bias, s.rowptr, colptr, row_t, perm_t, 0.3, 0.2, 7, True)

    (out, lse, w), grads = run(q, k, v, go, gw)
    widened = [t.float() for t in (q, k, v, go, gw)]
    (out32, lse32, w32), grads32 = run(*widened, out=out.float(), w=w.float())
    assert out.dtype == w.dtype == dtype and lse.dtype == torch.float32
    eps = torch.finfo(dtype).eps
    tiny = torch.finfo(dtype).smallest_normal * eps  # float16's subnormal spacing

    def once(name, got, ref):
        err = (got.double() - ref.double()).abs()
        bound = (eps / 2 + 8 * torch.finfo(torch.float32).eps) * ref.double().abs() + tiny
        assert (err <= bound).all(), f"{name}: worst error / bound {(err / bound).max():.2f}"

    once("out", out, out32), once("weights", w, w32)
    torch.testing.assert_close(lse, lse32, rtol=1e-6, atol=1e-6)
    for name, got, ref in zip(("dq", "dk", "dv", "dbias"), grads, grads32):
        assert got.dtype == (torch.float32 if name == "dbias" else dtype)
        once(name, got, ref)


@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
@pytest.mark.parametrize("common", [0.0, 4.0], ids=["keys-centred", "keys-sharing-4"])
def test_half_output_as_accurate_as_torch_sdpa(dtype, common):
    """Full attention in float16 / bfloat16: the kernel's output is as close to the float64 oracle
    as torch's own F.scaled_dot_product_attention in that dtype on the CPU (mean and largest error,
    within 10 %). Value sums with the weights rounded to bfloat16 (vdpbf16ps, two rows at a time:
    the forward 1.01-1.05x faster) were further off, 1.6x on average (4.5e-4 against SDPA's
    2.8e-4 here), and were not kept."""
    import torch.nn.functional as F

    n, heads, d = 384, 4, 64
    g = torch.Generator().manual_seed(31)
    q = torch.randn(n, heads, d, generator=g).to(dtype)
    k = (common + torch.randn(n, heads, d, generator=g)).to(dtype)
    v = (3 * torch.randn(n, heads, d, generator=g)).to(dtype)
    heads_first = lambda *ts: [t.transpose(0, 1) for t in ts]  # noqa: E731
    ref = F.scaled_dot_product_attention(*heads_first(q.double(), k.double(), v.double())).transpose(0, 1)
    peer = F.scaled_dot_product_attention(*heads_first(q, k, v)).transpose(0, 1).double()
    ours = graph_attention(q, k, v, builders.full(n), backend="fused").double()
    err, peer_err = (ours - ref).abs(), (peer - ref).abs()
    assert err.mean() <= 1.1 * peer_err.mean(), (err.mean().item(), peer_err.mean().item())
    assert err.max() <= 1.1 * peer_err.max(), (err.max().item(), peer_err.max().item())


class _Float32Copies(TorchDispatchMode):
    """Records every float32 tensor an operator returns with at least ``numel`` numbers."""

    def __init__(self, numel):
        super().__init__()
        self.numel, self.seen = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.numel() >= self.numel:
                self.seen.append(str(func))
        return out


@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
def test_no_float32_copy_of_an_input(dtype):
    """Nothing of the size of q in float32 is made, forward or backward (the engine copied q, k,
    v and dO to float32 before); the probe sees the copies when the inputs are float32 twins."""
    n, heads, d = 512, 4, 32
    ei = verify.random_edges(n, n, 0.05)
    (q, k, v), _ = _rounded((n, heads, d), (n, heads, d), (n, heads, d), dtype)
    go = torch.randn(n, heads, d).to(dtype)
    graph_attention(q, k, v, ei, backend="fused")  # analysis and plan cached outside the probe
    with _Float32Copies(n * heads * d) as probe:
        out = graph_attention(q, k, v, ei, backend="fused")
        out.backward(go)
    assert probe.seen == []
    with _Float32Copies(n * heads * d) as probe:  # the probe sees float32 tensors of that size
        graph_attention(q.float(), k.float(), v.float(), ei, backend="fused").backward(go.float())
    assert probe.seen


@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
def test_double_backward_runs_in_float32(dtype):
    n, heads, d = 40, 2, 8
    ei = builders.window(n, 3)
    (q, k, v), (q64, k64, v64) = _rounded((n, heads, d), (n, heads, d), (n, heads, d), dtype, seed=12)
    go = torch.randn(n, heads, d, generator=torch.Generator().manual_seed(13)).to(dtype)
    out = graph_attention(q, k, v, ei, backend="fused")
    (dq,) = torch.autograd.grad(out, q, go, create_graph=True)
    (ddk,) = torch.autograd.grad(dq.float().square().sum(), k)
    ref = oracle(q64, k64, v64, ei)
    (dq64,) = torch.autograd.grad(ref, q64, go.double(), create_graph=True)
    (ddk64,) = torch.autograd.grad(dq64.square().sum(), k64)
    assert dq.dtype == ddk.dtype == dtype
    _check(dtype, dq, dq64, 4, "dq")
    _check(dtype, ddk, ddk64, 16, "d(|dq|^2)/dk")


def test_bad_bias_dtype_for_half_inputs_is_refused_by_the_op():
    q = torch.randn(6, 2, 8, dtype=torch.bfloat16)
    s = engine.structure_of(builders.window(6, 1), 6, 6)
    bias = torch.zeros(s.num_edges, 2, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="float32 for float16 / bfloat16 q"):
        torch.ops.tgattn_fused.forward(q, q, q, s.rowptr, s.src, bias, 0.3, 0.0, 0, False)


def kernel_dtypes(monkeypatch):
    """The dtypes of q in every call of the fused forward kernel from now on (a list that fills)."""
    seen = []
    kernel = torch.ops.tgattn_fused.forward

    def spy(q, *args):
        seen.append(q.dtype)
        return kernel(q, *args)

    monkeypatch.setattr(torch.ops.tgattn_fused, "forward", spy)
    return seen


def test_gnn_layer_in_bfloat16_runs_the_fused_kernel_on_bfloat16(monkeypatch):
    """GraphAttentionConv cast to bfloat16: its attention reaches the kernel in bfloat16 (no
    float32 copy on the way) and matches the same layer in float64."""
    from tgattn import GraphAttentionConv

    torch.manual_seed(0)
    n = 200
    conv = GraphAttentionConv(16, 8, heads=4)
    x = torch.randn(n, 16)
    ei = verify.random_edges(n, n, 0.05, seed=14)
    seen = kernel_dtypes(monkeypatch)
    conv16 = conv.to(torch.bfloat16)
    x16 = x.to(torch.bfloat16).requires_grad_()
    out = conv16(x16, ei)
    out.float().square().sum().backward()
    assert seen and set(seen) == {torch.bfloat16}
    conv64 = conv.to(torch.float64)  # the same (rounded) weights in float64
    x64 = x16.detach().double().requires_grad_()
    ref = conv64(x64, ei)
    ref.square().sum().backward()
    _check(torch.bfloat16, out, ref, 2, "out")
    _check(torch.bfloat16, x16.grad, x64.grad, 8, "dx")


def test_hf_sliding_window_model_in_bfloat16_runs_the_fused_kernel_on_bfloat16(monkeypatch):
    """A transformers Mistral with a sliding window of 3, cast to bfloat16 and run through
    tgattn.hf: its attention reaches the kernel in bfloat16 and the logits match transformers'
    own sdpa in bfloat16 (the tolerance of tests/test_hf.py's half-precision test), forward and
    a training step's gradients."""
    transformers = pytest.importorskip("transformers")
    import tgattn.hf as th

    th.register()
    torch.manual_seed(0)
    config = transformers.MistralConfig(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        sliding_window=3)
    model = transformers.MistralForCausalLM(config).to(torch.bfloat16)
    ids = torch.randint(1, 40, (3, 24))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    seen = kernel_dtypes(monkeypatch)
    logits, grads = {}, {}
    for impl in ("tgattn", "sdpa"):
        model.set_attn_implementation(impl)
        model.zero_grad()
        out = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
        out.loss.backward()
        logits[impl] = out.logits.detach()
        grads[impl] = model.model.layers[0].self_attn.q_proj.weight.grad.clone()
        if impl == "tgattn":
            assert seen and set(seen) == {torch.bfloat16}
    real = mask.bool()
    torch.testing.assert_close(logits["tgattn"][real].float(), logits["sdpa"][real].float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(grads["tgattn"].float(), grads["sdpa"].float(), atol=8e-2, rtol=8e-2)
