"""block_topk (MoBA): per-head block selection equals the rule written over all pairs."""
import pytest
import torch

from builder_checks import TOL, assert_edge_set
from tgattn import builders
from tgattn.functional import graph_attention
from tgattn.reference import dense_attention


def qk(n, heads=3, dim=4, seed=0, integer=False):
    g = torch.Generator().manual_seed(seed)
    if integer:
        return [torch.randint(-1, 2, (n, heads, dim), generator=g).double() for _ in range(2)]
    return [torch.randn(n, heads, dim, generator=g, dtype=torch.float64) for _ in range(2)]


def block_twin(q, k, block, k_top, causal, lengths=None):
    """The rule per head over all (i, j): blocks of `block` positions restart at each sequence;
    gate s_ic = q_i . mean(k of block c); j is kept when it is in i's own block (j <= i if causal)
    or its block is a candidate (same sequence; earlier if causal, else any other) that fewer
    than k_top - 1 candidates beat (larger gate, or equal and earlier)."""
    n, heads = q.shape[:2]
    lengths = [n] if lengths is None else lengths
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths, dtype=torch.long))  # [N]
    start = torch.tensor([sum(lengths[:s]) for s in range(len(lengths))], dtype=torch.long)[seq]
    local = (torch.arange(n) - start) // block  # [N] block within the sequence
    blocks = sorted(set(zip(seq.tolist(), local.tolist())))  # (sequence, block) in order
    member = torch.stack([(seq == s) & (local == c) for s, c in blocks]) if blocks else torch.zeros(0, n, dtype=torch.bool)  # [C, N]
    means = torch.stack([k[m].mean(0) for m in member]) if blocks else k.new_zeros(0, heads, k.shape[2])  # [C, H, d]
    gate = torch.einsum("ihd,chd->hic", q, means)  # [H, N, C]
    c_seq = torch.tensor([s for s, _ in blocks], dtype=torch.long)
    c_local = torch.tensor([c for _, c in blocks], dtype=torch.long)
    same = seq.view(n, 1) == c_seq.view(1, -1)  # [N, C]
    candidate = same & ((c_local.view(1, -1) < local.view(n, 1)) if causal else (c_local.view(1, -1) != local.view(n, 1)))
    mine, other = gate.unsqueeze(3), gate.unsqueeze(2)  # [H, N, C, 1], [H, N, 1, C']
    earlier = torch.arange(len(blocks)).view(1, -1) < torch.arange(len(blocks)).view(-1, 1)  # [C, C']: C' before C
    beats = (other > mine) | ((other == mine) & earlier)
    rank = (beats & candidate.view(1, n, 1, len(blocks))).sum(3)  # [H, N, C]
    chosen = candidate & (rank < k_top - 1)  # [H, N, C]
    i, j = torch.arange(n).view(n, 1), torch.arange(n).view(1, n)
    own = (seq.view(n, 1) == seq.view(1, n)) & (local.view(n, 1) == local.view(1, n)) & ((j <= i) if causal else True)
    by_block = (chosen.unsqueeze(3) & member.view(1, 1, len(blocks), n)).any(2)  # [H, N, N]: j's block chosen
    return own | by_block


def check(pattern, twin):
    n = twin.shape[1]
    assert torch.equal(builders.head_masks(pattern, n, n), twin)
    assert_edge_set(pattern.edge_index, twin.any(0))
    assert bool(((pattern.bias == 0) | (pattern.bias == float("-inf"))).all())


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("n,block,k_top", [(0, 2, 2), (1, 1, 1), (1, 3, 2), (5, 1, 3), (16, 4, 2), (23, 3, 3), (23, 4, 10), (20, 30, 2), (17, 2, 1)])
def test_equals_twin(n, block, k_top, causal):
    q, k = qk(n, seed=n + block + k_top)
    check(builders.block_topk(q, k, block, k_top, causal=causal), block_twin(q, k, block, k_top, causal))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("block,k_top", [(4, 2), (4, 3), (2, 4), (1, 5)])
def test_ties_go_to_the_smaller_block(block, k_top, causal):
    """Entries -1, 0, 1 and blocks of 1, 2, 4 (the last one partial): gates are exact, many tie."""
    q, k = qk(22, heads=2, dim=2, seed=block * k_top, integer=True)
    twin = block_twin(q, k, block, k_top, causal)
    check(builders.block_topk(q, k, block, k_top, causal=causal), twin)


@pytest.mark.parametrize("causal", [True, False])
def test_one_block_is_block_local(causal):
    q, k = qk(19)
    p = builders.block_topk(q, k, 4, 1, causal=causal)
    assert torch.equal(p.edge_index, builders.block_local(19, 4, causal=causal)) and bool((p.bias == 0).all())


