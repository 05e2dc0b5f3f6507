"""ProbSparse (Informer): the builder's pattern and the full output against a dense port of the algorithm."""
import math

import pytest
import torch

from builder_checks import TOL, assert_edge_set, ij
from tgattn import builders
from tgattn.builders.informer import lazy_values, probsparse_attention
from tgattn.reference import dense_attention


def informer_port(Q, K, V, factor, index_sample, causal):
    """A direct dense port of Informer's ProbAttention (layout [B, H, L, d], B = 1), given the
    sampled key indices; M uses the sample mean, causal lazy queries the running mean (tgattn's
    two documented choices)."""
    B, H, L_Q, D = Q.shape
    L_K = K.shape[2]
    u = min(factor * math.ceil(math.log(L_Q)), L_Q) if L_Q > 1 else 0
    K_expand = K.unsqueeze(-3).expand(B, H, L_Q, L_K, D)
    K_sample = K_expand[:, :, torch.arange(L_Q).unsqueeze(1), index_sample, :]  # [B, H, L_Q, U, D]
    Q_K_sample = torch.matmul(Q.unsqueeze(-2), K_sample.transpose(-2, -1)).squeeze(-2)  # [B, H, L_Q, U]
    if u:
        M = Q_K_sample.max(-1)[0] - Q_K_sample.sum(-1) / index_sample.shape[1]
        M_top = M.topk(u, sorted=False)[1]  # [B, H, u]
    else:  # L = 1: ln L = 0 queries are active; the only query is lazy
        M_top = torch.zeros(B, H, 0, dtype=torch.long)
    Q_reduce = Q[torch.arange(B)[:, None, None], torch.arange(H)[None, :, None], M_top, :]
    scores = torch.matmul(Q_reduce, K.transpose(-2, -1)) / math.sqrt(D)  # [B, H, u, L_K]
    if causal:
        future = torch.ones(L_Q, L_K, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(future[M_top], float("-inf"))
        context = V.cumsum(dim=-2) / torch.arange(1, L_Q + 1, dtype=V.dtype).view(-1, 1)
    else:
        context = V.mean(dim=-2, keepdim=True).expand(B, H, L_Q, V.shape[-1])
    context = context.clone()
    attn = torch.softmax(scores, dim=-1)
    context[torch.arange(B)[:, None, None], torch.arange(H)[None, :, None], M_top, :] = torch.matmul(attn, V)
    return context[0].transpose(0, 1), M_top[0].T  # [L, H, dv], [u, H]


def qkv(n_q, n_k, heads=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = ((n_q, heads, 8), (n_k, heads, 8), (n_k, heads, 6))
    return [torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True) for s in shapes]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n,factor", [(1, 1), (2, 1), (10, 2), (40, 1), (96, 2), (60, 5)])
def test_output_equals_port(n, factor, causal):
    q, k, v = qkv(n, n)
    out, pattern = probsparse_attention(q, k, v, factor, causal=causal, generator=torch.Generator().manual_seed(1), return_pattern=True)
    if causal:
        assert bool((pattern.sample <= torch.arange(n).unsqueeze(1)).all())
    ref, top = informer_port(*(t.permute(1, 0, 2).unsqueeze(0) for t in (q, k, v)), factor, pattern.sample, causal)
    torch.testing.assert_close(out, ref, **TOL)
    port_active = torch.zeros(n, 3, dtype=torch.bool).scatter_(0, top, True)
    assert torch.equal(pattern.active, port_active)
    grad_out = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), grad_out), torch.autograd.grad(ref, (q, k, v), grad_out)):
        torch.testing.assert_close(a, b, **TOL)


