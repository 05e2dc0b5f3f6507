"""The influence page's attention-flow line follows the selected token.

The data holds the top flow into every token when their cones are small enough together
(``data["flows"]``, checked against :func:`tgattn.analysis.attention_flow` sorted by hand); the
page, opened in headless Chromium, names the hovered token and lists its flows, or says that
the page holds the flow into its query alone and which command computes the hovered token's.
"""
import re

import pytest

from test_analysis_page import needs_browser, render
from tgattn import builders
from tgattn.analysis import attention_flow, influence_data
from tgattn.analysis import export
from tgattn.analysis.page import attention_page, page_from_data
from tgattn.analysis.random_layers import random_attention

TOKENS = "the sky is blue and the sea is deep while clouds move".split()


@pytest.fixture
def attention():
    return random_attention(TOKENS, builders.causal(len(TOKENS)), layers=3, heads=2)  # 3 layers: max-flow, not closed form


def expected_flow(attention, token, k):
    flow = attention_flow(attention, token, num_nodes=len(TOKENS))  # [N]
    order = sorted((j for j in range(len(TOKENS)) if flow[j] > 0), key=lambda j: (-float(flow[j]), j))[:k]
    return order, [float(flow[j]) for j in order]


def test_the_data_holds_the_flow_into_every_token(attention):
    data = influence_data(TOKENS, attention, query=5, top_k=4)
    assert len(data["flows"]) == len(TOKENS)
    for token, got in enumerate(data["flows"]):
        index, value = expected_flow(attention, token, 4)
        assert got["index"] == index
        assert got["value"] == pytest.approx(value, abs=1e-10)
    assert data["flow"] == {"token": 5, **data["flows"][5]}


def test_over_the_budget_only_the_query_has_its_flow(attention, monkeypatch):
    whole = influence_data(TOKENS, attention, query=5, top_k=4)
    monkeypatch.setattr(export, "FLOW_EDGES", 200)  # more than the query's cone, less than all cones together
    data = influence_data(TOKENS, attention, query=5, top_k=4)
    assert "flows" not in data and data["flow"] == whole["flow"]


def flow_line(dom) -> str:
    return re.search(r'<p class="note" id="flow">([^<]*)</p>', dom.raw).group(1).replace("&amp;", "&")


@needs_browser
@pytest.mark.slow
def test_the_flow_line_follows_the_hovered_token(attention, tmp_path):
    page = attention_page(TOKENS, attention, query=11, top_k=4)
    index, value = expected_flow(attention, 7, 4)
    listed = ", ".join(f"{TOKENS[j]} (#{j}) {v:.3f}" for j, v in zip(index, value))
    assert flow_line(render(page, tmp_path, hover=7)) == (
        f"Top attention flow into '{TOKENS[7]}' (#7) through all layers (max-flow): {listed}")


@needs_browser
@pytest.mark.slow
def test_a_page_with_the_query_flow_alone_says_so_for_another_token(attention, tmp_path, monkeypatch):
    monkeypatch.setattr(export, "FLOW_EDGES", 200)
    page = page_from_data(influence_data(TOKENS, attention, query=11, top_k=4))
    assert flow_line(render(page, tmp_path, hover=7)) == (
        f"Attention flow into '{TOKENS[7]}' (#7): not in this page, which holds the flow into '{TOKENS[11]}' (#11) "
        "alone (the flow into every token was over its budget); python -m tgattn show --query 7 computes it.")
    assert flow_line(render(page, tmp_path, hover=11)).startswith(f"Top attention flow into '{TOKENS[11]}' (#11)")


def test_a_file_with_every_tokens_flow_reads_back_and_a_wrong_one_is_refused(attention, tmp_path):
    from tgattn.analysis.influence_file import check_influence

    data = influence_data(TOKENS, attention, query=5, top_k=4)
    export.save_influence(data, tmp_path / "data.json")
    assert export.load_influence(tmp_path / "data.json")["flows"] == data["flows"]
    with pytest.raises(ValueError, match=r"^flows: must hold one flow per token \(12; got 11\)$"):
        check_influence({**data, "flows": data["flows"][:-1]})
    bad = [dict(flow) for flow in data["flows"]]
    bad[3]["index"] = [99] + bad[3]["index"][1:]
    with pytest.raises(ValueError, match=r"^flows\[3\]\.index\[0\]: must be a token index in \[0, 12\) \(got 99\)$"):
        check_influence({**data, "flows": bad})
