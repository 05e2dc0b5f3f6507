"""tgattn.hf against transformers' own masks and attention (sdpa in float64, eager in float32)."""
import pytest
import torch

transformers = pytest.importorskip("transformers")
masking = pytest.importorskip("transformers.masking_utils")

import hf_oracle  # noqa: E402
import tgattn.hf as th  # noqa: E402
from tgattn import builders  # noqa: E402
from tgattn.engine import CACHE  # noqa: E402
from tgattn.hf.masks import edge_mask, intervals  # noqa: E402

th.register()
VOCAB = 40


def dense_edges(mask: torch.Tensor) -> set:
    """Cells of transformers' boolean mask [B, 1, Tq, Tk] as EdgeMask edges (key node, query node)."""
    b, i, j = mask[:, 0].nonzero(as_tuple=True)
    tq, tk = mask.shape[2], mask.shape[3]
    return set(zip((b * tk + j).tolist(), (b * tq + i).tolist()))


def hf_edges(rule, b, tq, tk, q_offset=0, kv_offset=0, pad=None, **kw):
    """transformers' sdpa mask as edges, without the query rows that are padding."""
    mask = masking.sdpa_mask(batch_size=b, q_length=tq, kv_length=tk, q_offset=q_offset, kv_offset=kv_offset,
                             mask_function=rule, attention_mask=pad, allow_is_causal_skip=False, **kw)
    if pad is not None:
        mask = mask & pad.bool()[:, q_offset:q_offset + tq].view(b, 1, tq, 1)
    return dense_edges(mask)


def as_set(edge_index):
    return set(map(tuple, edge_index.t().tolist()))


PAD = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 0, 1, 1, 1, 1, 0, 1]])
RULES = {
    "causal": masking.causal_mask_function,
    "full": masking.bidirectional_mask_function,
    "sliding3": masking.sliding_window_causal_mask_function(3),
    "sliding1": masking.sliding_window_causal_mask_function(1),
    "bidirectional_window2": masking.sliding_window_bidirectional_mask_function(2),
    "chunked4": masking.chunked_causal_mask_function(4, torch.tensor([2, 0, 0])),
}


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("offsets", [(0, 9, 0, 9), (7, 2, 0, 9), (8, 1, 5, 4)])  # prefill, 2 new tokens, sliding cache
def test_edge_mask_equals_transformers_mask(rule, padded, offsets):
    q_offset, tq, kv_offset, tk = offsets
    pad = PAD if padded else None
    got = edge_mask(3, tq, tk, q_offset, kv_offset, RULES[rule], pad).edge_index
    assert as_set(got) == hf_edges(RULES[rule], 3, tq, tk, q_offset, kv_offset, pad)
    key = got[1] * 3 * tk + got[0]
    assert bool((key[1:] > key[:-1]).all())  # sorted by (query, key), no duplicates


def test_packed_sequences_and_overlays_equal_transformers_mask():
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    seq = masking.find_packed_sequence_indices(position_ids)
    rule = masking.and_masks(masking.remap_positions_for_packed_sequence(masking.causal_mask_function, position_ids),
                             masking.packed_sequence_mask_function(seq))  # what create_causal_mask makes of them
    assert as_set(edge_mask(1, 9, 9, mask_function=rule).edge_index) == hf_edges(rule, 1, 9, 9)
    assert as_set(edge_mask(1, 9, 9, mask_function=rule).edge_index) == as_set(builders.causal([3, 2, 4]))
    # An overlay (use_vmap=True) may break the one-range-per-query rule: evaluated exactly.
    overlay = masking.or_masks(masking.causal_mask_function, lambda b, h, q, kv: (q == 2) & (kv == 7))
    got = edge_mask(3, 9, 9, mask_function=overlay, attention_mask=PAD, use_vmap=True).edge_index
    assert as_set(got) == hf_edges(overlay, 3, 9, 9, pad=PAD, use_vmap=True)


