"""``tgattn.hf.use_pattern(model, topk=K)``: each layer keeps each query head's K best keys.

The reference is the dense float64 oracle of tests/hf_oracle.py with ``oracle_topk = K`` set on
the self-attention modules: the full logits (scaled, soft-capped, plus the position bias) under
transformers' own mask, ``torch.topk`` per row and head, then dense attention on what is left.
"""
import dataclasses
from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_oracle  # noqa: E402,F401  (registers "dense_oracle")
import tgattn.hf as th  # noqa: E402
from tgattn import builders  # noqa: E402
from tgattn.hf.attention import attention_forward  # noqa: E402
from transformers import masking_utils as masking  # noqa: E402

th.register()
VOCAB = 64
TOL = dict(atol=1e-10, rtol=1e-10)


def llama(**kw):
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, **kw)
    return transformers.LlamaForCausalLM(config).eval().double()


def gemma2():  # soft-capped logits, sliding and full layers, 4 query heads on 2 key / value heads
    config = transformers.Gemma2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4,
                                       attn_logit_softcapping=2.0, max_position_embeddings=64)
    return transformers.Gemma2ForCausalLM(config).eval().double()


def t5():  # relative position bias in every self-attention; cross attention keeps all its keys
    config = transformers.T5Config(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2,
                                   relative_attention_num_buckets=8, decoder_start_token_id=0)
    return transformers.T5ForConditionalGeneration(config).eval().double()


def set_oracle_topk(model, k_top):
    """``oracle_topk`` on the self-attention modules (named ``self_attn`` / ``SelfAttention``)."""
    for name, module in model.named_modules():
        if name.endswith(("self_attn", "SelfAttention")):
            module.oracle_topk = k_top


def padded_ids(b=3, t=9):
    ids = torch.randint(3, VOCAB, (b, t))
    mask = torch.ones_like(ids)
    for row, pads in enumerate([0, 2, 5][:b]):
        mask[row, :pads] = 0
    return ids, mask


def outputs(model, impl, inputs, *, grad=False):
    model.set_attn_implementation(impl)
    model.zero_grad()
    with torch.set_grad_enabled(grad):
        out = model(**inputs, use_cache=False).logits
    if grad:
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("k_top", [1, 3])
@pytest.mark.parametrize("make", [llama, gemma2])
def test_topk_equals_the_oracle_on_a_padded_batch_with_gradients(make, k_top):
    torch.manual_seed(0)
    model = th.use_pattern(make(), topk=k_top)
    ids, mask = padded_ids()
    real = mask.bool()
    ours, our_grads = outputs(model, "tgattn", dict(input_ids=ids, attention_mask=mask), grad=True)
    set_oracle_topk(model, k_top)
    dense, dense_grads = outputs(model, hf_oracle.NAME, dict(input_ids=ids, attention_mask=mask), grad=True)
    torch.testing.assert_close(ours[real], dense[real], **TOL)
    assert our_grads.keys() == dense_grads.keys() and len(our_grads) > 0
    for name in our_grads:
        torch.testing.assert_close(our_grads[name], dense_grads[name], **TOL, msg=name)
    set_oracle_topk(model, None)
    unselected, _ = outputs(model, hf_oracle.NAME, dict(input_ids=ids, attention_mask=mask))
    assert (ours[real] - unselected[real]).abs().max() > 1e-3  # the selection changed the function


def test_topk_on_self_attention_only_with_position_bias():
    torch.manual_seed(1)
    model = th.use_pattern(t5(), topk=2)
    ids, mask = padded_ids(t=8)
    inputs = dict(input_ids=ids, attention_mask=mask, decoder_input_ids=torch.randint(3, VOCAB, (3, 6)))
    ours, _ = outputs(model, "tgattn", inputs)
    set_oracle_topk(model, 2)  # encoder and decoder self-attention; EncDecAttention keeps every key
    dense, _ = outputs(model, hf_oracle.NAME, inputs)
    torch.testing.assert_close(ours, dense, **TOL)


def test_topk_after_a_pattern_selects_among_the_pattern_keys():
    torch.manual_seed(2)
    model = th.use_pattern(llama(), window=3, topk=2)
    ids = torch.randint(3, VOCAB, (1, 10))
    ours, _ = outputs(model, "tgattn", dict(input_ids=ids))
    for name, module in model.named_modules():
        if name.endswith("self_attn"):
            module.oracle_window = 3
    set_oracle_topk(model, 2)
    dense, _ = outputs(model, hf_oracle.NAME, dict(input_ids=ids))
    torch.testing.assert_close(ours, dense, **TOL)


