"""``python -m tgattn show --html``: one self-contained page, checked as a browser renders it.

The page is opened in headless Chromium (``--dump-dom``: the document after its script ran) and
its tokens' colours, values and lists are compared with the attention and rollout computed
here, pruned to each token's top keys. Hovering is a real ``mouseover`` event dispatched on a
token in the page. Skipped where no Chromium is installed (``apt-get install chromium``).
"""
import json
import re
import shutil
import subprocess
from html.parser import HTMLParser

import pytest
import torch

from tgattn import builders
from tgattn.__main__ import main
from tgattn.analysis import attention_rollout, influence_data, kept_edges, kept_rollout, layer_matrix, save_influence
from tgattn.analysis.budget import THRESHOLD, TOP_K
from tgattn.analysis.page import attention_page
from tgattn.analysis.random_layers import random_attention

TEXT = "the sky is blue and the sea is deep while every cloud moves over quiet hills"
BROWSER = next((shutil.which(name) for name in ("chromium", "chromium-browser", "google-chrome", "chrome")
                if shutil.which(name)), None)
needs_browser = pytest.mark.skipif(BROWSER is None, reason="no Chromium installed (apt-get install chromium)")


class Tokens(HTMLParser):
    """The token spans of each pane (their attributes) and the items of each top list."""

    def __init__(self):
        super().__init__()
        self.panes, self.lists, self.titles, self._in, self._item, self._span = {}, {}, {}, None, None, None
        self.h1, self._in_h1 = "", False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "div" and attrs.get("class") == "text":
            self._in = attrs["id"]
            self.panes[self._in] = []
        elif tag == "span" and self._in and "tok" in attrs.get("class", ""):
            attrs["text"] = ""
            self.panes[self._in].append(attrs)
            self._span = attrs
        elif tag == "h1":
            self._in_h1 = True
        elif tag == "ol":
            self._item = attrs["id"]
            self.lists[self._item] = []
        elif tag == "li" and self._item:
            self.lists[self._item].append("")
        elif tag == "h2":
            self._item = attrs["id"]
            self.lists[self._item] = [""]

    def handle_endtag(self, tag):
        if tag == "span":
            self._span = None
        elif tag == "h1":
            self._in_h1 = False
        if tag == "div":
            self._in = None
        elif tag in ("ol", "h2"):
            self._item = None

    def handle_data(self, data):
        if self._span is not None:
            self._span["text"] += data
        if self._in_h1:
            self.h1 += data
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
    parsed.raw = run.stdout
    return parsed


def alpha_of(style: str) -> float:
    """The opacity of a token's background (a browser writes opacity 1 as ``rgb(...)``)."""
    match = re.search(r"background-color: rgba?\(31, 119, 180(?:, ([0-9.]+))?\)", style or "")
    return 0.0 if match is None else float(match.group(1) or 1.0)


def kept(weights: torch.Tensor, top_k: int = TOP_K, threshold: float = THRESHOLD) -> dict:
    """The entries of a row the page keeps: its ``top_k`` largest of at least ``threshold``."""
    order = sorted(range(len(weights)), key=lambda j: (-float(weights[j]), j))[:top_k]
    return {j: float(weights[j]) for j in order if weights[j] >= threshold and weights[j] > 0}


def expect_pane(spans, weights: torch.Tensor, query: int):
    """The kept tokens carry their weight and a colour of that weight over the largest (the query's own left
    out); every other token is left blank."""
    shown = kept(weights)
    top = max(w for j, w in shown.items() if j != query)
    assert [int(s["data-i"]) for s in spans] == list(range(len(weights)))
    for j, span in enumerate(spans):
        assert ("selected" in span["class"]) == (j == query)
        if j not in shown:
            assert "data-weight" not in span and alpha_of(span.get("style")) == 0.0
            continue
        assert float(span["data-weight"]) == pytest.approx(shown[j], abs=2e-4)
        expected = 0.0 if j == query else min(shown[j] / top, 1.0)
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