@pytest.mark.parametrize("causal", [True, False])
def test_packed_batch(causal):
    lengths = [5, 0, 9, 1, 12]
    q, k = qk(sum(lengths), seed=4)
    p = builders.block_topk(q, k, 3, 2, causal=causal, lengths=lengths)
    seq = torch.repeat_interleave(torch.arange(5), torch.tensor(lengths))
    assert torch.equal(seq[p.edge_index[0]], seq[p.edge_index[1]])  # no edge crosses two sequences
    check(p, block_twin(q, k, 3, 2, causal, lengths))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("chunk", [1, 3 * 4, 3 * 25])
def test_chunking_gives_the_same_set(chunk, causal):
    """Blocks of 1, 2 and 5 query rows and gated blocks (chunk / H gate floats) against one block."""
    lengths = [14, 3, 20]
    q, k = qk(37, seed=5, integer=True)
    whole = builders.block_topk(q, k, 2, 3, causal=causal, lengths=lengths)
    part = builders.block_topk(q, k, 2, 3, causal=causal, lengths=lengths, chunk=chunk)
    assert torch.equal(part.edge_index, whole.edge_index) and torch.equal(part.bias, whole.bias)
    check(whole, block_twin(q, k, 2, 3, causal, lengths))


@pytest.mark.parametrize("causal", [True, False])
def test_attention_equals_per_head_dense(causal):
    q, k = (t.requires_grad_() for t in qk(21, seed=6))
    v = torch.randn(21, 3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(7), requires_grad=True)
    p = builders.block_topk(q, k, 4, 2, causal=causal)
    assert not p.bias.requires_grad  # the selection is not differentiable
    out = graph_attention(q, k, v, p.edge_index, bias=p.bias)
    ref = dense_attention(q, k, v, builders.head_masks(p, 21, 21))
    torch.testing.assert_close(out, ref, **TOL)
    grad_out = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), grad_out), torch.autograd.grad(ref, (q, k, v), grad_out)):
        torch.testing.assert_close(a, b, **TOL)


def test_bad_input():
    q, k = qk(6)
    for bad in ((q[:, 0], k[:, 0]), (q, k[:5]), (q, k[:, :2]), (q, k[..., :3])):
        with pytest.raises(ValueError, match=r"q and k must both have shape \[N, H, d\] \(got "):
            builders.block_topk(*bad, 2, 2)
    for block in (0, -2):
        with pytest.raises(ValueError, match=rf"block must be >= 1 \(got {block}\)"):
            builders.block_topk(q, k, block, 2)
    for k_top in (0, -1):
        with pytest.raises(ValueError, match=rf"k_top must be >= 1 \(got {k_top}\)"):
            builders.block_topk(q, k, 2, k_top)
    with pytest.raises(ValueError, match=r"chunk must be >= 1 \(got 0\)"):
        builders.block_topk(q, k, 2, 2, chunk=0)
    with pytest.raises(ValueError, match="share a floating dtype .*torch.float64 and torch.float32"):
        builders.block_topk(q, k.float(), 2, 2)
    with pytest.raises(ValueError, match="lengths sum to 7, but the inputs have 6 nodes"):
        builders.block_topk(q, k, 2, 2, lengths=[3, 4])


def test_nan_gates_raise_naming_query_head_and_block():
    """NaN cannot be ranked: the first candidate gate that is NaN is named; gates that are not
    candidates (the own block, later blocks when causal, other sequences) do not count."""
    q, k = qk(12)
    k[5, 1, 0] = float("nan")  # the mean of block 2 (nodes 4, 5) in head 1
    with pytest.raises(ValueError, match=r"block_topk gate of query 6, head 1, block 2 of its sequence is NaN \(NaN or inf in q or k\)"):
        builders.block_topk(q, k, 2, 2)
    with pytest.raises(ValueError, match=r"gate of query 0, head 1, block 2 of its sequence is NaN"):
        builders.block_topk(q, k, 2, 2, causal=False, chunk=3 * 4)
    with pytest.raises(ValueError, match=r"gate of query 3, head 1, block 1 of its sequence is NaN"):
        builders.block_topk(q, k, 2, 2, causal=False, lengths=[3, 9])  # nodes 5, 6 = block 1 of the second sequence
    check(builders.block_topk(q, k, 2, 2, lengths=[6, 6]), block_twin(q, k, 2, 2, True, [6, 6]))  # only nodes 4-5 own it
    q, k = qk(12)
    q[1, 0, 0] = float("nan")  # query 1 (block 0) ranks nothing when causal
    check(builders.block_topk(q, k, 2, 3), block_twin(q, k, 2, 3, True))
    with pytest.raises(ValueError, match=r"gate of query 1, head 0, block 1 of its sequence is NaN"):
        builders.block_topk(q, k, 2, 3, causal=False)
