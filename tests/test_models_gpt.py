"""The graph-attention GPT equals its dense twin (SDPA with the equivalent mask)."""
import pytest
import torch

from tgattn import builders
from tgattn.models import GPT, GPTConfig

SMALL = dict(block_size=12, vocab_size=11, n_layer=2, n_head=2, n_embd=16)


def random_causal(lengths):
    """An injected pattern: the diagonal plus random earlier keys (not a library builder)."""
    g = torch.Generator().manual_seed(3)
    masks = [(torch.rand(n, n, generator=g) < 0.3).tril() | torch.eye(n, dtype=torch.bool) for n in lengths]
    return builders.from_mask(torch.block_diag(*masks))


PATTERNS = {
    "causal": (dict(pattern="causal"), None),
    "window2": (dict(pattern="window", window=2), None),
    "window5": (dict(pattern="window", window=5), None),
    "dilated": (dict(pattern="dilated", window=3, dilation=2), None),
    "bigbird": (dict(pattern="bigbird", window=2, num_global=1, num_random=2), None),
    "injected": (dict(), random_causal),
}


def twins(overrides, pattern, dtype, bias=False):
    graph = GPT(GPTConfig(**SMALL, **overrides, bias=bias), pattern=pattern).to(dtype)
    dense = GPT(GPTConfig(**SMALL, **overrides, bias=bias, attention="dense"), pattern=pattern).to(dtype)
    dense.load_state_dict(graph.state_dict())
    return graph, dense


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("name", PATTERNS)
def test_graph_gpt_equals_dense_twin(name, dtype, tol):
    graph, dense = twins(*PATTERNS[name], dtype, bias=True)
    idx = torch.randint(11, (3, 12))
    targets = torch.randint(11, (3, 12))
    logits_g, loss_g = graph(idx, targets)
    logits_d, loss_d = dense(idx, targets)
    torch.testing.assert_close(logits_g, logits_d, rtol=0, atol=tol)
    (loss_g * 100).backward()  # scale up so that gradient errors are not hidden by small values
    (loss_d * 100).backward()
    grads_d = dict(dense.named_parameters())
    for pname, p in graph.named_parameters():
        torch.testing.assert_close(p.grad, grads_d[pname].grad, rtol=0, atol=tol * 10, msg=pname)


def test_state_dicts_have_the_same_keys_and_shapes():
    graph, dense = twins({}, None, torch.float32)
    assert {k: v.shape for k, v in graph.state_dict().items()} == {k: v.shape for k, v in dense.state_dict().items()}


@pytest.mark.parametrize("name", PATTERNS)
def test_return_attention_matches_dense_weights(name):
    graph, dense = twins(*PATTERNS[name], torch.float64)
    idx = torch.randint(11, (2, 12))
    *_, att_g = graph(idx, return_attention=True)
    *_, att_d = dense(idx, return_attention=True)
    assert len(att_g) == 2
    for (ei_g, a_g), (ei_d, a_d) in zip(att_g, att_d):
        assert torch.equal(ei_g, ei_d) and a_g.shape == (ei_g.shape[1], 2)
        torch.testing.assert_close(a_g, a_d, rtol=0, atol=1e-12)
        sums = torch.zeros(24, 2, dtype=a_g.dtype).index_add_(0, ei_g[1], a_g)
        torch.testing.assert_close(sums, torch.ones_like(sums))  # weights of a query sum to 1


def test_edge_set_is_built_once_per_shape(monkeypatch):
    calls = []
    model = GPT(GPTConfig(**SMALL), pattern=lambda lengths: calls.append(list(lengths)) or builders.causal(list(lengths)))
    idx = torch.randint(11, (3, 12))
    for _ in range(3):
        model(idx)
    model(idx[:, :5])
    assert calls == [[12, 12, 12], [5, 5, 5]]  # one build per shape, shared by both layers
    assert model.edges(3, 12).shape[1] == 3 * 12 * 13 // 2