def test_sliding_window_conventions():
    n, w = 12, 4
    causal = edge_mask(1, n, n, mask_function=masking.sliding_window_causal_mask_function(w)).edge_index
    assert torch.equal(causal, builders.window(n, w - 1, causal=True))  # W keys, the query included
    both = edge_mask(1, n, n, mask_function=masking.sliding_window_bidirectional_mask_function(w)).edge_index
    assert torch.equal(both, builders.window(n, w))  # |q - j| <= W: 2W + 1 keys


def test_edge_mask_memory_is_linear_in_edges():
    from tgattn.bench.measure import _LiveBytes

    n, w = 16384, 8
    with _LiveBytes() as probe:
        m = edge_mask(1, n, n, mask_function=masking.sliding_window_causal_mask_function(w))
    edges = m.edge_index.shape[1]
    assert edges == n * w - w * (w - 1) // 2
    assert probe.peak <= 8 * 16 * edges  # a few [2, E] int64 arrays; an n x n bool mask is 16x more


def test_intervals_assume_one_range():
    lo, hi = intervals(masking.causal_mask_function, 2, torch.arange(3), 0, 2)
    assert lo.tolist() == [[0, 0, 0]] * 2 and hi.tolist() == [[0, 1, 2]] * 2


def llama(cls="Llama", **kw):
    config = getattr(transformers, f"{cls}Config")(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                   max_position_embeddings=64, **kw)
    return getattr(transformers, f"{cls}ForCausalLM")(config).eval()


def qwen2_hybrid():
    config = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True,
                                      sliding_window=3, layer_types=["full_attention", "sliding_attention"])
    return transformers.Qwen2ForCausalLM(config).eval()


def gpt2():
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=64)
    return transformers.GPT2LMHeadModel(config).eval()


def bert():
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=64)
    return transformers.BertModel(config, add_pooling_layer=False).eval()


def run(model, impl, ids, **kw):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        out = model(input_ids=ids, **kw)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def batch(side="left", b=3, t=10):
    ids = torch.randint(1, VOCAB, (b, t))
    mask = torch.ones_like(ids)
    for row, pads in enumerate([0, 3, 6][:b]):
        if side == "left":
            mask[row, :pads] = 0
        else:
            mask[row, t - pads:] = 0
    return ids, mask


MODELS = {
    "gpt2": (gpt2, "left"),
    "bert": (bert, "right"),
    "llama_gqa_left": (llama, "left"),
    "llama_gqa_right": (llama, "right"),
    "mistral_window3": (lambda: llama("Mistral", sliding_window=3), "left"),
    "qwen2_full_and_sliding_layers": (qwen2_hybrid, "left"),
}


@pytest.mark.parametrize("name", MODELS)
def test_model_equals_sdpa_in_float64_and_eager_in_float32(name):
    make, side = MODELS[name]
    model = make()
    ids, mask = batch(side)
    real = mask.bool()
    ours = run(model, "tgattn", ids, attention_mask=mask)
    torch.testing.assert_close(ours[real], run(model, "eager", ids, attention_mask=mask)[real], atol=2e-5, rtol=1e-4)
    model.double()
    ours = run(model, "tgattn", ids, attention_mask=mask)
    torch.testing.assert_close(ours[real], run(model, "sdpa", ids, attention_mask=mask)[real], atol=1e-12, rtol=1e-10)


def test_padding_vanishes_pad_queries_output_zero():
    model = llama()
    ids, mask = batch("right")
    seen = []
    model.model.layers[0].self_attn.register_forward_hook(lambda mod, args, out: seen.append(out[0]))
    run(model, "tgattn", ids, attention_mask=mask)
    pads = ~mask.bool()
    o_bias = model.model.layers[0].self_attn.o_proj.bias
    assert o_bias is None and bool((seen[0][pads] == 0).all())  # pad query slots got no edge: output 0
    alone = run(model, "tgattn", ids[2:, :4])  # row 2 is 4 real tokens + 6 pads on the right
    torch.testing.assert_close(run(model, "tgattn", ids, attention_mask=mask)[2, :4], alone[0], atol=1e-5, rtol=1e-5)


