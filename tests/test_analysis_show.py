import sys
from dataclasses import asdict

import pytest
import torch

from tgattn import builders
from tgattn.__main__ import main
from tgattn.analysis import top_influencers
from conftest import one_line_error
from tgattn.analysis import figure, plots, random_layers
from tgattn.analysis.random_layers import random_attention
from tgattn.analysis.show import checkpoint_attention
from tgattn.lm import save_checkpoint
from tgattn.models import GPT, GPTConfig

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_show_with_random_projections(tmp_path, capsys):
    out = tmp_path / "attn.png"
    assert main(["show", "--text", "The sky is blue", "--pattern", "window", "--window", "1", "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG
    tokens = "The sky is blue".split()
    attention = random_attention(tokens, builders.window(4, 1))
    flow = top_influencers(3, 5, attention, method="flow")
    expected = ", ".join(f"{tokens[j]!r} {s:.3f}" for j, s in zip(flow.index.tolist(), flow.score.tolist()))
    assert f"flow into 'blue': {expected}\n" in capsys.readouterr().out


def save_gpt_checkpoint(path, vocab="abc"):
    torch.manual_seed(3)
    config = GPTConfig(block_size=8, vocab_size=len(vocab), n_layer=2, n_head=2, n_embd=8)
    model = GPT(config).eval()
    save_checkpoint(path, {"model": model.state_dict(), "config": asdict(config), "vocab": vocab})
    return model


def test_checkpoint_attention_is_the_models_own(tmp_path):
    path = tmp_path / "gpt.pt"
    model = save_gpt_checkpoint(path)
    tokens, attention = checkpoint_attention(str(path), "abca")
    with torch.no_grad():
        expected = model(torch.tensor([[0, 1, 2, 0]]), return_attention=True)[-1]
    assert tokens == ["a", "b", "c", "a"] and len(attention) == 2
    for (ei, alpha), (ei_ref, alpha_ref) in zip(attention, expected):
        assert torch.equal(ei, ei_ref)
        torch.testing.assert_close(alpha, alpha_ref, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match=r"characters \['z'\]"):
        checkpoint_attention(str(path), "abz")


@pytest.mark.slow
def test_show_with_checkpoint(tmp_path, capsys):
    path = tmp_path / "gpt.pt"
    save_gpt_checkpoint(path)
    out = tmp_path / "gpt.png"
    assert main(["show", "--text", "abca", "--checkpoint", str(path), "--query", "2", "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG and "rollout into 'c'" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--text", "a b", "--query", "2"], "--query must be a token index in [0, 2) (got 2)"),
        (["--text", ""], "--text is empty"),
        (["--text", "  "], "--text is empty"),
        (["--out", "/missing/dir/x.png"], "--out: the folder '/missing/dir' does not exist"),
        (["--heads", "3"], "--heads must divide the random layers' width 32 (got 3)"),
        (["--heads", "0"], "argument --heads: must be an integer >= 1 (got '0')"),
        (["--layers", "-1"], "argument --layers: must be an integer >= 1 (got '-1')"),
        (["--window", "-2"], "argument --window: must be an integer >= 0 (got '-2')"),
        (["--top-k", "0"], "argument --top-k: must be an integer >= 1 (got '0')"),
        (["--pattern", "spiral"], "argument --pattern: invalid choice: 'spiral'"),
        (["--checkpoint", "/missing/gpt.pt"], "no checkpoint at /missing/gpt.pt"),
        (["--keep", "0"], "argument --keep: must be an integer >= 1 (got '0')"),
        (["--threshold", "1"], "argument --threshold: must be a number in [0, 1) (got '1')"),
        (["--max-page-mb", "nan"], "argument --max-page-mb: must be a number > 0 (got 'nan')"),
        (["--from", "/missing/data.json", "--html", "/tmp/x.html"], "--from: no file at /missing/data.json"),
        (["--from", __file__], "--from makes a page: give --html PAGE"),
        (["--json", "/missing/dir/x.json"], "--json: the folder '/missing/dir' does not exist"),
        (["--text", "a " * 10_000, "--layers", "4", "--heads", "4", "--keep", "100", "--html", "/tmp/x.html"],
         "the page would take about 121 MB (10000 tokens, 4 layers x 4 heads, --keep 100), more than --max-page-mb 64"),
    ],
)
def test_bad_options_are_one_line_errors_before_any_work(cli, tmp_path, monkeypatch, argv, message):
    monkeypatch.setattr(random_layers, "random_attention", None)  # the work: never reached
    monkeypatch.setattr(random_layers, "random_attention_blocks", None)
    out = [] if "--out" in argv else ["--out", str(tmp_path / "x.png")]
    status, err = cli(main, ["show", *argv, *out])
    assert status == 2 and one_line_error(err, "python -m tgattn show").startswith(message)


