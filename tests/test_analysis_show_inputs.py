"""``python -m tgattn show``: the text from a file, and the one-line answers of ``--hf`` when it cannot run."""
import json

import pytest

from conftest import one_line_error
from tgattn.__main__ import main

PROG = "python -m tgattn show"


def test_text_file_gives_what_text_gives(tmp_path):
    text = "the sky is blue\nand the sea is deep"
    (tmp_path / "text.txt").write_text(text, encoding="utf-8")
    common = ["show", "--pattern", "window", "--keep", "3"]
    assert main([*common, "--text", text, "--json", str(tmp_path / "a.json")]) == 0
    assert main([*common, "--text-file", str(tmp_path / "text.txt"), "--json", str(tmp_path / "b.json")]) == 0
    a, b = (json.loads((tmp_path / name).read_text(encoding="utf-8")) for name in ("a.json", "b.json"))
    assert a == b and a["tokens"] == text.split()


def test_text_file_keeps_a_character_models_newlines(tmp_path):
    from tgattn.analysis.show import read_text_file

    (tmp_path / "t.txt").write_bytes("ab\ncd\n".encode("utf-8"))
    assert read_text_file(str(tmp_path / "t.txt")) == "ab\ncd\n"


@pytest.mark.parametrize("argv, message", [
    (["--text-file", "{tmp}/none.txt"], "--text-file: no file at {tmp}/none.txt"),
    (["--text-file", "{tmp}/latin1.txt"], "--text-file: {tmp}/latin1.txt is not UTF-8 text (unexpected end of data at byte 3)"),
    (["--hf", "{tmp}/no-model"], "no model folder at {tmp}/no-model"),
    (["--hf", "no-such-owner-4d1c/no-such-model"],
     "no model folder at no-such-owner-4d1c/no-such-model (nor a model of that name in the Hugging Face cache)"),
])
def test_one_line_errors(cli, tmp_path, argv, message):
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    status, err = cli(main, ["show", *argv, "--html", str(tmp_path / "x.html")])
    assert status == 2 and one_line_error(err, PROG) == message.replace("{tmp}", str(tmp_path))
    assert not (tmp_path / "x.html").exists()


def test_text_and_text_file_exclude_each_other(cli, tmp_path):
    status, err = cli(main, ["show", "--text", "a b", "--text-file", str(tmp_path / "t.txt")])
    assert status == 2 and "argument --text-file: not allowed with argument --text" in err


def test_hf_without_transformers_names_the_extra(cli, monkeypatch, tmp_path):
    monkeypatch.setitem(__import__("sys").modules, "transformers", None)  # what find_spec sees when it is not installed
    status, err = cli(main, ["show", "--hf", "random", "--html", str(tmp_path / "x.html")])
    assert status == 2 and one_line_error(err, PROG) == (
        '--hf runs a transformers model, and transformers is not installed: pip install "tgattn[hf]"')


def test_the_extras_model_without_the_extra_names_it(cli, monkeypatch, tmp_path):
    pytest.importorskip("transformers")
    from tgattn.hf import pretrained

    monkeypatch.setattr(pretrained, "PACKAGE", "no_such_package_4d1c")  # what an environment without the wheel finds
    status, err = cli(main, ["show", "--hf", "all-MiniLM-L6-v2", "--html", str(tmp_path / "x.html")])
    assert status == 2 and one_line_error(err, PROG) == (
        'the pretrained model all-MiniLM-L6-v2 is not installed: pip install "tgattn[models]"')