def test_recorded_weights_hold_topk_keys_per_query_head():
    torch.manual_seed(3)
    model = th.use_pattern(llama(), topk=3)
    ids = torch.randint(3, VOCAB, (1, 8))
    layers = th.attention_graph(model, ids)
    for edge_index, alpha in layers:
        assert {tuple(e) for e in edge_index.T.tolist()} == {tuple(e) for e in builders.causal(8).T.tolist()}
        kept = torch.zeros(8, alpha.shape[1], dtype=torch.long).index_add_(0, edge_index[1], (alpha > 0).long())
        assert kept.eq(torch.arange(1, 9).clamp(max=3).view(-1, 1)).all()  # min(i + 1, 3) keys per query head
        sums = torch.zeros(8, alpha.shape[1], dtype=alpha.dtype).index_add_(0, edge_index[1], alpha)
        torch.testing.assert_close(sums, torch.ones_like(sums))


def test_topk_generate_with_cache_equals_without_and_all_keys_is_the_model():
    torch.manual_seed(4)
    model = th.use_pattern(llama(), topk=2)
    ids, mask = padded_ids(b=2, t=6)
    kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    torch.testing.assert_close(model.generate(ids, use_cache=True, **kw), model.generate(ids, use_cache=False, **kw))
    many, _ = outputs(th.use_pattern(model, topk=64), "tgattn", dict(input_ids=ids, attention_mask=mask))
    own, _ = outputs(th.use_pattern(model), "sdpa", dict(input_ids=ids, attention_mask=mask))
    torch.testing.assert_close(many[mask.bool()], own[mask.bool()], **TOL)


@pytest.mark.parametrize("kw", [dict(scaling=1.0, position_bias=True), dict(softcap=0.7, position_bias=True),
                                dict(softcap=1.5, s_aux=True), dict(scaling=-0.5)])
def test_call_ranks_keys_by_the_logits_the_softmax_sees(kw):
    # Soft-capping is monotone, so it changes the choice only beside a bias; a negative scale reverses it.
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, heads, 6, 8, generator=g, dtype=torch.float64).requires_grad_() for heads in (4, 2, 2))
    if kw.pop("position_bias", False):
        kw["position_bias"] = (3 * torch.randn(1, 4, 6, 6, generator=g, dtype=torch.float64)).requires_grad_()
    if kw.pop("s_aux", False):
        kw["s_aux"] = torch.tensor([-1.0, 0.5, 2.0, 0.0], dtype=torch.float64, requires_grad=True)
    pad = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    dense = masking.sdpa_mask(batch_size=2, q_length=6, kv_length=6, attention_mask=pad.bool(), allow_is_causal_skip=False)
    mask = dataclasses.replace(th.edge_mask(2, 6, 6, attention_mask=pad), topk=2)
    leaves = [q, k, v, *(t for t in kw.values() if isinstance(t, torch.Tensor))]
    results = []
    for call, module, m in ((attention_forward, None, mask), (hf_oracle.oracle_attention, SimpleNamespace(oracle_topk=2), dense)):
        out, _ = call(module, q, k, v, m, **kw)
        out_grad = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)
        results.append((out, *torch.autograd.grad(out, leaves, out_grad)))
    for ours, theirs in zip(*results):
        torch.testing.assert_close(ours, theirs, **TOL)


@pytest.mark.parametrize("bad, error", [(0, ValueError), (-2, ValueError), (1.5, TypeError), ("4", TypeError)])
def test_bad_topk_is_named(bad, error):
    with pytest.raises(error, match="topk"):
        th.use_pattern(llama(), topk=bad)


@pytest.mark.parametrize("choice", [dict(window=1), dict(topk=2)])
def test_a_model_that_builds_its_own_dense_mask_refuses_a_pattern(choice):
    # LayoutLM (and SwitchTransformers' encoder) hand the attention call a dense mask they built
    # themselves: the pattern, which rides on tgattn's own masks, was silently not applied.
    config = transformers.LayoutLMConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                         intermediate_size=32, max_position_embeddings=64)
    model = transformers.LayoutLMForMaskedLM(config).eval()
    ids = torch.randint(3, VOCAB, (1, 6))
    th.use_pattern(model, **choice)
    with pytest.raises(ValueError, match="LayoutLMSelfAttention: use_pattern cannot apply here"):
        model(input_ids=ids)
    th.use_pattern(model)  # the model's own rule runs again
    assert model(input_ids=ids).logits.shape == (1, 6, VOCAB)
