"""tgattn.hf over the architectures of the installed transformers (tests/hf_architectures.py).

Each exact architecture, tiny and random: float64 logits equal the dense float64 oracle over
transformers' own boolean mask (1e-10), every attention layer ran on tgattn, float32 logits
equal sdpa's and eager's (2e-5), and greedy ``generate`` of a decoder is token-identical to the
oracle's. Decoders are left-padded, encoders right-padded, encoder-decoders get a padded
encoder. Each refused architecture raises the error that names it and its reason.
"""
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_oracle  # noqa: E402  (registers "dense_oracle")
import tgattn.hf as th  # noqa: E402
from hf_architectures import (ARCHITECTURES, BEFORE, DOCS, EXACT_FROM, REFUSALS, VOCAB, docs_table,  # noqa: E402
                              markdown_table, tiny_model)

th.register()
EXACT = [a for a in ARCHITECTURES if a.result == "exact"]
REFUSED = [a for a in ARCHITECTURES if a.result == "refused"]
FLOAT64 = dict(atol=1e-10, rtol=1e-10)
FLOAT32 = dict(atol=2e-5, rtol=2e-5)


def inputs(kind: str):
    """Ids, padding mask and the real positions of the logits: rows with 0, 2 and 4 pads."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (3, 7), generator=g)
    mask = torch.ones_like(ids)
    for row, pads in enumerate([0, 2, 4]):
        if pads and kind == "decoder":
            mask[row, :pads] = 0
        elif pads:
            mask[row, -pads:] = 0
    batch = dict(input_ids=ids, attention_mask=mask)
    if kind == "seq2seq":
        batch["decoder_input_ids"] = torch.randint(3, VOCAB, (3, 5), generator=g)
        return batch, torch.ones(3, 5, dtype=torch.bool)  # every decoder position is real
    return batch, mask.bool()


def logits(model, impl, batch):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(**batch, use_cache=False).logits


@pytest.mark.slow
@pytest.mark.parametrize("arch", EXACT, ids=lambda a: a.name)
def test_exact_architecture(arch):
    model = tiny_model(arch).double()
    batch, real = inputs(arch.kind)
    hf_oracle.CALLS[0] = 0
    oracle = logits(model, hf_oracle.NAME, batch)
    with th.recording() as layers:
        ours = logits(model, "tgattn", batch)
    assert len(layers) == hf_oracle.CALLS[0] == arch.attention_calls, "every attention layer runs on tgattn"
    torch.testing.assert_close(ours[real], oracle[real], **FLOAT64)

    model.float()
    ours = logits(model, "tgattn", batch)
    for impl in ("sdpa", "eager") if model._supports_sdpa else ("eager",):
        torch.testing.assert_close(ours[real], logits(model, impl, batch)[real], **FLOAT32)

    if arch.kind == "decoder":
        model.double()
        kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        if arch.padded_generate:  # refused with padding: generate from the unpadded row, checked against no cache too
            model.set_attn_implementation("tgattn")
            with pytest.raises(ValueError, match=re.escape(arch.padded_generate)):
                model.generate(**batch, **kw)
            batch = {key: value[:1] for key, value in batch.items()}
        generated = {}
        for impl in (hf_oracle.NAME, "tgattn"):
            model.set_attn_implementation(impl)
            generated[impl] = model.generate(**batch, **kw)
        assert torch.equal(generated["tgattn"].sequences, generated[hf_oracle.NAME].sequences)
        for step_ours, step_oracle in zip(generated["tgattn"].logits, generated[hf_oracle.NAME].logits):
            torch.testing.assert_close(step_ours, step_oracle, **FLOAT64)
        if arch.padded_generate:  # the oracle's masks are sized by the same empty layer: recompute without a cache
            model.set_attn_implementation(hf_oracle.NAME)
            fresh = model.generate(**batch, **kw, use_cache=False)
            assert torch.equal(generated["tgattn"].sequences, fresh.sequences)
            for step_ours, step_fresh in zip(generated["tgattn"].logits, fresh.logits):
                # MiniMax's linear layer itself differs by 5e-7 between its cached and its full form
                torch.testing.assert_close(step_ours, step_fresh, atol=1e-5, rtol=1e-5)


# Models that build some attention mask themselves, as a dense tensor: a pattern cannot apply there.
OWN_DENSE_MASK = {"LayoutLMForMaskedLM": "LayoutLMSelfAttention",
                  "SwitchTransformersForConditionalGeneration": "SwitchTransformersAttention"}


@pytest.mark.slow
@pytest.mark.parametrize("arch", EXACT, ids=lambda a: a.name)
def test_pattern_on_exact_architecture(arch):
    # use_pattern(window=1) equals the oracle with |i - j| <= 1 in self-attention only (cross attention
    # keeps its keys), and changes the model; T5's stacks (config copies) ignored it before.
    model = tiny_model(arch).double()
    batch, real = inputs(arch.kind)
    own = logits(model, "tgattn", batch)
    th.use_pattern(model, window=1)
    if arch.cls in OWN_DENSE_MASK:
        with pytest.raises(ValueError, match=f"{OWN_DENSE_MASK[arch.cls]}: use_pattern cannot apply here"):
            logits(model, "tgattn", batch)
        return
    ours = logits(model, "tgattn", batch)
    hf_oracle.SELF_WINDOW[0] = 1
    try:
        oracle = logits(model, hf_oracle.NAME, batch)
    finally:
        hf_oracle.SELF_WINDOW[0] = None
    torch.testing.assert_close(ours[real], oracle[real], **FLOAT64)
    assert (ours[real] - own[real]).abs().max() > 1e-6


GRADIENTS = ["T5ForConditionalGeneration", "T5GemmaForConditionalGeneration", "LlamaForCausalLM",
             "BartForConditionalGeneration", "BertForMaskedLM", "Gemma2ForCausalLM", "GptOssForCausalLM"]


@pytest.mark.parametrize("name", GRADIENTS)
def test_gradients_of_every_parameter_equal_the_oracle(name):
    arch = next(a for a in EXACT if a.cls == name)
    model = tiny_model(arch).double()
    batch, real = inputs(arch.kind)
    probe = None
    grads = {}
    for impl in (hf_oracle.NAME, "tgattn"):
        model.set_attn_implementation(impl)
        model.zero_grad()
        out = model(**batch, use_cache=False).logits[real]
        probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=out.dtype) if probe is None \
            else probe
        (out * probe).sum().backward()
        grads[impl] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads["tgattn"].keys() == grads[hf_oracle.NAME].keys()
    assert len(grads["tgattn"]) == len(list(model.parameters()))
    for key, theirs in grads[hf_oracle.NAME].items():
        torch.testing.assert_close(grads["tgattn"][key], theirs, **FLOAT64, msg=key)
    if name == "T5ForConditionalGeneration":  # the relative position bias gets its gradient through the edges
        assert grads["tgattn"]["encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"].abs().max() > 0


@pytest.mark.parametrize("arch", REFUSED, ids=lambda a: a.name)
def test_refused_architecture(arch):
    reason = REFUSALS[arch.refused][0]
    model = tiny_model(arch)
    if arch.refused in ("off", "own_mask"):  # known from the class: refused when tgattn selects it
        with pytest.raises(ValueError, match=f"{arch.cls} cannot run on attn_implementation='tgattn': {reason}"):
            th.use_pattern(model)
        if arch.silent:  # never asks tgattn for a mask or an attention: nothing to refuse at the forward
            return
        model = tiny_model(arch, attn_implementation="tgattn")  # built on tgattn: refused at the first forward
    else:
        model.set_attn_implementation("tgattn")
    batch, _ = inputs(arch.kind)
    with pytest.raises((ValueError, NotImplementedError), match=reason) as refusal:
        model(**batch)
    assert "cannot run on attn_implementation='tgattn'" in str(refusal.value) or "tgattn does not support" in str(
        refusal.value)


def _check_docs_table(text: str) -> None:
    """docs/hf.md's table against the matrix of the installed transformers.

    Made on this release: equal, word for word. On another the test extra allows (the matrix holds
    on 5.23 and the newest; the table is the newest's): every row of an architecture whose result
    does not depend on the release (all but those of ``EXACT_FROM`` and ``BEFORE``) is in it as made
    here. Before, another release skipped the whole check.
    """
    table = docs_table(text)
    made_on = re.search(r"\(transformers ([\d.]+)\)", table).group(1)
    ours = markdown_table()
    if made_on == transformers.__version__:
        assert table == ours, "run: python tests/hf_architectures.py"
        return
    moving = {name for names in EXACT_FROM.values() for group in names.values() for name in group.split()}
    moving |= {name for name, _ in BEFORE}
    steady = {f"`{a.cls}`{f' ({a.variant})' if a.variant else ''}" for a in ARCHITECTURES if a.model_type not in moving}
    rows = [row for row in ours.splitlines() if row.startswith("| `") and row.split(" | ")[0][2:] in steady]
    missing = [row for row in rows if row not in table.splitlines()]
    assert len(rows) > 100 and not missing, f"rows of transformers {transformers.__version__} not in docs/hf.md: {missing[:3]}"


def test_docs_table_is_generated():
    _check_docs_table(DOCS.read_text())


def test_the_docs_table_is_checked_on_another_allowed_release(monkeypatch):
    """As on transformers 5.23 (the table is 5.24's): a row that changed is found, an unchanged table passes."""
    monkeypatch.setattr(transformers, "__version__", "5.23.0")
    text = DOCS.read_text()
    _check_docs_table(text)
    row = next(line for line in docs_table(text).splitlines() if line.startswith("| `") and "| exact |" in line)
    with pytest.raises(AssertionError, match="not in docs/hf.md"):
        _check_docs_table(text.replace(row, row.replace("| exact |", "| refused |")))
