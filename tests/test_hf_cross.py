"""tgattn.hf on encoder-decoders: cross attention over a padded encoder, and patterns on self-attention only.

The reference is the dense float64 oracle of tests/hf_oracle.py, registered with transformers
as "dense_oracle": transformers' own boolean mask and :func:`tgattn.reference.dense_attention` on it.
"""
import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_oracle  # noqa: E402,F401  (registers "dense_oracle")
import tgattn.hf as th  # noqa: E402

th.register()
VOCAB = 64
TOL = dict(atol=1e-10, rtol=1e-10)


def padded(side, b=3, t=8):
    """Encoder ids and padding mask: rows with 0, 2 and 5 pads on ``side``."""
    ids = torch.randint(3, VOCAB, (b, t))
    mask = torch.ones_like(ids)
    for row, pads in enumerate([0, 2, 5][:b]):
        if side == "left":
            mask[row, :pads] = 0
        else:
            mask[row, t - pads:] = 0
    return ids, mask


def t5gemma():
    def stack():
        return transformers.T5GemmaModuleConfig(
            vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=8, query_pre_attn_scalar=8, sliding_window=3, max_position_embeddings=64,
            attn_logit_softcapping=None, final_logit_softcapping=None)  # layers: one sliding, one full

    config = transformers.T5GemmaConfig(encoder=stack(), decoder=stack(), vocab_size=VOCAB)
    return transformers.T5GemmaForConditionalGeneration(config).eval().double()


def bart():
    config = transformers.BartConfig(vocab_size=VOCAB, d_model=16, encoder_layers=2, decoder_layers=2,
                                     encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                                     decoder_ffn_dim=32, max_position_embeddings=64)
    return transformers.BartForConditionalGeneration(config).eval().double()


def logits(model, impl, **inputs):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(**inputs, use_cache=False).logits


def seq2seq_inputs(side, decoder_length=5):
    ids, mask = padded(side)
    return dict(input_ids=ids, attention_mask=mask, decoder_input_ids=torch.randint(3, VOCAB, (3, decoder_length)))


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("make", [t5gemma, bart])
def test_seq2seq_with_padded_encoder_equals_oracle(make, side):
    # T5Gemma's decoder sub-config has no is_encoder_decoder / add_cross_attention flag: the
    # encoder's padding was read as the decoder's (query i lost its cross attention where
    # encoder position i is a pad). Decoder length 8 = encoder length: shapes alone cannot tell.
    model = make()
    for decoder_length in (5, 8):
        inputs = seq2seq_inputs(side, decoder_length)
        torch.testing.assert_close(logits(model, "tgattn", **inputs), logits(model, "dense_oracle", **inputs), **TOL)


def test_seq2seq_generate_with_left_padded_encoder_equals_oracle():
    model = t5gemma()
    ids, mask = padded("left")
    results = {}
    for impl in ("dense_oracle", "tgattn"):
        model.set_attn_implementation(impl)
        results[impl] = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                                       output_logits=True, return_dict_in_generate=True)
    assert torch.equal(results["tgattn"].sequences, results["dense_oracle"].sequences)
    for ours, theirs in zip(results["tgattn"].logits, results["dense_oracle"].logits):
        torch.testing.assert_close(ours, theirs, **TOL)


@pytest.mark.parametrize("side", ["left", "right"])
def test_musicgen_decoder_with_padded_encoder_equals_oracle(side):
    config = transformers.MusicgenDecoderConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, ffn_dim=32,
                                                num_attention_heads=2, num_codebooks=2, max_position_embeddings=64,
                                                pad_token_id=VOCAB, bos_token_id=VOCAB)
    model = transformers.MusicgenForCausalLM(config).eval().double()
    _, mask = padded(side)
    inputs = dict(input_ids=torch.randint(0, VOCAB, (3 * 2, 6)),  # [B * codebooks, T]
                  encoder_hidden_states=torch.randn(3, 8, 16, dtype=torch.float64), encoder_attention_mask=mask)
    torch.testing.assert_close(logits(model, "tgattn", **inputs), logits(model, "dense_oracle", **inputs), **TOL)


@pytest.mark.parametrize("side", ["left", "right"])
def test_use_pattern_wider_than_every_sequence_changes_nothing(side):
    model = bart()
    inputs = seq2seq_inputs(side, decoder_length=8)
    before = logits(model, "tgattn", **inputs)
    th.use_pattern(model, window=1000)  # a pattern on self-attention: cross attention keeps its own mask
    torch.testing.assert_close(logits(model, "tgattn", **inputs), before, **TOL)


@pytest.mark.parametrize("side", ["left", "right"])
def test_use_pattern_window_changes_self_attention_only(side):
    model = bart()
    inputs = seq2seq_inputs(side, decoder_length=8)
    own = logits(model, "tgattn", **inputs)
    th.use_pattern(model, window=1)
    windowed = logits(model, "tgattn", **inputs)
    for layer in (*model.model.encoder.layers, *model.model.decoder.layers):
        layer.self_attn.oracle_window = 1  # not layer.encoder_attn: cross attention stays whole
    torch.testing.assert_close(windowed, logits(model, "dense_oracle", **inputs), **TOL)
    assert (windowed - own).abs().max() > 1e-3  # the window did change the model


def test_use_pattern_reaches_stacks_that_copy_the_config():
    # T5's encoder and decoder stacks hold deep copies of the model's config: a pattern kept
    # only beside model.config was silently ignored there (the model ran its own rule).
    config = transformers.T5Config(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2,
                                   relative_attention_num_buckets=8, decoder_start_token_id=0)
    model = transformers.T5ForConditionalGeneration(config).eval().double()
    assert model.encoder.config is not model.config
    inputs = seq2seq_inputs("right", decoder_length=6)
    own = logits(model, "tgattn", **inputs)
    th.use_pattern(model, window=1)
    windowed = logits(model, "tgattn", **inputs)
    for name, module in model.named_modules():
        if name.endswith("SelfAttention"):  # not EncDecAttention: cross attention stays whole
            module.oracle_window = 1
    torch.testing.assert_close(windowed, logits(model, "dense_oracle", **inputs), **TOL)
    assert (windowed - own).abs().max() > 1e-3
