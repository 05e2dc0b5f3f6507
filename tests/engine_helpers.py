"""Shared helpers for the engine tests: random inputs and the dense twin of an edge set."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tgattn.reference import dense_attention

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def inputs(n_q, n_k, heads=4, dk=8, dv=None, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    dv = dk if dv is None else dv
    shapes = ((n_q, heads, dk), (n_k, heads, dk), (n_k, heads, dv))
    q, k, v = (torch.randn(*s, generator=g, dtype=dtype).requires_grad_() for s in shapes)
    grad_out = torch.randn(n_q, heads, dv, generator=g, dtype=dtype)
    return q, k, v, grad_out


def dense_twin(edge_index, n_q, n_k, heads, bias=None, dtype=torch.float64):
    """``(mask [Nq, Nk], bias [H, Nq, Nk] or None)`` equal to the edge set, duplicates included.

    m copies of an edge with biases b_1..b_m weigh like one cell with bias log(sum exp b_c),
    built differentiably so that the oracle's bias gradient splits back onto the copies.
    """
    src, dst = edge_index
    mask = torch.zeros(n_q, n_k, dtype=torch.bool)
    mask[dst, src] = True
    counts = torch.zeros(n_q, n_k, dtype=dtype).index_put_((dst, src), torch.ones(len(src), dtype=dtype), accumulate=True)
    if bias is None and bool((counts <= 1).all()):
        return mask, None
    e = edge_index.shape[1]
    b = torch.zeros(e, heads, dtype=dtype) if bias is None else (bias if bias.dim() == 2 else bias.unsqueeze(-1))
    b = b.expand(e, heads)
    h_idx = torch.arange(heads).repeat(e)
    acc = torch.zeros(heads, n_q, n_k, dtype=dtype).index_put(
        (h_idx, dst.repeat_interleave(heads), src.repeat_interleave(heads)), torch.exp(b.reshape(-1)), accumulate=True
    )
    safe = torch.where(acc > 0, acc, torch.ones_like(acc))
    dense_bias = torch.where(acc > 0, torch.log(safe), torch.full_like(acc, float("-inf")))
    mask = mask & (acc > 0).any(0)
    return mask, dense_bias


def oracle(q, k, v, edge_index, bias=None, scale=None):
    mask, dense_bias = dense_twin(edge_index, q.shape[0], k.shape[0], q.shape[1], bias, q.dtype)
    return dense_attention(q, k, v, mask, bias=dense_bias, scale=scale)


def max_err(a, b):
    return (a - b).abs().max().item() if a.numel() else 0.0


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any operator returns while active."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def fused_mask(edge_index, n_q, n_k, p, heads):
    """``keep / (1 - p)`` ``[E, H]`` float64 of the fused kernel's dropout, in the order of ``edge_index``;
    the kernel's seed is the next draw of torch's generator (call right after ``torch.manual_seed``)."""
    from tgattn import engine
    from tgattn.engine import fused

    s = engine.structure_of(edge_index, n_q, n_k)
    keep = fused.dropout_keep(heads, edge_index.shape[1], p, int(torch.randint(0, 2**62, ())))  # [H, E] sorted
    mult = torch.empty(edge_index.shape[1], heads, dtype=torch.float64)
    mult[s.perm if s.perm is not None else slice(None)] = keep.T.double() / (1 - p)
    return mult


def checked_losses(out, ref, w, ref_w, tol):
    """``(loss, ref_loss)`` whose gradients compare a result with its oracle: ``out`` (and the weights
    ``w`` where returned) checked against ``ref`` / ``ref_w`` at ``tol`` first, then ``<out, probe>``
    plus ``sum w^2`` for each side."""
    torch.testing.assert_close(out.double(), ref, **tol)
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    loss, ref_loss = (out.double() * probe).sum(), (ref * probe).sum()
    if w is not None:
        torch.testing.assert_close(w.double(), ref_w, **tol)
        loss, ref_loss = loss + w.double().pow(2).sum(), ref_loss + ref_w.pow(2).sum()
    return loss, ref_loss