def test_trap_without_mask_builder_padding_is_dropped():
    from transformers import AttentionInterface

    model = llama()
    ids, mask = batch("left")
    masks = []

    def spy(module, q, k, v, attention_mask, **kw):
        masks.append(attention_mask)
        return th.attention_forward(module, q, k, v, attention_mask, **kw)

    AttentionInterface.register("tgattn_no_mask_builder", spy)  # the attention function alone
    wrong = run(model, "tgattn_no_mask_builder", ids, attention_mask=mask)
    assert masks and all(m is None for m in masks)  # transformers built no mask at all
    right = run(model, "sdpa", ids, attention_mask=mask)
    real = mask.bool()
    assert (wrong[real] - right[real]).abs().max() > 1e-2  # padding silently ignored
    th.register("tgattn_with_mask_builder")
    torch.testing.assert_close(run(model, "tgattn_with_mask_builder", ids, attention_mask=mask)[real], right[real],
                               atol=2e-5, rtol=1e-4)


def test_one_mask_and_one_analysis_per_forward(monkeypatch):
    from tgattn.engine import edgeset

    model = llama()
    ids, mask = batch("left")
    calls, analyses = [], []
    analyse = edgeset.analyse
    monkeypatch.setattr(edgeset, "analyse", lambda *a: analyses.append(1) or analyse(*a))
    th.register()
    original = masking.AttentionMaskInterface._global_mapping["tgattn"]
    masking.AttentionMaskInterface.register("tgattn", lambda **kw: calls.append(1) or original(**kw))
    try:
        misses = CACHE.misses
        run(model, "tgattn", ids, attention_mask=mask)
    finally:
        th.register()
    assert len(calls) == 1  # one edge set for both layers
    assert len(analyses) == 1  # prepared once for 2 layers x 2 query groups
    assert CACHE.misses == misses  # and never looked up


def test_packed_batch_equals_padded_batch():
    model = llama().double()
    lengths = [4, 7, 3]
    docs = [torch.randint(1, VOCAB, (n,)) for n in lengths]
    packed_ids = torch.cat(docs).unsqueeze(0)
    position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    packed = run(model, "tgattn", packed_ids, position_ids=position_ids, use_cache=False)[0]  # packing needs no cache
    padded_ids = torch.zeros(3, 7, dtype=torch.long)
    mask = torch.zeros(3, 7, dtype=torch.long)
    for row, doc in enumerate(docs):
        padded_ids[row, : doc.numel()] = doc
        mask[row, : doc.numel()] = 1
    padded = run(model, "sdpa", padded_ids, attention_mask=mask)
    torch.testing.assert_close(packed, padded[mask.bool()], atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("make, cache", [(llama, "dynamic"), (llama, "static"), (gpt2, "dynamic"),
                                         (lambda: llama("Mistral", sliding_window=4), "dynamic"), (qwen2_hybrid, "dynamic")])
def test_generate_token_identical_to_eager(make, cache):
    model = make()
    ids, mask = batch("left", b=2, t=6)
    results = {}
    for impl in ("eager", "tgattn"):
        model.set_attn_implementation(impl)
        results[impl] = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
                                       output_logits=True, return_dict_in_generate=True, cache_implementation=cache)
    assert torch.equal(results["tgattn"].sequences, results["eager"].sequences)
    for ours, theirs in zip(results["tgattn"].logits, results["eager"].logits):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_half_precision_runs_in_float32():
    model = llama().to(torch.bfloat16)
    ids, mask = batch("left")
    ours = run(model, "tgattn", ids, attention_mask=mask)
    assert ours.dtype == torch.bfloat16
    real = mask.bool()
    torch.testing.assert_close(ours[real], run(model, "sdpa", ids, attention_mask=mask)[real], atol=2e-2, rtol=2e-2)


def test_dense_4d_mask_from_the_caller():
    model = llama().double()
    ids = torch.randint(1, VOCAB, (1, 8))
    keep = builders.to_mask(builders.dilated(8, 2, 2, causal=True), 8, 8).view(1, 1, 8, 8)
    torch.testing.assert_close(run(model, "tgattn", ids, attention_mask=keep), run(model, "sdpa", ids, attention_mask=keep))


