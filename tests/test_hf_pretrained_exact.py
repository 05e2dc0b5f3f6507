"""The real all-MiniLM-L6-v2 (tgattn[models]) on attn_implementation="tgattn" equals SDPA / eager on real text.

Tiny Shakespeare passages, tokenized by the model's own tokenizer: a padded batch of unequal
lengths (its forward quick, its gradients slow) and one of 512 tokens, the model's longest (slow). float64: outputs and every
parameter gradient within 1e-10 of SDPA (eager too, forward). float32: tgattn's error against the
float64 SDPA result is at most twice SDPA's own float32 error, measured on the same batch (the
tolerance is derived, not guessed). Every builder's pattern through ``use_pattern`` equals SDPA
given that pattern as a boolean 4-D mask.
"""
import importlib.util

import pytest
import torch

from conftest import DATA

pytestmark = pytest.mark.skipif(importlib.util.find_spec("all_minilm_l6_v2") is None,
                                reason="needs the tgattn[models] extra (in the test extra)")

EXACT = 1e-10  # float64, the bound (measured: 4e-15 forward, 2e-14 gradients)
FLOAT32_SLACK = 2.0  # tgattn's float32 error may be up to twice SDPA's own (measured: 1.02x forward, 0.72x gradients)


@pytest.fixture(scope="module")
def minilm():
    """``(model, tokenizer, text)``: the model in float64 on tgattn, Tiny Shakespeare."""
    transformers = pytest.importorskip("transformers")
    import tgattn.hf as th
    from tgattn.datasets import load_tiny_shakespeare

    if not DATA.is_dir():
        pytest.skip(f"shared data folder not found at {DATA} (set TGATTN_DATA)")
    th.register()
    path = th.minilm_path()
    model = transformers.AutoModel.from_pretrained(path, attn_implementation="tgattn").eval().double()
    return model, transformers.AutoTokenizer.from_pretrained(path), load_tiny_shakespeare(DATA)


def padded_batch(tokenizer, text, spans=((0, 80), (1000, 1050), (2000, 2015))):
    """Three passages of 21, 10 and 9 tokens ([CLS] ... [SEP]), right-padded to 21 (short: the
    gradients of 22M parameters are the cost)."""
    return tokenizer([text[a:b] for a, b in spans], return_tensors="pt", padding=True)


def forward_and_grads(model, impl, batch, dtype, *, grads=True):
    """``(last hidden state of the real tokens, every parameter gradient flattened)`` of the mean-pooled
    embedding dotted with a fixed vector (the loss a sentence-embedding head would see)."""
    model.to(dtype).set_attn_implementation(impl)
    model.zero_grad()
    with torch.set_grad_enabled(grads):
        out = model(**batch).last_hidden_state  # [B, T, D]
    real = batch["attention_mask"].bool()
    if not grads:
        return out[real].double(), None
    pooled = (out * real[..., None]).sum(1) / real.sum(1, keepdim=True)  # [B, D]
    (pooled @ torch.linspace(-1, 1, out.shape[-1], dtype=dtype)).sum().backward()
    grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).double()
    return out[real].detach().double(), grad


def max_error(got, want) -> float:
    return float((got - want).abs().max())


def assert_exact_and_float32_as_sdpa(model, batch):
    sdpa = forward_and_grads(model, "sdpa", batch, torch.float64)
    ours = forward_and_grads(model, "tgattn", batch, torch.float64)
    assert sdpa[1].numel() > 2e7  # every weight of the encoder got a gradient (22M parameters, less the pooler)
    for got, want, what in zip(ours, sdpa, ("output", "gradients")):
        assert max_error(got, want) <= EXACT, f"{what} in float64: {max_error(got, want):.2e} from SDPA"
    sdpa32 = forward_and_grads(model, "sdpa", batch, torch.float32)
    ours32 = forward_and_grads(model, "tgattn", batch, torch.float32)
    model.double()
    for got, theirs, truth, what in zip(ours32, sdpa32, sdpa, ("output", "gradients")):
        bound = FLOAT32_SLACK * max_error(theirs, truth)
        assert 0 < max_error(got, truth) <= bound, f"{what} in float32: {max_error(got, truth):.2e} > {bound:.2e}"


