"""tgattn.analysis.fidelity: the sparsity-fidelity study against independent computations.

Each number is recomputed another way: output fidelity from SDPA given the pattern as a dense
boolean mask (encoder) or from the GPT's own forward and cross-entropy (causal), the attention
mass from eager attention's dense weights, the edges kept from the builder. A pattern keeping
every edge scores exactly the reference.
"""
import csv
import importlib.util
import json
import re
from dataclasses import asdict

import pytest
import torch
import torch.nn.functional as F

from conftest import DATA, one_line_error
from tgattn import builders
from tgattn.analysis.fidelity import cosine, fidelity, load_subject, mass_kept, save_study
from tgattn.analysis.fidelity_models import GPTSubject, HFSubject
from tgattn.analysis.fidelity_patterns import parse_pattern

MINILM = importlib.util.find_spec("all_minilm_l6_v2") is not None
needs_minilm = pytest.mark.skipif(not MINILM, reason="needs the tgattn[models] extra (in the test extra)")
VOCAB = "abcdefghijklmnopqrstuvwxyz ,.\n"
TEXT = "the quick brown fox jumps over the lazy dog, and then it naps.\n" * 4


@pytest.fixture(scope="module")
def minilm():
    pytest.importorskip("transformers")
    if not MINILM:
        pytest.skip("needs the tgattn[models] extra")
    subject = load_subject()
    subject.model.double()
    return subject


@pytest.fixture(scope="module")
def shakespeare():
    from tgattn.datasets import load_tiny_shakespeare

    if not DATA.is_dir():
        pytest.skip(f"shared data folder not found at {DATA} (set TGATTN_DATA)")
    return load_tiny_shakespeare(DATA)


def gpt_checkpoint(path, **config):
    """A random tiny GPT over ``VOCAB`` saved as a tgattn.lm checkpoint."""
    from tgattn.lm import save_checkpoint
    from tgattn.models import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(block_size=32, vocab_size=len(VOCAB), n_layer=2, n_head=2, n_embd=16, **config)
    save_checkpoint(path, {"model": GPT(cfg).state_dict(), "config": asdict(cfg), "vocab": VOCAB})
    return path


def test_cosine_is_exactly_one_for_equal_rows_and_the_cosine_otherwise():
    a, b = torch.randn(6, 9), torch.randn(6, 9)
    assert bool((cosine(a, a) == 1).all())
    torch.testing.assert_close(cosine(a, b), F.cosine_similarity(a.double(), b.double()), atol=1e-12, rtol=0)


def test_mass_kept_is_the_dense_attention_mass_on_the_kept_edges():
    n, heads = 7, 3
    full = builders.full(n)
    alpha = torch.rand(full.shape[1], heads)
    alpha = alpha / torch.zeros(n, heads).index_add_(0, full[1], alpha)[full[1]]  # rows sum to 1
    kept = builders.window(n, 1)
    keep = torch.rand(kept.shape[1], heads) < 0.7
    dense = torch.zeros(heads, n, n)
    dense[:, full[1], full[0]] = alpha.t()  # [H, i, j]
    chosen = torch.zeros(heads, n, n, dtype=torch.bool)
    chosen[:, kept[1], kept[0]] = keep.t()
    want = (dense * chosen).sum(-1).mean(-1)  # [H]
    torch.testing.assert_close(mass_kept([(full, alpha)], [(kept, keep)], n)[0], want.double(), atol=1e-6, rtol=0)


@needs_minilm
def test_every_edge_kept_scores_exactly_full_fidelity(minilm, shakespeare):
    patterns = ["window:40", "block:40", "topk:40", "heads:1", "global:40:0", "topk:5", "window:2"]
    study = fidelity(minilm, text=shakespeare, length=40, patterns=patterns, progress=False)
    rows = {row["pattern"]: row for row in study.rows}
    assert list(rows) == ["full", *patterns]
    for label in ["full", *patterns[:-2]]:
        exact = {key: rows[label][key] for key in ("edges_kept", "mass_kept", "mass_kept_min", "pooled_cosine",
                                                   "token_cosine", "token_cosine_min")}
        assert exact == dict.fromkeys(exact, 1.0), label
    assert rows["topk:5"]["edges_kept"] == 5 / 40  # each query head's 5 best keys of 40
    assert rows["topk:5"]["mass_kept_min"] < rows["topk:5"]["mass_kept"] < 1
    dropped = rows["window:2"]
    assert dropped["edges_kept"] == sum(2 * 2 + 1 - (i < 2) * (2 - i) - (i > 37) * (i - 37) for i in range(40)) / 1600
    assert dropped["pooled_cosine"] < 0.9 and dropped["mass_kept"] < 0.5