def test_use_pattern_window_and_builder():
    model = llama().double()
    ids = torch.randint(1, VOCAB, (1, 9))
    th.use_pattern(model, window=2)
    windowed = run(model, "tgattn", ids)
    keep = builders.to_mask(builders.window(9, 2, causal=True), 9, 9).view(1, 1, 9, 9)
    torch.testing.assert_close(windowed, run(model, "sdpa", ids, attention_mask=keep))
    th.use_pattern(model, lambda n: builders.dilated(n, 2, 2, causal=True))
    ids, mask = batch("left")
    padded = run(model, "tgattn", ids, attention_mask=mask)
    alone = run(model, "tgattn", ids[2:, 6:])  # row 2: 6 pads, then 4 tokens
    torch.testing.assert_close(padded[2, 6:], alone[0])  # the pattern sees each row without its pads
    th.use_pattern(model)
    torch.testing.assert_close(run(model, "tgattn", ids[:1]), run(model, "sdpa", ids[:1]))
    with pytest.raises(ValueError, match="builder or window"):
        th.use_pattern(model, builders.causal, window=2)


def test_use_pattern_generate_with_cache_equals_without():
    model = th.use_pattern(llama(), window=3)
    ids, mask = batch("left", b=2, t=6)
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    torch.testing.assert_close(model.generate(ids, use_cache=True, **kw), model.generate(ids, use_cache=False, **kw))


@pytest.mark.parametrize("make", [gpt2, llama])  # llama: 4 query heads on 2 key / value heads
def test_attention_graph_equals_eager_weights(make):
    model = make()
    ids = torch.randint(1, VOCAB, (1, 7))
    layers = th.attention_graph(model, ids)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        dense = model(ids, output_attentions=True).attentions  # per layer [1, H, T, T]
    for (ei, alpha), weights in zip(layers, dense):
        assert as_set(ei) == as_set(builders.causal(7))
        torch.testing.assert_close(alpha, weights[0][:, ei[1], ei[0]].t())
    assert model.config._attn_implementation == "eager"  # switched back


def test_training_gradients_equal_sdpa():
    model = llama().double().train()
    ids, mask = batch("left")
    grads = {}
    for impl in ("sdpa", "tgattn"):
        model.set_attn_implementation(impl)
        model.zero_grad()
        model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss.backward()
        grads[impl] = [p.grad.clone() for p in model.parameters()]
    for ours, theirs in zip(grads["tgattn"], grads["sdpa"]):
        torch.testing.assert_close(ours, theirs, atol=1e-12, rtol=1e-9)