def test_cross_lengths_equal_port():
    q, k, v = qkv(30, 50)
    out, p = probsparse_attention(q, k, v, 2, generator=torch.Generator().manual_seed(4), return_pattern=True)
    ref, _ = informer_port(*(t.permute(1, 0, 2).unsqueeze(0) for t in (q, k, v)), 2, p.sample, False)
    torch.testing.assert_close(out, ref, **TOL)
    assert p.active.sum(0).tolist() == [2 * math.ceil(math.log(30))] * 3 and p.sample.shape == (30, 2 * math.ceil(math.log(50)))


@pytest.mark.parametrize("causal", [False, True])
def test_builder_edges_and_per_head_dense(causal):
    n = 45
    q, k, v = qkv(n, n, seed=2)
    p = builders.probsparse(q, k, 2, causal=causal, generator=torch.Generator().manual_seed(0))
    i, j = ij(n)
    allowed = (j <= i) if causal else torch.ones(n, n, dtype=torch.bool)
    per_head = p.active.T.unsqueeze(2) & allowed  # [H, N, N]: active rows see all allowed keys
    assert torch.equal(builders.head_masks(p, n, n), per_head)
    assert_edge_set(p.edge_index, per_head.any(0))
    assert p.active.sum(0).tolist() == [2 * math.ceil(math.log(n))] * 3
    out = probsparse_attention(q, k, v, 2, causal=causal, sample=p.sample)
    dense = dense_attention(q, k, v, per_head)
    lazy = lazy_values(v, causal=causal)
    torch.testing.assert_close(out, torch.where(p.active.unsqueeze(-1), dense, lazy), **TOL)


def test_sample_defaults_match_informer_sizes_and_seed():
    q, k, _ = qkv(100, 100)
    a = builders.probsparse(q, k, 5, generator=torch.Generator().manual_seed(7))
    b = builders.probsparse(q, k, 5, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a.sample, b.sample) and torch.equal(a.active, b.active)
    assert a.sample.shape == (100, 25) and a.active.sum(0).tolist() == [25, 25, 25]  # 5 * ceil(ln 100)


@pytest.mark.parametrize("causal", [False, True])
def test_packed_equals_each_sequence(causal):
    lengths = [12, 1, 0, 30]
    q, k, v = qkv(43, 43, seed=5)
    out, p = probsparse_attention(q, k, v, 2, causal=causal, lengths=lengths, generator=torch.Generator().manual_seed(3), return_pattern=True)
    g = torch.Generator().manual_seed(3)
    offset = 0
    for length in lengths:
        part = slice(offset, offset + length)
        ref, rp = probsparse_attention(q[part], k[part], v[part], 2, causal=causal, generator=g, return_pattern=True)
        torch.testing.assert_close(out[part], ref, **TOL)
        assert torch.equal(p.active[part], rp.active)
        offset += length
    seq = torch.repeat_interleave(torch.arange(4), torch.tensor(lengths))
    assert bool((seq[p.edge_index[0]] == seq[p.edge_index[1]]).all())


def test_lazy_values():
    v = torch.arange(12.0).view(6, 1, 2)
    running = lazy_values(v, causal=True, lengths=[2, 4])
    torch.testing.assert_close(running[:, 0, 0], torch.tensor([0.0, 1.0, 4.0, 5.0, 6.0, 7.0]))
    torch.testing.assert_close(lazy_values(v, lengths=[2, 4])[:, 0, 0], torch.tensor([1.0, 1.0, 7.0, 7.0, 7.0, 7.0]))


def test_errors():
    q, k, _ = qkv(6, 6)
    with pytest.raises(ValueError, match=r"factor must be >= 1 \(got 0\)"):
        builders.probsparse(q, k, 0)
    with pytest.raises(ValueError, match="as many queries as keys"):
        builders.probsparse(q, k[:4], causal=True)
    with pytest.raises(ValueError, match="lengths sum to 5"):
        builders.probsparse(q, k, lengths=[2, 3])
    with pytest.raises(ValueError, match=r"sample must be \[Nq=6, U\]"):
        builders.probsparse(q, k, sample=torch.full((6, 2), 9))