def test_the_data_keeps_each_tokens_top_keys_and_says_what_was_pruned():
    n = 40
    tokens = [f"w{i}" for i in range(n)]
    attention = random_attention(tokens, builders.causal(n), layers=2, heads=2)
    data = influence_data(tokens, attention, top_k=4, threshold=0.02)
    for layer, (edge_index, alpha) in enumerate(attention):
        for head in ("mean", 0, 1):
            exact = layer_matrix(edge_index, alpha, n, head=head, residual=False).to_dense()  # [N, N]
            (keys, queries), weight = kept_edges(data, layer, head)
            got = {(int(i), int(j)): float(w) for j, i, w in zip(keys, queries, weight)}
            expected = {(i, j): w for i in range(n) for j, w in kept(exact[i], 4, 0.02).items()}
            assert got.keys() == expected.keys()
            for pair, w in got.items():  # quantised to 16 bits of the row's largest kept weight
                assert abs(w - expected[pair]) <= 8e-6 * float(exact[pair[0]].max())
            lost = data["pruned"][layer][0 if head == "mean" else head + 1]
            assert lost["edges"] == edge_index.shape[1] - len(got)
            assert lost["total"] == pytest.approx(float(exact.sum()), abs=1e-9)
            assert lost["weight"] == pytest.approx(float(exact.sum()) - sum(expected.values()), abs=1e-9)
    rollout = attention_rollout(attention).to_dense()
    (keys, rows), share = kept_rollout(data)
    assert {(int(i), int(j)) for j, i in zip(keys, rows)} == {(i, j) for i in range(n) for j in kept(rollout[i], 4, 0.02)}
    assert data["rollout_pruned"]["weight"] == pytest.approx(n - sum(sum(kept(rollout[i], 4, 0.02).values())
                                                                     for i in range(n)), abs=1e-9)


HOSTILE = ["<!--<script>", "</script>", "<script>document.body.innerHTML=''</script>", "<!--", "-->", "]]>",
           "&amp;", "\u2028x\u2029", '"\'`', "</title>", "<\\/script>", "\\u003c", "<b>bold</b>"]


@needs_browser
@pytest.mark.slow
@pytest.mark.parametrize("hostile", ["<!--<script>", "<script>", "</script>", "all"])
def test_no_text_changes_how_the_page_parses(tmp_path, hostile):
    # one string alone (a later "-->" would close what "<!--" opened and hide the fault), then all of them
    tokens = ["the", "sky", *(HOSTILE if hostile == "all" else [hostile]), "is", "blue"]
    title = " ".join(HOSTILE) if hostile == "all" else hostile
    html = attention_page(tokens, random_attention(tokens, builders.causal(len(tokens))), title=title)
    dom = render(html, tmp_path, hover=3)
    assert dom.h1 == title
    for pane in ("attends", "influenced"):
        assert [span["text"] for span in dom.panes[pane]] == tokens
    assert [s["data-i"] for s in dom.panes["attends"] if "selected" in s["class"]] == ["3"]


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
    assert len(dom.lists["attends-top"]) == min(8, len(kept(last)))
    # the grid: a picture per layer and view (mean, head 0, head 1), its x axis over every kept key of the token
    assert dom.raw.count("<canvas") == 2 * 3
    keys = {j for l, (ei, alpha) in enumerate(attention) for head in ("mean", 0, 1)
            for j in kept(layer_matrix(ei, alpha, n, head=head, residual=False).to_dense()[hovered])} | {hovered}
    assert re.search(r'id="grid-span">([^<]*)<', dom.raw).group(1) == f"x axis: tokens {min(keys)}-{max(keys)} of {n}"


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


@pytest.mark.parametrize("n, window, layers, heads, top_k", [(300, 8, 2, 2, 10), (2000, 64, 4, 4, 10), (700, 40, 3, 1, 25)])
def test_the_size_estimate_bounds_the_page(n, window, layers, heads, top_k):
    from tgattn.analysis.budget import estimate_bytes

    tokens = [f"w{i % 97}" for i in range(n)]
    attention = random_attention(tokens, builders.window(n, window), layers=layers, heads=heads)
    size = len(attention_page(tokens, attention, top_k=top_k).encode("utf-8"))
    assert 0.5 * estimate_bytes(n, layers, heads, top_k) <= size <= estimate_bytes(n, layers, heads, top_k)
    with pytest.raises(ValueError, match=r"the page would take [0-9.]+ MB, more than the budget of [0-9.]+ MB: keep fewer keys per token \(--keep"):
        attention_page(tokens, attention, top_k=top_k, max_bytes=size - 1)


