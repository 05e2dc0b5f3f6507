"""random and bigbird: rule, determinism, uniformity, and equality with dense attention."""
import pytest
import torch

from builder_checks import assert_edge_set, assert_layer_matches_dense, assert_matches_dense, block_diag, ij, packed_twin
from tgattn import builders


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n,r", [(0, 2), (1, 2), (5, 0), (7, 3), (16, 16), (33, 4), (12, 20)])
def test_random_rule(n, r, causal):
    e = builders.random(n, r, generator=gen(), causal=causal)
    mask = builders.to_mask(e, n, n)
    i, j = ij(n)
    allowed = (j <= i) if causal else torch.ones(n, n, dtype=torch.bool)
    assert not (mask & ~allowed).any()
    m = allowed.sum(1)
    assert torch.equal(mask.sum(1), torch.minimum(m, torch.tensor(r)))
    assert_edge_set(e, mask)
    assert e.shape[1] == (n * r - r * (r - 1) // 2 if causal else n * r) if r <= n else True


def test_random_deterministic_per_seed_and_independent_per_sequence():
    a = builders.random([20, 20], 3, generator=gen(5))
    b = builders.random([20, 20], 3, generator=gen(5))
    c = builders.random([20, 20], 3, generator=gen(6))
    assert torch.equal(a, b) and not torch.equal(a, c)
    first, second = a[:, a[1] < 20], a[:, a[1] >= 20] - 20
    assert not torch.equal(first, second)  # each packed sequence has its own draw
    assert_edge_set(a, block_diag([builders.to_mask(first, 20), builders.to_mask(second, 20)]))


@pytest.mark.parametrize("make", [
    lambda n, g: builders.random(n, 3, generator=g, causal=True),
    lambda n, g: builders.bigbird(n, 2, 1, 3, generator=g, causal=True),
])
def test_causal_draw_is_prefix_stable(make):
    # query i's random keys depend on the seed and i only: decoding token by token sees the training pattern
    full = make(40, gen(9))
    for t in (0, 1, 7, 25, 40):
        assert torch.equal(make(t, gen(9)), full[:, full[1] < t])


def test_random_is_uniform():
    # 600 packed sequences of 10 tokens, 3 keys per query: every query row is an independent draw.
    masks = builders.to_mask(builders.random([10] * 600, 3, generator=gen(1)), 6000).view(600, 10, 600, 10)
    rows = torch.stack([masks[b, :, b] for b in range(600)])  # [600, 10 queries, 10 keys]
    freq = rows.double().mean(dim=(0, 1))  # each key is picked with probability 3/10
    assert (freq - 0.3).abs().max() < 0.025  # 4 sigma of a mean of 6000 Bernoulli(0.3)
    # whole subsets: 2 of 5 keys, the 10 pairs equally likely (3000 draws, 300 +- 16.4 each)
    pairs = builders.to_mask(builders.random([5] * 600, 2, generator=gen(2)), 3000).view(600, 5, 600, 5)
    picks = torch.stack([pairs[b, :, b] for b in range(600)]).reshape(3000, 5)
    codes = (picks.long() * (2 ** torch.arange(5))).sum(1)
    counts = torch.bincount(codes, minlength=32)[codes.unique()]
    assert len(counts) == 10 and (counts - 300).abs().max() < 82
    # causal query 4 draws 3 of its 5 allowed keys: frequency 3/5 each, never a future key
    causal = builders.to_mask(builders.random([10] * 600, 3, generator=gen(3), causal=True), 6000).view(600, 10, 600, 10)
    row4 = torch.stack([causal[b, 4, b] for b in range(600)]).double()
    assert (row4[:, :5].mean(0) - 0.6).abs().max() < 0.08 and row4[:, 5:].sum() == 0


def bigbird_twin(n, w, g, r, seed, causal):
    i, j = ij(n)
    rand = builders.to_mask(builders.random(n, r, generator=gen(seed), causal=causal), n, n)
    mask = ((i - j).abs() <= w) | (i < g) | (j < g) | rand
    return mask & (j <= i) if causal else mask


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n,w,g,r", [(0, 1, 1, 1), (1, 2, 1, 2), (9, 1, 2, 2), (40, 3, 2, 3), (6, 0, 0, 0), (8, 10, 10, 10)])
def test_bigbird_rule(n, w, g, r, causal):
    e = builders.bigbird(n, w, g, r, generator=gen(3), causal=causal)
    assert_edge_set(e, bigbird_twin(n, w, g, r, 3, causal))


def test_bigbird_packed_twin():
    lengths = [5, 0, 1, 12, 9]
    e = builders.bigbird(lengths, 1, 2, 2, generator=gen(4), causal=True)
    rand = builders.to_mask(builders.random(lengths, 2, generator=gen(4), causal=True), 27)
    local = packed_twin(lengths, lambda n: bigbird_twin(n, 1, 2, 0, 0, True))
    i, j = ij(27)
    assert_edge_set(e, (local | rand) & (j <= i))


def test_bigbird_packed_is_block_diagonal():
    lengths = [5, 0, 1, 12]
    e = builders.bigbird(lengths, 1, 1, 2, generator=gen(0), causal=True)
    i, j = ij(18)
    seq = torch.repeat_interleave(torch.arange(4), torch.tensor(lengths))
    mask = builders.to_mask(e, 18)
    assert not (mask & (seq.view(-1, 1) != seq.view(1, -1))).any()
    assert not (mask & (j > i)).any()
    # the first token of every sequence is global: seen by all its later tokens
    starts = [0, 5, 6]
    for s, length in zip(starts, [5, 1, 12]):
        assert mask[s : s + length, s].all()


@pytest.mark.parametrize(
    "make,n",
    [
        (lambda: builders.random(17, 3, generator=gen(0)), 17),
        (lambda: builders.random([4, 9], 2, generator=gen(0), causal=True), 13),
        (lambda: builders.bigbird(30, 2, 2, 3, generator=gen(0)), 30),
        (lambda: builders.bigbird([7, 1, 14], 1, 1, 2, generator=gen(0), causal=True), 22),
    ],
)
def test_attention_equals_dense(make, n):
    e = make()
    assert_matches_dense(e, n)
    assert_layer_matches_dense(e, n)


@pytest.mark.parametrize("call,word", [
    (lambda: builders.random(5, -1), "r must be >= 0 (got -1)"),
    (lambda: builders.bigbird(5, -2, 1, 1), "w must be >= 0 (got -2)"),
    (lambda: builders.bigbird(5, 1, -1, 1), "g must be >= 0 (got -1)"),
    (lambda: builders.random([3, -4], 1), "each length must be >= 0 (got -4)"),
])
def test_errors_name_the_value(call, word):
    with pytest.raises(ValueError, match=word.replace("(", r"\(").replace(")", r"\)")):
        call()
