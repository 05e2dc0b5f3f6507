"""Attention sinks of one logit per query and head (transformers 5.24's Inkling 2: ``sinks [B, Hq, Tq, 1]``).

tgattn runs each as one more key per query (zeros, its edge's bias the sink): compared with the
dense float64 oracle's softmax over the keys plus the sink, with grouped-query heads, a causal
mask with left padding, soft-capping and a float mask's bias, forward and gradients (1e-10).
"""
import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_oracle  # noqa: E402
from tgattn.hf import attention_forward, edge_mask  # noqa: E402

B, HQ, HKV, T, D = 2, 4, 2, 6, 8
TOL = dict(atol=1e-10, rtol=1e-10)


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, T, D, generator=g, dtype=torch.float64, requires_grad=True) for h in (HQ, HKV, HKV))
    sinks = torch.randn(B, HQ, T, 1, generator=g, dtype=torch.float64, requires_grad=True)
    return q, k, v, sinks


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_a_sink_per_query_equals_the_dense_softmax_with_it(softcap):
    pad = torch.tensor([[1] * T, [0, 0] + [1] * (T - 2)])  # row 1: two pads on the left
    mask = edge_mask(B, T, T, attention_mask=pad)
    q, k, v, sinks = _inputs()
    ours, _ = attention_forward(None, q, k, v, mask, scaling=0.5, softcap=softcap, sinks=sinks)  # [B, T, Hq, d]
    keep = (torch.ones(T, T, dtype=torch.bool).tril() & pad.bool()[:, None, :] & pad.bool()[:, :, None])[:, None]
    keep = keep.expand(B, HQ, T, T)
    kk, vv = k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1)
    theirs = torch.stack([hf_oracle.capped_sink_attention(q[b], kk[b], vv[b], keep[b], torch.zeros(HQ, T, T,
                          dtype=q.dtype), 0.5, softcap, sinks[b]) for b in range(B)])
    real = pad.bool()
    torch.testing.assert_close(ours[real], theirs[real], **TOL)
    probe = torch.randn(ours[real].shape, generator=torch.Generator().manual_seed(1), dtype=q.dtype)
    grads = [torch.autograd.grad((out[real] * probe).sum(), (q, k, v, sinks)) for out in (ours, theirs)]
    for mine, dense in zip(*grads):
        torch.testing.assert_close(mine, dense, **TOL)
    assert sinks.grad is None and bool(grads[0][3][real.view(B, 1, T, 1).expand_as(sinks)].abs().min() > 0)


def test_sinks_of_another_shape_are_named():
    q, k, v, sinks = _inputs()
    with pytest.raises(ValueError, match=r"sinks must have shape \[Hq\] = \[4\] or \[B, Hq, Tq, 1\] = \[2, 4, 6, 1\] "
                                         r"\(got \[2, 4, 6, 2\]\)"):
        attention_forward(None, q, k, v, edge_mask(B, T, T), sinks=sinks.expand(-1, -1, -1, 2))