def test_show_ranks_influencers(tmp_path):
    pytest.importorskip("matplotlib")
    from tgattn.__main__ import main
    from tgattn.analysis import top_influencers

    shown = th.show(bert(), [5, 3, 9, 2, 7], query=2, top_k=3)
    assert shown.ranked["rollout"].index.numel() == 3 and shown.figure is not None
    expected = top_influencers(2, 3, shown.attention, method="flow", num_nodes=5)
    torch.testing.assert_close(shown.ranked["flow"].score, expected.score)
    out = tmp_path / "hf.png"
    assert main(["show", "--hf", "random", "--text", "the sky is the limit", "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_errors_name_the_problem():
    q = torch.randn(1, 4, 3, 8)
    kv = torch.randn(1, 2, 3, 8)
    with pytest.raises(NotImplementedError, match="indices"):
        th.attention_forward(None, q, kv, kv, edge_mask(1, 3, 3), indices=torch.zeros(1, 3, 1, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[1, 4, 4\]"):
        th.attention_forward(None, q, kv, kv, edge_mask(1, 4, 4))
    with pytest.raises(ValueError, match="multiple"):
        th.attention_forward(None, torch.randn(1, 3, 3, 8), kv, kv, edge_mask(1, 3, 3))


def grouped_qkv(batch_size=2, length=5):
    """float64 q [B, 4, T, 8] on k, v [B, 2, T, 8] (two query heads per key / value head), requiring grad."""
    g = torch.Generator().manual_seed(3)
    return [torch.randn(batch_size, heads, length, 8, generator=g, dtype=torch.float64).requires_grad_()
            for heads in (4, 2, 2)]


def assert_call_equals_oracle(tgattn_mask, oracle_mask, **kw):
    """attention_forward on tgattn_mask against the dense oracle on oracle_mask: output and every gradient."""
    tensors = grouped_qkv()
    tensors += [t for t in kw.values() if isinstance(t, torch.Tensor) and t.requires_grad]
    results = []
    for call, mask in ((th.attention_forward, tgattn_mask), (hf_oracle.oracle_attention, oracle_mask)):
        out, _ = call(None, *tensors[:3], mask, **kw)
        out_grad = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)
        results.append((out, *torch.autograd.grad(out, tensors, out_grad)))
    for ours, theirs in zip(*results):
        torch.testing.assert_close(ours, theirs, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("shape", [(1, 4, 5, 5), (2, 4, 5, 5), (2, 1, 5, 5), (1, 1, 5, 5)])
def test_position_bias_is_gathered_per_edge_with_gradients(shape):
    # T5's call: scaling=1.0 and position_bias [1, H, Tq, Tk]; grouped heads read their own columns.
    pad = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    dense = masking.sdpa_mask(batch_size=2, q_length=5, kv_length=5, attention_mask=pad.bool(),
                              allow_is_causal_skip=False)  # [B, 1, Tq, Tk] bools
    bias = torch.randn(shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64).requires_grad_()
    assert_call_equals_oracle(edge_mask(2, 5, 5, attention_mask=pad), dense, scaling=1.0, position_bias=bias)


@pytest.mark.parametrize("name", ["s_aux", "sinks"])
def test_softcap_and_sinks_of_grouped_heads_with_gradients(name):
    # Gemma 2's softcap with gpt-oss's sinks [Hq]: query head h (key head h // 2) gets sink h; a padded query sees
    # no key and outputs 0 (the sink takes its whole weight).
    pad = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    dense = masking.sdpa_mask(batch_size=2, q_length=5, kv_length=5, attention_mask=pad.bool(),
                              allow_is_causal_skip=False)  # [B, 1, Tq, Tk] bools
    sinks = torch.tensor([-1.0, 0.5, 2.0, 0.0], dtype=torch.float64, requires_grad=True)
    assert_call_equals_oracle(edge_mask(2, 5, 5, attention_mask=pad), dense, softcap=1.5, **{name: sinks})


@pytest.mark.parametrize("topk", [None, 2])
def test_grouped_heads_go_to_graph_attention_in_one_call_as_they_are(topk, monkeypatch):
    # One call with k, v of their own two heads (backend="tc" reads them in place), equal to the oracle.
    from tgattn.hf import attention

    calls, attend = [], attention.graph_attention
    monkeypatch.setattr(attention, "graph_attention",
                        lambda q, k, *rest, **kw: calls.append((q.shape[1], k.shape[1])) or attend(q, k, *rest, **kw))
    mask = edge_mask(2, 5, 5)
    mask.topk = topk
    if topk is None:
        assert_call_equals_oracle(mask, masking.sdpa_mask(batch_size=2, q_length=5, kv_length=5,
                                                          allow_is_causal_skip=False))
    else:  # tests/test_hf_topk.py checks top-k's results against the oracle
        th.attention_forward(None, *grouped_qkv(), mask)
    assert calls[0] == (4, 2) and len(calls) == 1


@pytest.mark.parametrize("kind", ["float per head", "bool per head", "float broadcast over queries"])
def test_dense_masks_from_the_model_per_head_and_broadcast(kind):
    g = torch.Generator().manual_seed(5)
    keep = torch.rand(2, 4, 5, 5, generator=g) > 0.4
    keep[0, 1, 2] = False  # a head of a query that sees no key: 0, as the oracle's
    if kind == "bool per head":
        mask = keep
    else:
        low = torch.finfo(torch.float64).min
        mask = torch.randn(2, 4, 5, 5, generator=g, dtype=torch.float64).masked_fill(~keep, low)
        if kind == "float broadcast over queries":  # BERT-style [B, 1, 1, Tk] extended mask
            mask = mask[:, :1, :1]
    assert_call_equals_oracle(mask, mask)
    bias = torch.randn(1, 4, 5, 5, generator=g, dtype=torch.float64).requires_grad_()
    assert_call_equals_oracle(mask, mask, position_bias=bias)  # both biases add up


def test_position_bias_of_the_wrong_shape_is_named():
    q, k, v = grouped_qkv()
    with pytest.raises(ValueError, match=r"\[2 or 1, H or 1, 5, 5\] \(got \[1, 4, 5, 4\]\)"):
        th.attention_forward(None, q, k, v, edge_mask(2, 5, 5), position_bias=torch.zeros(1, 4, 5, 4))
    with pytest.raises(ValueError, match="3 heads, but the call has 4"):
        th.attention_forward(None, q, k, v, edge_mask(2, 5, 5), position_bias=torch.zeros(1, 3, 5, 5))


OFF_INTERFACE = {  # models whose attention tgattn cannot run: (config, model class)
    "Bloom": lambda: (transformers.BloomConfig(vocab_size=VOCAB, hidden_size=16, n_layer=1, n_head=2),
                      transformers.BloomForCausalLM),
    "GPTJ": lambda: (transformers.GPTJConfig(vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=2, rotary_dim=4,
                                             n_positions=32), transformers.GPTJForCausalLM),
    "Falcon": lambda: (transformers.FalconConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1,
                                                 num_attention_heads=2), transformers.FalconForCausalLM),
    "CodeGen": lambda: (transformers.CodeGenConfig(vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=2, rotary_dim=4,
                                                   n_positions=32), transformers.CodeGenForCausalLM),
    "MPNet": lambda: (transformers.MPNetConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1,
                                               num_attention_heads=2, intermediate_size=32,
                                               max_position_embeddings=32), transformers.MPNetModel),
    "RoFormer": lambda: (transformers.RoFormerConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1,
                                                     num_attention_heads=2, intermediate_size=32,
                                                     max_position_embeddings=32), transformers.RoFormerModel),
    "Mpt": lambda: (transformers.MptConfig(vocab_size=VOCAB, d_model=16, n_layers=1, n_heads=2, max_seq_len=32),
                    transformers.MptForCausalLM),
    "XGLM": lambda: (transformers.XGLMConfig(vocab_size=VOCAB, d_model=16, num_layers=1, attention_heads=2,
                                             ffn_dim=32, max_position_embeddings=32), transformers.XGLMForCausalLM),
    # Doge's attention goes through the interface, but it first turns the mask into a dense bias of its own.
    "Doge": lambda: (transformers.DogeConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                                             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                             max_position_embeddings=32), transformers.DogeForCausalLM),
}


