"""use_pattern checks its arguments up front and each builder's edges at the forward (issue 46.2).

Before, a ``[E, 2]`` tensor became other edges (logits off by 0.23), a negative id wrapped to a
future token (query 0 saw token 5: off by 0.29), a ``[3, E]`` tensor was taken, a list or a float
tensor failed at the first forward with ``AttributeError`` / ``IndexError``, and ``causal='no'``
was taken as True. Each now ends in one line naming the argument or the builder's fault.
"""
import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_oracle  # noqa: E402  (registers "dense_oracle")
import tgattn.hf as th  # noqa: E402
from tgattn import builders  # noqa: E402
from test_hf import VOCAB, llama  # noqa: E402

IDS = torch.randint(1, VOCAB, (2, 5), generator=torch.Generator().manual_seed(0))  # documents of lengths [5, 5]


def _forward(builder, **kw):
    model = th.use_pattern(llama(), builder, **kw)
    with torch.no_grad():
        return model(IDS).logits


@pytest.mark.parametrize("builder, error, message", [
    (lambda n: builders.causal(n).t(), ValueError, r"the builder must return edge_index of shape \[2, E\] \(got \[30, 2\]\)"),
    (lambda n: torch.cat([builders.causal(n), builders.causal(n)[:1]]), ValueError, r"shape \[2, E\] \(got \[3, 30\]\)"),
    (lambda n: builders.causal(n) - 1, ValueError, r"the builder's edges refer to token -1, but the batch's 2 documents "
                                                   r"hold tokens 0 \.\. 9"),
    (lambda n: builders.causal(n) + 1, ValueError, "refer to token 10"),
    (lambda n: builders.causal(n).tolist(), TypeError, r"must return a LongTensor edge_index \[2, E\] \(got list\)"),
    (lambda n: builders.causal(n).float(), TypeError, r"integer token ids \(got a torch.float32 tensor\)"),
    (lambda n: torch.cat([builders.causal(n), torch.tensor([[4], [5]])], 1), ValueError,
     r"joins token 4 of document 0 to token 5 of document 1 \(lengths \[5, 5\]\)"),
    (lambda n: builders.window(n, 1), ValueError, "leads from key 1 to the earlier query 0 of a causal model"),
])
def test_a_builders_bad_edges_are_one_line_at_the_forward(builder, error, message):
    with pytest.raises(error, match=message) as refused:
        _forward(builder)
    assert "\n" not in str(refused.value)


def test_causal_false_lets_a_builder_give_later_keys():
    """The logits are the dense float64 oracle's under the window |i - j| <= 1, later keys included
    (the causal window's differ by 0.16)."""
    torch.manual_seed(0)
    model, twin = llama().double(), llama().double()
    twin.load_state_dict(model.state_dict())
    th.use_pattern(model, lambda n: builders.window(n, 1), causal=False)
    twin.set_attn_implementation(hf_oracle.NAME)
    i = torch.arange(IDS.shape[1])
    window = ((i.view(-1, 1) - i.view(1, -1)).abs() <= 1).expand(IDS.shape[0], 1, -1, -1)  # [B, 1, T, T]
    calls = hf_oracle.CALLS[0]
    with torch.no_grad():
        got, expected = model(IDS).logits, twin(IDS, attention_mask=window).logits
    assert hf_oracle.CALLS[0] == calls + 2  # the oracle ran each of the 2 layers
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kw, error, message", [
    (dict(window=2, causal="no"), TypeError, r"causal must be True, False or None \(got 'no'\)"),
    (dict(window=2, causal=1), TypeError, r"causal must be True, False or None \(got 1\)"),
    (dict(causal=True), ValueError, r"causal applies to a builder or a window, and neither was given"),
    (dict(window="2"), TypeError, r"window must be an int \(got '2'\)"),
    (dict(window=-1), ValueError, r"window must be >= 0 \(got -1\)"),
    (dict(topk=0), ValueError, r"topk must be >= 1 \(got 0\)"),
    (dict(builder=builders.causal(4)), TypeError, "builder must be a callable lengths -> edge_index"),
    (dict(window=2, name=""), ValueError, r"name must be a non-empty string \(got ''\)"),
])
def test_arguments_are_checked_before_the_model_changes(kw, error, message):
    model = llama()
    own = model.config._attn_implementation
    with pytest.raises(error, match=message):
        th.use_pattern(model, **kw)
    assert model.config._attn_implementation == own


def test_the_model_must_be_a_transformers_model():
    with pytest.raises(TypeError, match=r"model must be a transformers PreTrainedModel \(got Linear\)"):
        th.use_pattern(torch.nn.Linear(2, 2), window=2)
