"""``python -m tgattn show --html``: one self-contained page, checked as a browser renders it.

The page is opened in headless Chromium (``--dump-dom``: the document after its script ran) and
its tokens' colours, values and lists are compared with the attention and rollout computed
here. Hovering is a real ``mouseover`` event dispatched on a token in the page. Skipped where
no Chromium is installed (``apt-get install chromium``).
"""
import re
import shutil
import subprocess
from html.parser import HTMLParser

import pytest
import torch

from tgattn import builders
from tgattn.__main__ import main
from tgattn.analysis import attention_rollout, layer_matrix
from tgattn.analysis.page import attention_page
from tgattn.analysis.show import random_attention

TEXT = "the sky is blue and the sea is deep while every cloud moves over quiet hills"
BROWSER = next((shutil.which(name) for name in ("chromium", "chromium-browser", "google-chrome", "chrome")
                if shutil.which(name)), None)
needs_browser = pytest.mark.skipif(BROWSER is None, reason="no Chromium installed (apt-get install chromium)")


class Tokens(HTMLParser):
    """The token spans of each pane (their attributes) and the items of each top list."""

    def __init__(self):
        super().__init__()
        self.panes, self.lists, self.titles, self._in, self._item = {}, {}, {}, None, None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "div" and attrs.get("class") == "text":
            self._in = attrs["id"]
            self.panes[self._in] = []
        elif tag == "span" and self._in and "tok" in attrs.get("class", ""):
            self.panes[self._in].append(attrs)
        elif tag == "ol":
            self._item = attrs["id"]
            self.lists[self._item] = []
        elif tag == "li" and self._item:
            self.lists[self._item].append("")
        elif tag == "h2":
            self._item = attrs["id"]
            self.lists[self._item] = [""]

    def handle_endtag(self, tag):
        if tag == "div":
            self._in = None
        elif tag in ("ol", "h2"):
            self._item = None

    def handle_data(self, data):
        if self._item and self.lists[self._item]:
            self.lists[self._item][-1] += data


def render(page: str, tmp_path, *, hash: str = "", hover=None) -> Tokens:
    """The page's document after Chromium ran its script (and a hover over token ``hover``)."""
    if hover is not None:  # a mouseover event on the token's span in the left pane, as a pointer would send
        page = page.replace("</body>", f'<script>document.querySelector(\'#attends .tok[data-i="{hover}"]\')'
                                       ".dispatchEvent(new MouseEvent('mouseover', {bubbles: true}));</script></body>")
    path = tmp_path / "page.html"
    path.write_text(page, encoding="utf-8")
    run = subprocess.run([BROWSER, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path / 'profile'}",
                          "--dump-dom", f"{path.as_uri()}{hash}"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "<body>" in run.stdout, run.stderr
    parsed = Tokens()
    parsed.feed(run.stdout)
    return parsed


def alpha_of(style: str) -> float:
    """The opacity of a token's background (a browser writes opacity 1 as ``rgb(...)``)."""
    match = re.search(r"background-color: rgba?\(31, 119, 180(?:, ([0-9.]+))?\)", style or "")
    return 0.0 if match is None else float(match.group(1) or 1.0)


def expect_pane(spans, weights: torch.Tensor, query: int):
    """Each token's value is its weight, its colour that weight over the largest (the query's own left out)."""
    top = max(float(w) for j, w in enumerate(weights) if j != query)
    assert [int(s["data-i"]) for s in spans] == list(range(len(weights)))
    for j, span in enumerate(spans):
        assert float(span["data-weight"]) == pytest.approx(float(weights[j]), abs=2e-4)
        assert ("selected" in span["class"]) == (j == query)
        expected = 0.0 if j == query else min(float(weights[j]) / top, 1.0)
        assert alpha_of(span.get("style")) == pytest.approx(expected, abs=1 / 255 + 1e-3)  # the browser keeps 8 bits


@pytest.fixture
def page():
    tokens = TEXT.split()
    attention = random_attention(tokens, builders.window(len(tokens), 3), layers=2, heads=2)
    return tokens, attention, attention_page(tokens, attention, title="a test")


def test_the_page_is_self_contained(page):
    html = page[2]
    assert not re.search(r"\b(src|href)\s*=|url\(|@import|https?://", html)  # loads nothing
    assert html.count("<script") == 2 and "<title>a test</title>" in html


@needs_browser
@pytest.mark.slow
def test_hovering_a_token_shows_what_it_attends_to_and_what_influences_it(page, tmp_path):
    tokens, attention, html = page
    n, hovered = len(tokens), 6
    dom = render(html, tmp_path, hover=hovered)
    last = layer_matrix(*attention[-1], n, residual=False).to_dense()[hovered]  # [N]: mean over heads
    expect_pane(dom.panes["attends"], last, hovered)
    rollout = attention_rollout(attention, num_nodes=n).to_dense()[hovered]
    expect_pane(dom.panes["influenced"], rollout, hovered)
    assert dom.lists["attends-title"] == [f"'{tokens[hovered]}' (#{hovered}) attends to, in layer 2 (mean over heads)"]
    strongest = int(rollout.argmax())
    assert dom.lists["influenced-top"][0] == f"{tokens[strongest]} (#{strongest}) {float(rollout[strongest]):.3f}"
    assert len(dom.lists["attends-top"]) == min(8, int((last > 0).sum()))


@needs_browser
@pytest.mark.slow
def test_the_address_opens_a_token_layer_and_head(page, tmp_path):
    tokens, attention, html = page
    dom = render(html, tmp_path, hash="#token=3&layer=1&head=1")
    first_head_1 = layer_matrix(*attention[0], len(tokens), head=1, residual=False).to_dense()[3]
    expect_pane(dom.panes["attends"], first_head_1, 3)
    assert dom.lists["attends-title"] == [f"'{tokens[3]}' (#3) attends to, in layer 1 (head 1)"]


@needs_browser
@pytest.mark.slow
def test_show_html_writes_a_page_of_200_tokens_that_renders(tmp_path, capsys):
    words = (TEXT.split() * 20)[:200]
    out = tmp_path / "attn.html"
    assert main(["show", "--text", " ".join(words), "--html", str(out), "--out", str(tmp_path / "none.png")]) == 0
    assert capsys.readouterr().out == f"wrote {out} (open it in a browser)\n" and not (tmp_path / "none.png").exists()
    dom = render(out.read_text(encoding="utf-8"), tmp_path)
    assert [len(dom.panes[p]) for p in ("attends", "influenced")] == [200, 200]
    assert [s["data-i"] for s in dom.panes["attends"] if "selected" in s["class"]] == ["199"]
