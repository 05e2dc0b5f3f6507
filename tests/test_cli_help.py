"""``python -m tgattn --help`` and its commands' help: plain words, a description for each."""
import pytest

from tgattn.__main__ import main


def _help(capsys, argv):
    with pytest.raises(SystemExit) as exit:
        main([*argv, "--help"])
    assert exit.value.code == 0
    return capsys.readouterr().out


def test_the_top_help_is_plain_text(capsys):
    text = _help(capsys, [])
    assert "``" not in text and ":func:" not in text
    assert "check that graph attention equals dense attention on this machine" in " ".join(text.split())


@pytest.mark.parametrize("command, words", [
    ("verify", "Check, on this machine, that graph attention equals dense attention"),
    ("show", "Draw which tokens influence a token"),
    ("build", "Compile tgattn's fused C++ kernel now"),
    ("fidelity", "Run a trained model on passages of a text with its own attention and with each sparse pattern"),
])
def test_each_command_describes_itself(capsys, command, words):
    text = _help(capsys, [command])
    description = " ".join(text.split("\n\n")[1].split())  # the paragraph after the usage lines
    assert description.startswith(words) and "``" not in text