def test_window_edges_are_packed_block_diagonal():
    model = GPT(GPTConfig(**SMALL, pattern="window", window=3))
    src, dst = model.edges(2, 12)
    assert bool((src // 12 == dst // 12).all()) and bool(((dst - src) <= 3).all()) and bool((src <= dst).all())
    assert src.numel() == 2 * (12 * 4 - 6)


def test_bad_patterns_and_lengths_raise():
    with pytest.raises(ValueError, match="unknown attention pattern"):
        GPT(GPTConfig(**SMALL, pattern="spiral"))
    with pytest.raises(ValueError, match="attention must be"):
        GPT(GPTConfig(**SMALL, attention="flash"))
    model = GPT(GPTConfig(**SMALL), pattern=lambda lengths: builders.full(list(lengths)))
    with pytest.raises(ValueError, match="not causal"):
        model(torch.zeros(1, 4, dtype=torch.long))
    model = GPT(GPTConfig(**SMALL), pattern=lambda lengths: builders.causal(list(lengths))[:, 1:])
    with pytest.raises(ValueError, match="query 0 without keys"):
        model(torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="exceeds block_size"):
        GPT(GPTConfig(**SMALL))(torch.zeros(1, 13, dtype=torch.long))


def test_tied_head_and_parameter_count():
    model = GPT(GPTConfig(**SMALL))
    assert model.lm_head.weight is model.transformer.wte.weight
    d, v, t, layers = 16, 11, 12, 2
    per_block = 2 * d + 4 * d * d + 8 * d * d  # two LayerNorm weights, attention, MLP (no biases)
    assert model.num_params() == v * d + t * d + layers * per_block + d


def test_sparse_patterns_match_their_rules():
    t = 12
    i, j = torch.arange(t).unsqueeze(1), torch.arange(t)
    dilated = GPT(GPTConfig(**SMALL, pattern="dilated", window=3, dilation=2)).edges(1, t)
    rule = (i >= j) & ((i - j) % 2 == 0) & ((i - j) <= 6)
    assert torch.equal(builders.to_mask(dilated, t, t), rule)
    bigbird = GPT(GPTConfig(**SMALL, pattern="bigbird", window=2, num_global=1, num_random=2)).edges(2, t)
    mask = builders.to_mask(bigbird, 2 * t, 2 * t)
    for b in range(2):
        block = mask[b * t : (b + 1) * t, b * t : (b + 1) * t]
        assert bool((block >= (((i - j) <= 2) & (i >= j)) | ((j == 0) & (i >= j))).all())  # window + global
        assert bool((block <= (i >= j)).all()) and block.sum() <= 3 * t + 2 * t  # causal, few random keys
    assert torch.equal(bigbird, GPT(GPTConfig(**SMALL, pattern="bigbird", window=2, num_global=1, num_random=2)).edges(2, t))


def test_optimizer_decays_every_matrix_once_and_nothing_else():
    # nanoGPT's grouping: every parameter with dim >= 2 decays (embeddings included), the
    # tied head/embedding appears once, LayerNorm weights do not decay.
    model = GPT(GPTConfig(**SMALL))
    decay, no_decay = model.configure_optimizer(lr=1e-3, weight_decay=0.1).param_groups
    named = dict(model.named_parameters())  # deduplicated: the tied weight is transformer.wte.weight
    by_id = {id(p): n for n, p in named.items()}
    decayed = sorted(by_id[id(p)] for p in decay["params"])
    assert decayed == sorted(n for n, p in named.items() if p.dim() == 2)
    assert "transformer.wte.weight" in decayed and "transformer.wpe.weight" in decayed
    assert sorted(by_id[id(p)] for p in no_decay["params"]) == sorted(n for n in named if ".ln_" in n or "ln_f" in n)
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    assert decay["betas"] == (0.9, 0.99) and decay["eps"] == 1e-8
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_initialisation_is_gpt2s():
    # N(0, 0.02) for every matrix, N(0, 0.02 / sqrt(2 n_layer)) for the two residual
    # projections of each block, LayerNorm weights 1 (sample std of >= 16k values: within 3%).
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=128, vocab_size=128, n_layer=4, n_head=4, n_embd=128))
    small = 0.02 / 8**0.5
    for name, p in model.named_parameters():
        p = p.detach()
        if p.dim() == 1:
            assert torch.equal(p, torch.ones_like(p)), name
            continue
        want = small if name.endswith(("attn.out_proj.weight", "mlp.c_proj.weight")) else 0.02
        assert abs(float(p.std()) / want - 1) < 0.03 and abs(float(p.mean())) < 0.1 * want, name
