"""The GPT's learned selections: the indexer's top-k, block top-k, the indexer's KL loss and its gradient."""
from dataclasses import replace

import pytest
import torch

from tgattn import builders
from tgattn.models import GPT, GPTConfig
from tgattn.models.indexer import SelectedAttention, indexer_kl
from tgattn.reference import dense_attention

SMALL = GPTConfig(block_size=12, vocab_size=11, n_layer=2, n_head=2, n_embd=16, indexer_heads=3, indexer_dim=4)
B, T = 2, 12


def causal_blocks():
    """The block-diagonal causal mask ``[B T, B T]`` of the packed batch."""
    return torch.block_diag(*[torch.ones(T, T, dtype=torch.bool).tril()] * B)


def layer(attention, **kw):
    torch.manual_seed(0)
    attn = SelectedAttention(replace(SMALL, attention=attention, **kw)).double()
    for p in attn.parameters():  # larger than GPT's init: scores that are far from uniform
        torch.nn.init.normal_(p, std=0.5)
    return attn, torch.randn(B * T, SMALL.n_embd, dtype=torch.float64)


def test_indexer_keeps_the_top_k_of_its_own_scores_and_attends_there():
    attn, x = layer("indexer_topk", k_top=4)
    out, (edge_index, alpha), _ = attn.select(x, [T] * B, return_attention_weights=True)
    q_index, k_index, weights = attn.indexer(x)
    scores = (torch.einsum("ihd,jd->ijh", q_index, k_index).relu() * weights[:, None, :]).sum(-1)  # [N, N]: I_ij
    allowed = causal_blocks()
    best = scores.masked_fill(~allowed, float("-inf")).topk(4, dim=1).indices  # random scores: no ties
    expected = torch.zeros_like(allowed).scatter_(1, best, True) & allowed  # rows with < 4 keys: all of them
    assert torch.equal(builders.to_mask(edge_index, B * T, B * T), expected)
    assert torch.equal(edge_index, builders.indexer_topk(q_index, k_index, weights, 4, lengths=[T] * B))
    q, k, v = attn.project(x)
    ref = dense_attention(q, k, v, expected)  # [N, H, d]
    torch.testing.assert_close(out, attn.out_proj(ref.reshape(B * T, -1)), rtol=0, atol=1e-12)


def test_block_topk_attends_along_the_builders_head_pattern():
    attn, x = layer("block_topk", k_top=2, block=3)
    out, (edge_index, _), kl = attn.select(x, [T] * B, return_attention_weights=True)
    q, k, v = attn.project(x)
    pattern = builders.block_topk(q, k, 3, 2, lengths=[T] * B)
    assert torch.equal(edge_index, pattern.edge_index) and kl is None
    masks = builders.head_masks(pattern, B * T, B * T)  # [H, N, N]
    ref = torch.stack([dense_attention(q[:, h : h + 1], k[:, h : h + 1], v[:, h : h + 1], masks[h]) for h in range(2)], 1)
    torch.testing.assert_close(out, attn.out_proj(ref.reshape(B * T, -1)), rtol=0, atol=1e-12)


def test_indexer_kl_equals_the_dense_divergence():
    g = torch.Generator().manual_seed(1)
    allowed = causal_blocks() & (torch.rand(B * T, B * T, generator=g) < 0.6) | torch.eye(B * T, dtype=torch.bool)
    target = torch.rand(B * T, B * T, generator=g, dtype=torch.float64).masked_fill(~allowed, 0)
    target = target / target.sum(1, keepdim=True)
    logits = torch.randn(B * T, B * T, generator=g, dtype=torch.float64) * 3
    log_s = logits.masked_fill(~allowed, float("-inf")).log_softmax(1)
    expected = sum(float(p * (p.log() - s)) for p, s, a in zip(target.flatten(), log_s.flatten(), allowed.flatten()) if a) / (B * T)
    dst, src = allowed.nonzero(as_tuple=True)
    kl = indexer_kl(target[dst, src], logits[dst, src], dst, B * T)
    torch.testing.assert_close(kl, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=0)
    shifted = target[dst, src].log() + torch.randn(B * T, generator=g, dtype=torch.float64)[dst]  # log p + a per-query constant
    torch.testing.assert_close(indexer_kl(target[dst, src], shifted, dst, B * T).abs().item(), 0.0, rtol=0, atol=1e-12)


def test_the_warmup_loss_is_zero_exactly_when_the_indexer_matches_the_dense_attention():
    attn, x = layer("indexer_topk", k_top=3)
    with torch.no_grad():  # both uniform over the causal keys: zero queries in the attention and the indexer
        attn.q_proj.weight.zero_(), attn.indexer.q_proj.weight.zero_()  # SMALL: no biases
    _, _, kl = attn.select(x, [T] * B, dense=True)
    torch.testing.assert_close(kl.item(), 0.0, rtol=0, atol=1e-12)
    with torch.no_grad():
        attn.indexer.q_proj.weight.normal_()
    assert attn.select(x, [T] * B, dense=True)[2].item() > 1e-3


def test_the_indexer_loss_reaches_only_the_indexers_and_the_lm_loss_never_does():
    model = GPT(replace(SMALL, attention="indexer_topk", k_top=3))
    idx = torch.randint(11, (B, T))
    for dense in (True, False):
        _, loss, kl = model(idx, idx, dense=dense, return_indexer_loss=True)
        model.zero_grad(set_to_none=True)
        kl.backward()
        grads = {name: p.grad for name, p in model.named_parameters()}
        assert all(g is not None and g.abs().sum() > 0 for name, g in grads.items() if ".indexer." in name)
        assert all(g is None for name, g in grads.items() if ".indexer." not in name)
        model.zero_grad(set_to_none=True)
        loss.backward()
        assert all(p.grad is None for name, p in model.named_parameters() if ".indexer." in name)


@pytest.mark.parametrize("attention, all_keys", [("indexer_topk", dict(k_top=T)), ("block_topk", dict(k_top=3, block=4))])
def test_selecting_every_key_is_dense_causal_attention(attention, all_keys):
    torch.manual_seed(0)
    model = GPT(replace(SMALL, attention=attention, **all_keys, bias=True)).double()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    dense = GPT(replace(SMALL, attention="dense", bias=True)).double()
    missing, unexpected = dense.load_state_dict(model.state_dict(), strict=False)
    assert not missing and all(".indexer." in name for name in unexpected)
    idx = torch.randint(11, (B, T))
    logits, _ = model(idx)
    torch.testing.assert_close(logits, dense(idx)[0], rtol=0, atol=1e-10)
    fewer = GPT(replace(model.config, k_top=2)).double()
    fewer.load_state_dict(model.state_dict())
    assert (fewer(idx)[0] - logits).abs().max() > 1e-3  # the comparison can tell a selection from all keys


def test_selecting_models_refuse_an_edge_set_and_others_a_warmup():
    model = GPT(replace(SMALL, attention="block_topk"))
    idx = torch.randint(11, (1, 4))
    with pytest.raises(ValueError, match="attention 'block_topk' selects its keys in each layer: edge_index cannot be given"):
        model(idx, edge_index=builders.causal(4))
    with pytest.raises(ValueError, match=r"dense=True is the warm-up of a model that selects its keys \(got attention 'graph'\)"):
        GPT(SMALL)(idx, dense=True)