@needs_minilm
def test_encoder_fidelity_and_mass_equal_sdpa_and_eager_with_the_dense_mask(minilm, shakespeare):
    n = 48
    study = fidelity(minilm, text=shakespeare, length=n, patterns=["window:3"], progress=False)
    row = study.rows[1]
    ids = minilm.passages(shakespeare, n, 1)[0].view(1, -1)
    model = minilm.model
    keep = builders.to_mask(builders.window(n, 3), n, n).view(1, 1, n, n)
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        full = model(input_ids=ids).last_hidden_state[0]
        sparse = model(input_ids=ids, attention_mask=keep).last_hidden_state[0]
        model.set_attn_implementation("eager")
        weights = model(input_ids=ids, output_attentions=True).attentions  # per layer [1, H, T, T]
    model.set_attn_implementation("tgattn")
    assert row["pooled_cosine"] == pytest.approx(float(F.cosine_similarity(full.mean(0), sparse.mean(0), dim=0)),
                                                 abs=1e-9)
    tokens = F.cosine_similarity(full, sparse, dim=-1)
    assert row["token_cosine"] == pytest.approx(float(tokens.mean()), abs=1e-9)
    assert row["token_cosine_min"] == pytest.approx(float(tokens.min()), abs=1e-9)
    mass = torch.stack([(w[0] * keep[0]).sum(-1).mean(-1) for w in weights])  # [L, H]
    torch.testing.assert_close(torch.tensor(study.mass["window:3"], dtype=torch.float64), mass, atol=1e-9, rtol=0)
    assert row["mass_kept_min"] == pytest.approx(float(mass.min()), abs=1e-9)


def test_gpt_checkpoint_perplexity_and_kl_equal_its_own_forward(tmp_path):
    subject = GPTSubject.load(gpt_checkpoint(tmp_path / "gpt.pt"))
    study = fidelity(subject, text=TEXT, length=32, passages=2,
                     patterns=["window:4", "heads:0.5", "topk:2", "indexer"], progress=False)
    rows = {row["pattern"]: row for row in study.rows}
    assert list(rows) == ["full", "window:4", "heads:0.5"] and set(study.skipped) == {"topk:2", "indexer"}
    assert rows["full"]["kl"] == 0 and rows["full"]["perplexity"] == rows["full"]["perplexity_full"]
    ppl, kl = [], []
    for ids in subject.passages(TEXT, 32, 2):
        with torch.no_grad():
            full = subject.model(ids.view(1, -1))[0][0].double()
            sparse = subject.model(ids.view(1, -1), edge_index=builders.window(32, 4, causal=True))[0][0].double()
        ppl.append(F.cross_entropy(sparse[:-1], ids[1:]).exp())
        kl.append(F.kl_div(sparse.log_softmax(-1), full.log_softmax(-1), log_target=True, reduction="batchmean"))
    assert rows["window:4"]["perplexity"] == pytest.approx(float(sum(ppl) / 2), rel=1e-6)
    assert rows["window:4"]["kl"] == pytest.approx(float(sum(kl) / 2), rel=1e-6)
    assert rows["window:4"]["edges_kept"] == (32 * 5 - 10) / (32 * 33 / 2)


def test_gpt_with_a_learned_indexer_runs_its_selection_against_dense(tmp_path):
    subject = GPTSubject.load(gpt_checkpoint(tmp_path / "gpt.pt", attention="indexer_topk", k_top=4))
    study = fidelity(subject, text=TEXT, length=16, patterns=["indexer", "window:2", "indexer"], progress=False)
    rows = {row["pattern"]: row for row in study.rows}
    assert list(rows) == ["full", "indexer"] and "window:2" in study.skipped
    assert rows["indexer"]["edges_kept"] == pytest.approx((4 * 12 + sum(range(1, 5))) / (16 * 17 / 2))
    assert rows["indexer"]["kl"] > 0 and rows["indexer"]["mass_kept"] < 1


