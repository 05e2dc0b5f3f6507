import sys
from dataclasses import asdict

import pytest
import torch

from tgattn import builders
from tgattn.__main__ import main
from tgattn.analysis import top_influencers
from conftest import one_line_error
from tgattn.analysis import show
from tgattn.analysis.show import checkpoint_attention, random_attention
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
    ],
)
def test_bad_options_are_one_line_errors_before_any_work(cli, tmp_path, monkeypatch, argv, message):
    monkeypatch.setattr(show, "random_attention", None)  # the work: never reached
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
    monkeypatch.setattr(show, "random_attention", None)
    status, err = cli(main, ["show", "--out", str(tmp_path / "x.png")])
    assert status == 2 and 'pip install "tgattn[plot]"' in one_line_error(err, "python -m tgattn show")


@pytest.mark.slow
def test_show_draws_spaces_of_a_character_model_visibly(tmp_path, capsys):
    path = tmp_path / "gpt.pt"
    save_gpt_checkpoint(path, vocab=" ab")
    out = tmp_path / "gpt.png"
    assert main(["show", "--text", "a b", "--checkpoint", str(path), "--query", "1", "--out", str(out)]) == 0
    assert "rollout into '\u2423'" in capsys.readouterr().out