@needs_browser
@pytest.mark.slow
def test_a_page_of_3000_tokens_in_4_layers_of_4_heads_opens_and_answers_a_hover(tmp_path):
    n, hovered = 3000, 1700
    tokens = [TEXT.split()[i % 15] for i in range(n)]
    attention = random_attention(tokens, builders.window(n, 32), layers=4, heads=4)
    dom = render(attention_page(tokens, attention), tmp_path, hover=hovered, hash="#layer=3&head=2")
    exact = layer_matrix(*attention[2], n, head=2, residual=False).to_dense()[hovered]
    expect_pane(dom.panes["attends"], exact, hovered)
    assert dom.lists["attends-title"] == [f"'{tokens[hovered]}' (#{hovered}) attends to, in layer 3 (head 2)"]


def nan_attention():
    """The page's 16 tokens over 2 causal layers, with one NaN weight: layer 2, head 0, key 3 -> query 6."""
    tokens = TEXT.split()
    attention = random_attention(tokens, builders.causal(len(tokens)), layers=2, heads=2)
    edge = int(((attention[1][0][0] == 3) & (attention[1][0][1] == 6)).nonzero())
    attention[1][1][edge, 0] = float("nan")
    return tokens, attention


def strict_json(text: str):
    """JSON as a browser's ``JSON.parse`` reads it: no ``NaN`` / ``Infinity`` literals."""
    def refuse(literal):
        raise ValueError(f"{literal} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_a_nan_weight_is_written_as_null_and_a_flag(tmp_path):
    # issue 57: a bare NaN in the data block, which JSON.parse refuses (0 tokens shown)
    tokens, attention = nan_attention()
    data = influence_data(tokens, attention)
    save_influence(data, tmp_path / "nan.json")
    back = strict_json((tmp_path / "nan.json").read_text(encoding="utf-8"))
    kept_head_0 = len(kept_edges(back, 1, 0)[1])
    assert back["pruned"][1][1] == {"edges": 136 - kept_head_0, "weight": None, "total": None, "nonfinite": 1}  # 16 tokens
    assert back["pruned"][1][0]["nonfinite"] == 1 and back["pruned"][1][2].get("nonfinite") is None  # mean: NaN; head 1 not
    assert back["rollout_pruned"]["nonfinite"] == 7  # token 6 reads inputs 0-6 through the NaN row, nothing else does
    assert len(back["flow"]["value"]) == 10  # into token 15: layer 2's row 6 is on no path
    skipped = influence_data(tokens, attention, query=6)["flow"]["skipped"]
    assert re.fullmatch(r"layer 1: the weight of key \d+ -> query 6 is not finite \(nan\) on a path into token 6: .*", skipped)
    (keys, queries), weight = kept_edges(back, 1, 0)
    nan = weight.isnan()
    assert keys[nan].tolist() == [3] and queries[nan].tolist() == [6]
    (keys, rows), share = kept_rollout(back)
    assert set(rows[share.isnan()].tolist()) == {6} and share[rows != 6].isfinite().all()
    page = attention_page(tokens, attention)
    strict_json(re.search(r'type="application/json">(.*?)</script>', page, re.S).group(1))


@needs_browser
@pytest.mark.slow
@pytest.mark.parametrize("case", ["one NaN weight", "a NaN layer"])
def test_a_page_with_nan_weights_shows_its_tokens_and_says_so(tmp_path, case):
    tokens, attention = nan_attention()
    if case == "a NaN layer":
        attention[0] = (attention[0][0], torch.full_like(attention[0][1], float("nan")))
    dom = render(attention_page(tokens, attention), tmp_path, hover=6, hash="#layer=2&head=0")
    for pane in ("attends", "influenced"):
        assert [span["text"] for span in dom.panes[pane]] == tokens
    warning = re.search(r'id="nonfinite">([^<]*)<', dom.raw).group(1)
    assert "not finite (NaN / inf)" in warning
    if case == "one NaN weight":
        assert "layer 2 mean: 1, layer 2 head 0: 1, rollout: 7." in warning
        spans = {int(s["data-i"]): s for s in dom.panes["attends"]}
        assert spans[3]["data-weight"] == "NaN" and "nonfinite" in spans[3]["class"]
        assert all("nonfinite" not in s["class"] for j, s in spans.items() if j != 3)
        assert dom.lists["attends-top"][0] == f"{tokens[3]} (#3) NaN"  # the unknown weight listed first
    else:  # every weight of layer 1, in every view: 136 causal edges, and every rollout entry (136)
        assert "layer 1 mean: 136, layer 1 head 0: 136, layer 1 head 1: 136, layer 2 mean: 1, layer 2 head 0: 1, " \
               "rollout: 136." in warning
    assert all("NaN" in item or "Infinity" in item for item in dom.lists["influenced-top"])  # token 6's rollout row
