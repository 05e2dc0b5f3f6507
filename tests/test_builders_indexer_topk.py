"""indexer_topk (DeepSeek's lightning indexer): the edge set equals the rule written over all pairs."""
import pytest
import torch

from builder_checks import assert_edge_set, assert_matches_dense
from tgattn import builders


def inputs(n, heads=3, dim=4, seed=0, integer=False, dtype=torch.float64):
    """q_index [N, HI, dI], k_index [N, dI], weights [N, HI]; integer=True draws small integers (many ties)."""
    g = torch.Generator().manual_seed(seed)
    if integer:
        draw = lambda *shape: torch.randint(-2, 3, shape, generator=g).to(dtype)  # noqa: E731
    else:
        draw = lambda *shape: torch.randn(*shape, generator=g, dtype=dtype)  # noqa: E731
    return draw(n, heads, dim), draw(n, dim), draw(n, heads)


def sequence_ids(n, lengths):
    """Sequence number of each node (one sequence when lengths is None)."""
    if lengths is None:
        return torch.zeros(n, dtype=torch.long)
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths, dtype=torch.long))


def indexer_twin(q_index, k_index, weights, k_top, causal, lengths=None):
    """The rule over all pairs: I_ij = sum_h w_ih relu(q_ih . k_j); keep j when fewer than k_top
    candidates j' beat it (I_ij' > I_ij, or equal and j' < j)."""
    n = q_index.shape[0]
    scores = (weights.unsqueeze(2) * torch.einsum("ihd,jd->ihj", q_index, k_index).clamp(min=0)).sum(1)  # [i, j]
    seq = sequence_ids(n, lengths)
    i, j = torch.arange(n).view(n, 1), torch.arange(n).view(1, n)
    candidate = seq.view(n, 1) == seq.view(1, n)
    if causal:
        candidate &= j <= i
    mine, other = scores.unsqueeze(2), scores.unsqueeze(1)  # [i, j, 1], [i, 1, j']
    beats = (other > mine) | ((other == mine) & (j.view(1, 1, n) < j.view(1, n, 1)))  # [i, j, j']: j' ranks above j
    rank = (beats & candidate.unsqueeze(1)).sum(2)  # [i, j]
    return candidate & (rank < k_top)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("n,k_top", [(0, 1), (1, 1), (1, 4), (7, 1), (7, 3), (33, 5), (33, 40), (20, 19)])
def test_equals_twin(n, k_top, causal):
    q_index, k_index, weights = inputs(n, seed=n + k_top)
    edges = builders.indexer_topk(q_index, k_index, weights, k_top, causal=causal)
    assert_edge_set(edges, indexer_twin(q_index, k_index, weights, k_top, causal))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("k_top", [1, 4, 10])
def test_ties_go_to_the_smaller_key(k_top, causal, dtype):
    """Small integer inputs: scores are exact in either dtype and most of them tie."""
    q_index, k_index, weights = inputs(30, heads=2, dim=3, seed=k_top, integer=True, dtype=dtype)
    twin = indexer_twin(q_index, k_index, weights, k_top, causal)
    scores = (weights.unsqueeze(2) * torch.einsum("ihd,jd->ihj", q_index, k_index).clamp(min=0)).sum(1)
    assert scores.unique().numel() < 100  # 900 pairs: ties everywhere, including at 0 (relu)
    assert_edge_set(builders.indexer_topk(q_index, k_index, weights, k_top, causal=causal), twin)


def test_infinite_scores_rank_as_numbers():
    """+inf ranks first, -inf last (still a candidate), relu(-inf) = 0."""
    k_index = torch.tensor([1.0, float("inf"), 2.0, float("-inf"), 3.0, 0.5]).view(6, 1)
    q_index, weights = torch.ones(6, 1, 1), torch.tensor([1.0, -1.0, 1.0, -1.0, -1.0, -1.0]).view(6, 1)
    edges = builders.indexer_topk(q_index, k_index, weights, 2)
    assert_edge_set(edges, indexer_twin(q_index, k_index, weights, 2, True))
    assert builders.draw(edges) == "\n".join(["x . . . . .", "x x . . . .", ". x x . . .", "x . . x . .", "x . . x . .", ". . . x . x"])