def test_command_writes_csv_json_and_png(tmp_path, cli):
    pytest.importorskip("matplotlib")
    from tgattn.__main__ import main

    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    ckpt = gpt_checkpoint(tmp_path / "gpt.pt")
    status, err = cli(main, ["fidelity", "--checkpoint", str(ckpt), "--text-file", str(text), "--length", "24",
                             "--patterns", "window:3", "sinks:2:3", "--out", str(tmp_path / "out"), "--no-progress"])
    assert status == 0, err
    rows = list(csv.DictReader(open(tmp_path / "out" / "fidelity.csv")))
    assert [row["pattern"] for row in rows] == ["full", "window:3", "sinks:2:3"]
    assert float(rows[0]["kl"]) == 0 and float(rows[2]["mass_kept"]) > float(rows[1]["mass_kept"])
    saved = json.loads((tmp_path / "out" / "fidelity.json").read_text())
    assert saved["command"].startswith("python -m tgattn fidelity --checkpoint") and saved["causal"] is True
    assert len(saved["mass"]["window:3"]) == 2 and (tmp_path / "out" / "fidelity.png").stat().st_size > 10_000
    head = "| pattern | edges kept | perplexity | KL (nats) |"
    assert (tmp_path / "out" / "fidelity.md").read_text().startswith(head)
    assert cli(main, ["fidelity", "--checkpoint", str(ckpt), "--text-file", str(text), "--patterns", "window:3",
                      "--out", str(tmp_path / "default"), "--no-progress"])[0] == 0
    assert json.loads((tmp_path / "default" / "fidelity.json").read_text())["length"] == 32  # its block_size
    status, err = cli(main, ["fidelity", "--checkpoint", str(ckpt), "--text-file", str(text), "--length", "64",
                             "--out", str(tmp_path / "out")])
    assert status == 2 and one_line_error(err, "python -m tgattn fidelity") == \
        "length 64 exceeds the checkpoint's block_size 32"


def test_patterns_parse_or_name_the_fault():
    assert parse_pattern("bigbird:16:2:16").args == (16, 2, 16)
    for text, words in [("wndow:3", "unknown pattern 'wndow'"), ("dilated:3", "takes 2 arguments (w, r)"),
                        ("heads:1.5", "share p in (0, 1]"), ("block:0", ">= 1"), ("window:x", "not a number")]:
        with pytest.raises(ValueError, match=re.escape(words)):
            parse_pattern(text)


@needs_minilm
def test_hf_passages_hold_the_special_tokens(minilm, shakespeare):
    passages = minilm.passages(shakespeare, 20, 2)
    cls, sep = minilm.tokenizer.cls_token_id, minilm.tokenizer.sep_token_id
    assert [p.shape[0] for p in passages] == [20, 20]
    assert all(p[0] == cls and p[-1] == sep for p in passages)
    assert isinstance(minilm, HFSubject) and not minilm.causal


@needs_minilm
def test_a_causal_transformers_folder_reports_perplexity_and_kl_as_its_sdpa_forward(tmp_path, minilm, shakespeare):
    import transformers

    config = transformers.GPT2Config(vocab_size=minilm.tokenizer.vocab_size, n_embd=16, n_layer=2, n_head=2,
                                     n_positions=64, architectures=["GPT2LMHeadModel"])
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path)
    minilm.tokenizer.save_pretrained(tmp_path)  # any tokenizer of the vocabulary's size
    subject = load_subject(hf=str(tmp_path))
    subject.model.double()
    study = fidelity(subject, text=shakespeare, length=24, patterns=["window:4", "topk:3", "heads:0.9"],
                     progress=False)
    rows = {row["pattern"]: row for row in study.rows}
    assert study.causal and list(rows) == ["full", "window:4", "topk:3", "heads:0.9"]
    assert rows["full"]["kl"] == 0 and rows["topk:3"]["edges_kept"] == (3 * 22 + 3) / (24 * 25 / 2)
    ids = subject.passages(shakespeare, 24, 1)[0].view(1, -1)
    keep = builders.to_mask(builders.window(24, 4, causal=True), 24, 24).view(1, 1, 24, 24)
    subject.model.set_attn_implementation("sdpa")
    with torch.no_grad():
        full = subject.model(ids).logits[0]
        sparse = subject.model(ids, attention_mask=keep).logits[0]
    kl = F.kl_div(sparse.log_softmax(-1), full.log_softmax(-1), log_target=True, reduction="batchmean")
    assert rows["window:4"]["kl"] == pytest.approx(float(kl), rel=1e-9)
    assert rows["window:4"]["perplexity"] == pytest.approx(float(F.cross_entropy(sparse[:-1], ids[0, 1:]).exp()),
                                                           rel=1e-9)
