"""Every command line is strict: no option answers to a prefix of its name, no hidden command is offered.

The commands are found, not listed: every module of the package with a ``__main__`` guard is run
as ``python -m`` runs it (``runpy``) until it calls ``parse_args``, which hands over the parser
instead of parsing; the test then walks that parser and each of its sub-commands' parsers.
"""
import argparse
import runpy
import sys

import pytest

from conftest import command_modules

COMMANDS = [(module, []) for module in command_modules()] + [("tgattn.lm", ["memory-probe"])]  # the internal one


class _Parser(Exception):
    def __init__(self, parser):
        self.parser = parser


def _built_parser(monkeypatch, module, argv):
    """The top parser that ``python -m module *argv`` builds, caught at its ``parse_args``."""

    def hand_over(parser, args=None, namespace=None):
        raise _Parser(parser)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", hand_over)
    monkeypatch.setattr(sys, "argv", [module, *argv])
    with pytest.raises(_Parser) as caught:
        runpy.run_module(module, run_name="__main__", alter_sys=False)
    monkeypatch.undo()
    return caught.value.parser


def _every_parser(parser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                yield from _every_parser(sub)


def test_the_commands_are_found():
    modules = {module for module, _ in COMMANDS}
    assert {"tgattn", "tgattn.lm", "tgattn.bench", "tgattn.analysis.show", "tgattn.distributed.gpt",
            "tgattn.bench.gpu", "tgattn.bench.graph_transformers"} <= modules  # the last two: packages


@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")  # runpy on an imported module
@pytest.mark.parametrize("module, argv", COMMANDS, ids=[" ".join([m, *a]) for m, a in COMMANDS])
def test_no_option_answers_to_an_abbreviation(monkeypatch, capsys, module, argv):
    for parser in _every_parser(_built_parser(monkeypatch, module, argv)):
        # `--hel` is a prefix of `--help`, which every parser has: with abbreviations on, it prints the help and exits 0
        try:
            parser.parse_known_args(["--hel"])
        except SystemExit as exit:
            assert exit.code != 0, f"{parser.prog} took --hel for --help"
        assert "usage:" not in capsys.readouterr().out, parser.prog


def test_a_typed_prefix_is_an_error(capsys):
    from tgattn.lm.__main__ import main

    with pytest.raises(SystemExit) as exit:
        main(["train", "--max-iter", "5"])
    assert exit.value.code == 2
    assert "unrecognized arguments: --max-iter 5" in capsys.readouterr().err


def test_a_mistyped_command_lists_only_the_public_ones(capsys):
    from tgattn.lm.__main__ import main

    with pytest.raises(SystemExit) as exit:
        main(["trian"])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and "invalid choice: 'trian'" in err and "'bench-memory'" in err
    assert "memory-probe" not in err