@pytest.mark.parametrize("causal", [True, False])
def test_packed_batch(causal):
    lengths = [5, 0, 9, 1, 12]
    q_index, k_index, weights = inputs(sum(lengths), seed=4)
    edges = builders.indexer_topk(q_index, k_index, weights, 4, causal=causal, lengths=lengths)
    seq = sequence_ids(sum(lengths), lengths)
    assert torch.equal(seq[edges[0]], seq[edges[1]])  # no edge crosses two sequences
    assert_edge_set(edges, indexer_twin(q_index, k_index, weights, 4, causal, lengths))
    alone = builders.indexer_topk(q_index[14:15], k_index[14:15], weights[14:15], 4, causal=causal)
    assert torch.equal(alone + 14, edges[:, edges[1] == 14])  # a one-token sequence keeps itself


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("chunk", [1, 3 * 4, 3 * 25, 3 * 1000])
def test_chunking_gives_the_same_set(chunk, causal):
    """Blocks of 1, 2, 5 and 31 rows and keys (chunk / HI score floats each) against one block."""
    lengths = [14, 3, 20]
    q_index, k_index, weights = inputs(37, seed=5, integer=True)
    whole = builders.indexer_topk(q_index, k_index, weights, 6, causal=causal, lengths=lengths)
    assert torch.equal(builders.indexer_topk(q_index, k_index, weights, 6, causal=causal, lengths=lengths, chunk=chunk), whole)
    assert_edge_set(whole, indexer_twin(q_index, k_index, weights, 6, causal, lengths))


def test_attention_over_the_selection_equals_dense():
    q_index, k_index, weights = (t.requires_grad_() for t in inputs(24, seed=6))
    edges = builders.indexer_topk(q_index, k_index, weights, 5)
    assert edges.dtype == torch.long and not edges.requires_grad  # the selection is not differentiable
    assert_matches_dense(edges, 24)


def test_bad_input():
    q_index, k_index, weights = inputs(6)
    for bad in ((q_index[:, 0], k_index, weights), (q_index, k_index[:5], weights), (q_index, k_index[:, :3], weights), (q_index, k_index, weights[:, :2])):
        with pytest.raises(ValueError, match=r"shapes \[N, HI, dI\], \[N, dI\] and \[N, HI\] \(got "):
            builders.indexer_topk(*bad, 2)
    for k_top in (0, -1):
        with pytest.raises(ValueError, match=rf"k_top must be >= 1 \(got {k_top}\)"):
            builders.indexer_topk(q_index, k_index, weights, k_top)
    with pytest.raises(ValueError, match=r"chunk must be >= 1 \(got 0\)"):
        builders.indexer_topk(q_index, k_index, weights, 2, chunk=0)
    with pytest.raises(ValueError, match="share a floating dtype .*torch.float64, torch.float32, torch.float64"):
        builders.indexer_topk(q_index, k_index.float(), weights, 2)
    with pytest.raises(ValueError, match="share a floating dtype .*torch.int64"):
        builders.indexer_topk(q_index.long(), k_index.long(), weights.long(), 2)
    with pytest.raises(ValueError, match="lengths sum to 5, but the inputs have 6 nodes"):
        builders.indexer_topk(q_index, k_index, weights, 2, lengths=[2, 3])


def test_nan_scores_raise_naming_the_pair():
    """NaN cannot be ranked: the first candidate pair with a NaN score is named; pairs that are
    not candidates (future keys, other sequences) do not count."""
    q_index, k_index, weights = torch.ones(8, 1, 1), torch.arange(1.0, 9.0).view(8, 1), torch.ones(8, 1)
    q_index[2], k_index[5] = float("inf"), 0.0  # I[2, 5] = relu(inf * 0) = NaN, every other score a number
    assert_edge_set(builders.indexer_topk(q_index, k_index, weights, 2), indexer_twin(q_index, k_index, weights, 2, True))
    with pytest.raises(ValueError, match=r"indexer score I\[2, 5\] is NaN \(NaN or inf in q_index, k_index or weights\)"):
        builders.indexer_topk(q_index, k_index, weights, 2, causal=False)
    packed = builders.indexer_topk(q_index, k_index, weights, 2, causal=False, lengths=[4, 4])  # key 5 is not query 2's
    assert_edge_set(packed, indexer_twin(q_index, k_index, weights, 2, False, [4, 4]))
    q_index, k_index, weights = inputs(8)
    k_index[5, 0] = float("nan")
    with pytest.raises(ValueError, match=r"indexer score I\[5, 5\] is NaN"):
        builders.indexer_topk(q_index, k_index, weights, 2)
    q_index, k_index, weights = inputs(8)
    weights[3, 1] = float("nan")
    with pytest.raises(ValueError, match=r"indexer score I\[3, 0\] is NaN"):
        builders.indexer_topk(q_index, k_index, weights, 2, chunk=3 * 4)