# transformers 5.24 moved these onto the attention interface (exact there: tests/test_hf_matrix.py).
JOINED_524 = {"GPTJ", "CodeGen"} if tuple(map(int, transformers.__version__.split(".")[:2])) >= (5, 24) else set()


@pytest.mark.parametrize("name", sorted({"Bloom", "GPTJ", "Falcon", "Doge"} - JOINED_524))
def test_use_pattern_refuses_a_model_it_cannot_switch(name):
    config, cls = OFF_INTERFACE[name]()
    model = cls(config).eval()
    before = model.config._attn_implementation
    with pytest.raises(ValueError, match=f"{cls.__name__} cannot run on attn_implementation='tgattn'"):
        th.use_pattern(model, window=2)  # set_attn_implementation alone only logs a warning and keeps eager
    with pytest.raises(ValueError, match=cls.__name__):
        th.attention_graph(model, [1, 2, 3])
    assert model.config._attn_implementation == before


@pytest.mark.parametrize("name", sorted({"Bloom", "CodeGen", "MPNet", "RoFormer", "Mpt", "XGLM", "Doge"} - JOINED_524))
def test_selecting_tgattn_on_a_model_off_the_interface_raises_naming_it(name):
    # transformers offers no per-model hook for a registered name: the model is built, and the
    # first forward is refused by the mask builder before any attention reads the edge set
    # (which raised TypeError / AttributeError inside the model's own attention before).
    config, cls = OFF_INTERFACE[name]()
    model = cls._from_config(config, attn_implementation="tgattn").eval()
    ids, mask = batch("left", b=2, t=6)
    with pytest.raises(ValueError, match=rf"{name}\w*Model cannot run on attn_implementation='tgattn'"):
        model(input_ids=ids, attention_mask=mask)
