"""User roads through the layers: inference mode in models, PyG explainers on the fast path,
argument checks that name the bad value."""
from __future__ import annotations

import pytest
import torch

from tgattn import GraphAttention, builders
from tgattn.models import GPT, GPTConfig, generate

SMALL = dict(block_size=12, vocab_size=11, n_layer=2, n_head=2, n_embd=16)


@pytest.mark.parametrize("pattern", ["causal", "window", "bigbird"])
def test_gpt_forward_and_generate_under_inference_mode(pattern):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SMALL, pattern=pattern, window=3)).eval()
    idx = torch.randint(0, 11, (2, 7))
    with torch.no_grad():
        ref_logits, _ = model(idx)
        ref_tokens = generate(model, idx, 4, top_k=1)
    with torch.inference_mode():
        logits, _ = model(idx)
        tokens = generate(model, idx, 4, top_k=1)
    torch.testing.assert_close(logits, ref_logits, atol=1e-6, rtol=0)
    assert torch.equal(tokens, ref_tokens)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(embed_dim=16, num_heads=2.0), r"num_heads must be a positive int \(got 2.0\)"),
        (dict(embed_dim=16, num_heads=0), r"num_heads must be a positive int \(got 0\)"),
        (dict(embed_dim=16, num_heads=True), r"num_heads must be a positive int \(got True\)"),
        (dict(embed_dim=16, num_heads=2, kdim=0), r"kdim must be a positive int \(got 0\)"),
        (dict(embed_dim=16, num_heads=2, kdim=-4), r"kdim must be a positive int \(got -4\)"),
        (dict(embed_dim=16, num_heads=2, vdim=3.5), r"vdim must be a positive int \(got 3.5\)"),
        (dict(embed_dim=16, num_heads=3), "embed_dim \\(16\\) must be divisible by num_heads \\(3\\)"),
    ],
)
def test_graph_attention_rejects_bad_sizes_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GraphAttention(**kwargs)


class _Model(torch.nn.Module):
    """One attention layer and a linear read-out; ``backend`` picks the fast or message-passing path."""

    def __init__(self, backend):
        super().__init__()
        torch.manual_seed(0)
        self.attn, self.out, self.backend = GraphAttention(8, 2), torch.nn.Linear(8, 1), backend

    def forward(self, x, edge_index):
        return self.out(torch.relu(self.attn(x, edge_index, backend=self.backend)))


def test_gnn_explainer_on_the_fast_path_equals_the_message_passing_path():
    from torch_geometric.explain import Explainer, GNNExplainer

    g = torch.Generator().manual_seed(1)
    x = torch.randn(20, 8, generator=g)
    ei = builders.from_mask(torch.rand(20, 20, generator=g) < 0.2)
    masks = []
    for backend in ("auto", "message_passing"):
        explainer = Explainer(
            _Model(backend),
            algorithm=GNNExplainer(epochs=5),
            explanation_type="model",
            edge_mask_type="object",
            model_config=dict(mode="regression", task_level="node", return_type="raw"),
        )
        torch.manual_seed(2)  # the explainer's random initial mask
        masks.append(explainer(x, ei, index=3).edge_mask)
    fast, reference = masks
    assert fast.shape == (ei.shape[1],) and fast.abs().sum() > 0
    # Only edges on a path to node 3 within one hop can matter: the others stay at exactly 0.
    assert torch.equal(fast > 0, reference > 0)
    torch.testing.assert_close(fast, reference, atol=1e-5, rtol=1e-4)
