"""tgattn.hf.heads: heads as graphs, against dense selections and SDPA with the same per-head masks."""
import importlib.util

import pytest
import torch

from tgattn import builders
from tgattn.hf.heads import attended, heads_only, select_heads

transformers = pytest.importorskip("transformers")


def bert(layers=1, heads=3):
    config = transformers.BertConfig(vocab_size=40, hidden_size=12 * heads, num_hidden_layers=layers,
                                     num_attention_heads=heads, intermediate_size=24, max_position_embeddings=64)
    return transformers.BertModel(config, add_pooling_layer=False).eval().double()


def random_attention(n=9, heads=3):
    """Full attention over ``n`` tokens with random rows summing to 1, and its dense twin ``[H, i, j]``."""
    full = builders.full(n)
    weight = torch.rand(full.shape[1], heads, dtype=torch.float64) ** 4
    weight = weight / torch.zeros(n, heads, dtype=torch.float64).index_add_(0, full[1], weight)[full[1]]
    return full, weight, weight.t().reshape(heads, n, n)


def dense_keep(graphs, layer, n):
    """``[H, i, j]``: which keys each head keeps, from the graphs' edges."""
    ei, keep = graphs.edges[layer], graphs.keep[layer]
    out = torch.zeros(keep.shape[1], n, n, dtype=torch.bool)
    out[:, ei[1], ei[0]] = keep.t()
    return out


def test_topk_keeps_each_rows_k_heaviest_keys():
    full, alpha, dense = random_attention()
    graphs = select_heads([(full, alpha)], 9, topk=3)
    want = torch.zeros_like(dense, dtype=torch.bool).scatter_(-1, dense.topk(3, dim=-1).indices, True)
    assert torch.equal(dense_keep(graphs, 0, 9), want)
    torch.testing.assert_close(graphs.mass[0], (dense * want).sum(-1).mean(-1))


@pytest.mark.parametrize("mass", [0.3, 0.8, 0.95, 1.0])
def test_mass_keeps_the_fewest_heaviest_keys_reaching_the_share(mass):
    full, alpha, dense = random_attention()
    graphs = select_heads([(full, alpha)], 9, mass=mass)
    want = torch.zeros_like(dense, dtype=torch.bool)
    for h in range(3):
        for i in range(9):
            order = dense[h, i].argsort(descending=True)
            count = 1
            while count < 9 and dense[h, i, order[:count]].sum() < mass:
                count += 1
            want[h, i, order[:count]] = True
    assert torch.equal(dense_keep(graphs, 0, 9), want)
    assert bool((graphs.mass[0] >= mass - 1e-12).all())


def test_heads_only_equals_sdpa_with_each_heads_mask():
    model, n = bert(layers=1, heads=3), 10
    ids = torch.randint(1, 40, (1, n))
    graphs = attended(model, ids, mass=0.6)
    keep = dense_keep(graphs, 0, n)
    assert keep.sum() < 3 * n * n and not torch.equal(keep[0], keep[1])  # sparse, and the heads differ
    with heads_only(model, graphs):
        got = model(input_ids=ids).last_hidden_state
    assert model.config._attn_implementation == "sdpa"  # back to its own
    want = model(input_ids=ids, attention_mask=keep.unsqueeze(0)).last_hidden_state  # [1, H, T, T]
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    union = graphs.union()
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        on_union = model(input_ids=ids, attention_mask=builders.to_mask(union, n, n).view(1, 1, n, n)).last_hidden_state
    assert (got - on_union).abs().max() > 1e-6  # per head is not the union


def test_the_union_through_use_pattern_equals_sdpa_and_belongs_to_its_text():
    from tgattn.hf import use_pattern

    model, n = bert(layers=2, heads=2), 12
    ids = torch.randint(1, 40, (1, n))
    graphs = attended(model, ids, topk=2)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for layer in range(2):
        mask |= dense_keep(graphs, layer, n).any(0)
    assert torch.equal(builders.to_mask(graphs.union(), n, n), mask)
    use_pattern(model, graphs.pattern)
    with torch.no_grad():
        got = model(input_ids=ids).last_hidden_state
        model.set_attn_implementation("sdpa")
        want = model(input_ids=ids, attention_mask=mask.view(1, 1, n, n)).last_hidden_state
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match="one sequence of 12 tokens; they cannot be the pattern of documents of "
                                         r"lengths \[5\]"):
        graphs.pattern([5])


def test_bad_choices_are_named():
    full, alpha, _ = random_attention()
    for kwargs, words in [({}, "give topk or mass"), ({"topk": 2, "mass": 0.5}, "give topk or mass"),
                          ({"topk": 0}, r"topk must be an integer >= 1 \(got 0\)"),
                          ({"mass": 1.5}, r"mass must be in \(0, 1\] \(got 1.5\)")]:
        with pytest.raises(ValueError, match=words):
            select_heads([(full, alpha)], 9, **kwargs)


@pytest.mark.skipif(importlib.util.find_spec("all_minilm_l6_v2") is None, reason="needs the tgattn[models] extra")
def test_minilm_heads_keep_their_share_and_the_study_reports_it():
    from tgattn.analysis.fidelity import fidelity, load_subject

    subject = load_subject()
    text = "Shall I compare thee to a summer's day? Thou art more lovely and more temperate. " * 4
    study = fidelity(subject, text=text, length=64, patterns=["heads:0.8"], progress=False)
    row = study.rows[1]
    graphs = attended(subject.model, subject.passages(text, 64, 1)[0], mass=0.8)
    torch.testing.assert_close(torch.tensor(study.mass["heads:0.8"], dtype=torch.float64), graphs.mass,
                               atol=1e-6, rtol=0)
    assert 0.8 <= row["mass_kept_min"] and row["edges_kept"] < 0.5 and row["token_cosine"] > 0.9