@pytest.mark.slow  # gradients of 22M parameters in two precisions, four times: ~5-10 s on 2 shared cores
def test_padded_batch_of_unequal_lengths_equals_sdpa_forward_and_gradients(minilm):
    model, tokenizer, text = minilm
    batch = padded_batch(tokenizer, text)
    assert batch["attention_mask"].sum(1).tolist() == [21, 10, 9]
    assert_exact_and_float32_as_sdpa(model, batch)


def test_padded_batch_equals_sdpa_and_eager_in_float64(minilm):
    model, tokenizer, text = minilm
    batch = padded_batch(tokenizer, text)
    ours, _ = forward_and_grads(model, "tgattn", batch, torch.float64, grads=False)
    for impl in ("sdpa", "eager"):
        theirs, _ = forward_and_grads(model, impl, batch, torch.float64, grads=False)
        assert max_error(ours, theirs) <= EXACT, impl


@pytest.mark.slow  # 512 tokens, forward and backward four times: ~20 s on 2 shared cores
def test_512_tokens_equal_sdpa_forward_and_gradients(minilm):
    model, tokenizer, text = minilm
    batch = tokenizer([text[:4000]], return_tensors="pt", truncation=True, max_length=512)
    assert batch["input_ids"].shape == (1, 512)
    assert_exact_and_float32_as_sdpa(model, batch)


def _seeded(build):
    """A random builder drawing the same edges at every call (the mask and the pattern must agree)."""
    return lambda n: build(n, torch.Generator().manual_seed(5))


def _patterns():
    from tgattn import builders as b

    return {
        "window": lambda n: b.window(n, 4),
        "dilated": lambda n: b.dilated(n, 3, 2),
        "block_local": lambda n: b.block_local(n, 8),
        "bigbird": _seeded(lambda n, g: b.bigbird(n, 3, 2, 2, generator=g)),
        "random": _seeded(lambda n, g: b.random(n, 4, generator=g)),
        "expander": _seeded(lambda n, g: b.expander(n, 4, generator=g)),
        "global_tokens": lambda n: b.global_tokens(n, [0]),
        "strided": lambda n: b.strided(n, 5),
        "fixed": lambda n: b.fixed(n, 8, 2),
        "prefix_lm": lambda n: b.prefix_lm(n, 10),
        "causal": lambda n: b.causal(n),
        "full": lambda n: b.full(n),
    }


@pytest.mark.parametrize("name", list(_patterns()))
def test_every_builder_through_use_pattern_equals_sdpa_with_its_mask(minilm, name):
    import tgattn.hf as th

    model, tokenizer, text = minilm
    model.double()
    build = _patterns()[name]
    batch = padded_batch(tokenizer, text, spans=((0, 150), (2000, 2060)))  # 38 and 18 tokens
    lengths = batch["attention_mask"].sum(1).tolist()
    pad = ~batch["attention_mask"].bool()
    keep = torch.diag_embed(pad).unsqueeze(1)  # [B, 1, T, T]: pads see themselves (no NaN row), real tokens nothing yet
    key, query = build(lengths)  # the packed batch, as use_pattern calls it (random builders draw row after row)
    start = torch.tensor([0] + lengths).cumsum(0)
    row = torch.bucketize(query, start[1:], right=True)
    keep[row, 0, query - start[row], key - start[row]] = True
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        want = model(input_ids=batch["input_ids"], attention_mask=keep).last_hidden_state
    th.use_pattern(model, build)
    try:
        with torch.no_grad():
            got = model(**batch).last_hidden_state
    finally:
        th.use_pattern(model)
    real = batch["attention_mask"].bool()
    assert max_error(got[real], want[real]) <= EXACT
    if name != "full":  # the pattern matters: full attention gives another result
        model.set_attn_implementation("sdpa")
        with torch.no_grad():
            full = model(**batch).last_hidden_state
        assert max_error(full[real], want[real]) > 1e-3