def test_a_damaged_checkpoint_is_a_one_line_error(cli, tmp_path):
    path = tmp_path / "gpt.pt"
    save_gpt_checkpoint(path)
    path.write_bytes(path.read_bytes()[:-100])
    status, err = cli(main, ["show", "--text", "abc", "--checkpoint", str(path), "--out", str(tmp_path / "x.png")])
    assert status == 2 and "is truncated or corrupted" in one_line_error(err, "python -m tgattn show")


def test_a_checkpoint_whose_config_does_not_fit_its_weights_is_a_one_line_error(cli, tmp_path):
    path = tmp_path / "gpt.pt"
    model = save_gpt_checkpoint(path)
    config = asdict(model.config) | {"n_embd": 16}
    save_checkpoint(path, {"model": model.state_dict(), "config": config, "vocab": "abc"})
    status, err = cli(main, ["show", "--text", "abc", "--checkpoint", str(path), "--out", str(tmp_path / "x.png")])
    assert status == 2 and "weights that do not match its config" in one_line_error(err, "python -m tgattn show")


def test_without_matplotlib_show_names_the_extra_up_front(cli, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    monkeypatch.setattr(random_layers, "random_attention", None)
    status, err = cli(main, ["show", "--out", str(tmp_path / "x.png")])
    assert status == 2 and 'pip install "tgattn[plot]"' in one_line_error(err, "python -m tgattn show")


@pytest.mark.slow
def test_show_draws_spaces_of_a_character_model_visibly(tmp_path, capsys):
    path = tmp_path / "gpt.pt"
    save_gpt_checkpoint(path, vocab=" ab")
    out = tmp_path / "gpt.png"
    assert main(["show", "--text", "a b", "--checkpoint", str(path), "--query", "1", "--out", str(out)]) == 0
    assert "rollout into '\u2423'" in capsys.readouterr().out



WORDS = "the sky is blue and the sea is deep while every cloud moves slowly over quiet hills where birds sing".split()


def _drawn_texts(fig):
    """Every piece of text the figure draws (non-empty, visible), with its box in pixels."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.text import Text

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    texts = [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]
    return [(t.get_text(), t.get_window_extent(renderer)) for t in texts], fig.bbox


def _overlapping(boxes):
    return [(a, b) for n, (a, box_a) in enumerate(boxes) for b, box_b in boxes[n + 1:]
            if min(box_a.x1, box_b.x1) - max(box_a.x0, box_b.x0) > 1 and min(box_a.y1, box_b.y1) - max(box_a.y0, box_b.y0) > 1]


@pytest.mark.parametrize("n", [4, 13, 60, 200])
def test_the_picture_reads_at_any_length_labels_never_overlap_and_titles_fit(n):
    pytest.importorskip("matplotlib")
    tokens = [WORDS[(7 * i) % len(WORDS)] + ("-internationalization" if i == n - 1 else "") for i in range(n)]
    attention = random_attention(tokens, builders.window(n, 8, causal=True))  # flow on causal(200) takes 30 s
    query = n - 1
    ranked = figure.rank(attention, query, 5, n)
    title = f"{' '.join(tokens)!r} ({n} tokens): causal pattern, 2 random layers x 2 heads, seed 0"
    fig = figure.show_figure(tokens, attention, ranked, query=query, title=figure.fit(title, figure.TITLE_CHARS))
    boxes, frame = _drawn_texts(fig)
    assert not _overlapping(boxes)
    outside = [text for text, box in boxes if box.x0 < frame.x0 or box.x1 > frame.x1 or box.y0 < frame.y0 or box.y1 > frame.y1]
    assert not outside
    # the graph panel draws the query's neighbourhood only: the query, its top keys and influencers
    (graph,) = [ax for ax in fig.axes if " around " in ax.get_title()]
    drawn = sorted(int(label.get_text().rsplit("#", 1)[1]) for label in graph.texts)
    assert drawn == figure.neighbourhood(attention, ranked, query, n) and len(drawn) <= 1 + 2 + 5 + 5
    assert query in drawn and set(ranked["rollout"].index.tolist()) <= set(drawn)
    # every token of the heatmap's labels is a real one, at its index
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels() if t.get_text()]
    if n <= 13:  # room for every token: each is labelled
        assert labels == [plots.short(token) for token in tokens]
    else:  # every k-th token, with its index
        assert len(labels) >= 3
        for label in labels:
            index, token = label.split(" ", 1)
            assert token == plots.short(tokens[int(index)])


def test_a_checkpoints_title_names_the_file_not_its_folder(tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    path = tmp_path / "deep" / "temporary" / "gpt.pt"
    path.parent.mkdir(parents=True)
    save_gpt_checkpoint(path)
    titles = []
    draw = figure.show_figure
    monkeypatch.setattr(figure, "show_figure", lambda *a, **k: titles.append(k["title"]) or draw(*a, **k))
    assert main(["show", "--text", "abca", "--checkpoint", str(path), "--out", str(tmp_path / "x.png")]) == 0
    assert titles == ["'abca' (4 tokens): tiny GPT gpt.pt, 2 layers x 2 heads"]


def test_json_then_from_makes_the_same_page_and_the_budget_is_kept(tmp_path, capsys, cli):
    text = " ".join(WORDS * 3)
    direct, data, again = tmp_path / "direct.html", tmp_path / "data.json", tmp_path / "again.html"
    assert main(["show", "--text", text, "--html", str(direct), "--json", str(data), "--keep", "3"]) == 0
    assert main(["show", "--from", str(data), "--html", str(again)]) == 0
    assert again.read_bytes() == direct.read_bytes()
    assert f"wrote {again} from {data}" in capsys.readouterr().out
    budget = f"{(data.stat().st_size + 1) / 1e6:.6f}"  # the file fits, the page around it does not
    status, err = cli(main, ["show", "--from", str(data), "--html", str(tmp_path / "big.html"), "--max-page-mb", budget])
    assert status == 2 and "the page would take 0." in one_line_error(err, "python -m tgattn show")
    assert not (tmp_path / "big.html").exists()
    data.write_text('{"format": "something else"}')
    status, err = cli(main, ["show", "--from", str(data), "--html", str(again)])
    assert status == 2 and "is not a tgattn influence file" in one_line_error(err, "python -m tgattn show")


@pytest.mark.parametrize("argv", [["--help"], ["--heads", "3"], ["--keep", "-1"], ["--text", ""]])
def test_help_and_bad_arguments_answer_without_torch(argv):
    import subprocess

    probe = ("import sys, runpy; sys.argv = ['show', *sys.argv[1:]]\n"
             "try: runpy.run_module('tgattn.analysis.show', run_name='__main__')\n"
             "except SystemExit as end: print('torch' in sys.modules, 'torch_geometric' in sys.modules, end.code)")
    run = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, timeout=60)
    assert run.stdout.strip().endswith("False False 0" if argv == ["--help"] else "False False 2"), run.stderr


def test_a_checkpoints_page_data_keeps_the_models_own_top_keys(tmp_path, capsys):
    from tgattn.analysis import kept_edges, layer_matrix, load_influence

    path = tmp_path / "gpt.pt"
    save_gpt_checkpoint(path, vocab="abc ")
    text = "abc cab "  # the block size of the saved model: 8
    data_file = tmp_path / "gpt.json"
    assert main(["show", "--text", text, "--checkpoint", str(path), "--json", str(data_file), "--keep", "3"]) == 0
    data = load_influence(data_file)
    _, attention = checkpoint_attention(str(path), text)
    n = len(text)
    assert data["tokens"] == [c.replace(" ", "\u2423") for c in text] and data["heads"] == [2, 2]
    for layer, (edge_index, alpha) in enumerate(attention):
        exact = layer_matrix(edge_index, alpha, n, head=1, residual=False).to_dense()
        (keys, queries), weight = kept_edges(data, layer, 1)
        for i in range(n):
            mine = queries == i
            top = exact[i].topk(min(3, i + 1)).values
            top = top[top >= 1e-3]
            assert torch.allclose(weight[mine].sort(descending=True).values, top, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_show_html_of_a_transformers_model(tmp_path, capsys):
    pytest.importorskip("transformers")
    out = tmp_path / "hf.html"
    assert main(["show", "--hf", "random", "--text", "the sky is the limit of it", "--html", str(out)]) == 0
    page = out.read_text(encoding="utf-8")
    assert "tiny random Llama" in page and '"format":"tgattn.influence"' in page


def test_a_checkpoint_with_a_nan_weight_gives_a_page_that_says_so(tmp_path, cli):
    # issue 57: rc 0 and a page whose data held a bare NaN (JSON.parse refused it: 0 tokens shown)
    import json
    import re

    path, page = tmp_path / "gpt.pt", tmp_path / "nan.html"
    model = save_gpt_checkpoint(path)
    weights = model.state_dict()
    weights["transformer.wpe.weight"][0, 0] = float("nan")  # position 0: every query reads it in layer 1
    save_checkpoint(path, {"model": weights, "config": asdict(model.config), "vocab": "abc"})
    status, err = cli(main, ["show", "--text", "abcabc", "--checkpoint", str(path), "--html", str(page)])
    if status != 0:  # refusing the checkpoint is the other answer the issue allows: one line naming the NaN
        assert "nan" in one_line_error(err, "python -m tgattn show").lower()
        return
    block = re.search(r'type="application/json">(.*?)</script>', page.read_text(encoding="utf-8"), re.S).group(1)
    data = json.loads(block, parse_constant=lambda literal: pytest.fail(f"bare {literal} in the page's data"))
    assert data["pruned"][0][0] == {"edges": 0, "weight": None, "total": None, "nonfinite": 21}  # causal(6): 21 edges
    assert "is not finite (nan)" in data["flow"]["skipped"]
