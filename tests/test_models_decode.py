"""Incremental decoding (one new node + its in-edges, cached keys/values) equals full recomputation."""
import pytest
import torch

from tgattn import builders
from tgattn.models import GPT, GPTConfig, decode, generate

from test_models_gpt import random_causal

SMALL = dict(block_size=16, vocab_size=11, n_layer=2, n_head=2, n_embd=16, bias=True)
PATTERNS = {
    "causal": (dict(pattern="causal"), None),
    "window3": (dict(pattern="window", window=3), None),
    "bigbird": (dict(pattern="bigbird", window=2, num_global=1, num_random=2), None),
    "injected": (dict(), random_causal),
}


def model_for(name, attention="graph"):
    overrides, pattern = PATTERNS[name]
    return GPT(GPTConfig(**SMALL, **overrides, attention=attention), pattern=pattern).double().eval()


@pytest.mark.parametrize("name", PATTERNS)
@pytest.mark.parametrize("new_tokens", [9, 20])  # 20: runs past block_size (16), where steps recompute
def test_cached_decoding_equals_full_recomputation(name, new_tokens):
    model = model_for(name)
    prompt = torch.randint(11, (2, 4))
    kw = dict(temperature=0.9, top_k=5, return_logits=True)
    a, logits_a = generate(model, prompt, new_tokens, generator=torch.Generator().manual_seed(1), **kw)
    b, logits_b = generate(model, prompt, new_tokens, generator=torch.Generator().manual_seed(1), use_cache=False, **kw)
    assert torch.equal(a, b) and a.shape == (2, 4 + new_tokens)
    torch.testing.assert_close(logits_a, logits_b, rtol=0, atol=1e-10)


@pytest.mark.parametrize("name", PATTERNS)
def test_full_recomputation_logits_equal_the_training_forward(name):
    model = model_for(name)
    idx = torch.randint(11, (1, 16))
    pattern = decode.DecodePattern(model)
    for t in (5, 16):
        logits, _ = model(idx[:, :t], edge_index=pattern.prefix(t, 1))
        if name not in ("injected", "bigbird") or t == 16:  # random draws depend on the length; at block_size they agree
            torch.testing.assert_close(logits, model(idx[:, :t])[0], rtol=0, atol=1e-12)


def test_dense_twin_decodes_the_same_tokens():
    graph = model_for("window3")
    dense = model_for("window3", attention="dense")
    dense.load_state_dict(graph.state_dict())
    prompt = torch.randint(11, (1, 3))
    out = [generate(m, prompt, 10, generator=torch.Generator().manual_seed(0), return_logits=True) for m in (graph, dense)]
    assert torch.equal(out[0][0], out[1][0])
    torch.testing.assert_close(out[0][1], out[1][1], rtol=0, atol=1e-10)


def test_a_step_adds_one_node_and_only_its_window_edges(monkeypatch):
    model = model_for("window3")
    seen = []
    real = decode.graph_attention

    def spy(q, k, v, edge_index, **kw):
        seen.append((q.shape[0], edge_index.shape[1]))
        return real(q, k, v, edge_index, **kw)

    monkeypatch.setattr(decode, "graph_attention", spy)
    cache = decode.KVCache(model, 2)
    pattern = decode.DecodePattern(model)
    for t in range(10):
        decode.step(model, cache, pattern, torch.tensor([t % 11, 1]))
    per_step = [e for _, e in seen[:: model.config.n_layer]]
    assert all(q == 2 for q, _ in seen)  # one new query node per sequence
    assert per_step == [2 * (min(t, 3) + 1) for t in range(10)]  # w + 1 in-edges once the window is full
    assert pattern.keys(9).tolist() == [6, 7, 8, 9]


def test_decoding_rejects_non_causal_patterns_and_full_caches():
    model = GPT(GPTConfig(**SMALL), pattern=lambda lengths: builders.full(list(lengths)))
    with pytest.raises(ValueError, match="causal"):
        decode.DecodePattern(model)
    model = model_for("causal")
    cache, pattern = decode.KVCache(model, 1), decode.DecodePattern(model)
    for t in range(16):
        decode.step(model, cache, pattern, torch.tensor([0]))
    with pytest.raises(ValueError, match="cache is full"):
        decode.step(model, cache, pattern, torch.tensor([0]))
    with pytest.raises(ValueError, match="temperature"):
        generate(model, torch.zeros(1, 1, dtype=torch.long), 1, temperature=0)
