"""Every code block of README.md and docs/**/*.md runs as written, as the notebooks are run.

A fence says what it holds: ``python`` and ``bash`` are code, ``text`` is output, ``{name}`` a
MyST directive. Python blocks run here, each in a fresh namespace, with the notebooks' settings
(``TGATTN_DATA``, ``TGATTN_QUICK=1``, ``MPLBACKEND=Agg``) in a scratch folder. Each bash command
either runs (the cheap, offline ones) or is skipped with its reason from ``BASH``; a skipped
``python -m module`` must still name a module that exists. A block that cannot run as written
(a model to download, several processes) is marked with the line ``<!-- fragment -->`` right
before its fence and stands beside its runnable twin: the next or previous code block of its
page, in its language, not itself a fragment.
"""
import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import DATA, REPO

PAGES = [REPO / "README.md", *sorted(p for p in (REPO / "docs").rglob("*.md") if "_build" not in p.parts)]
CODE = ("python", "bash")
OUTPUT = ("text",)
FRAGMENT = "<!-- fragment -->"
# Python blocks slower than a few seconds: they run with the slow tests only.
SLOW_PYTHON = {("docs/patterns.md", "receptive_field_growth"): "about 30 s: 200 layers of reachability at n = 1024"}
# Each bash command (a line, continuations joined, comments dropped) is matched from its start, in
# this order: None runs it (marked slow), a text skips it for that reason.
BASH = [
    (r"python3 -m venv |pip install ", "installs packages from the network (minutes)"),
    (r"export |COMMON=", "sets a variable for the commands after it"),
    (r"python -m pytest", "the test suite itself"),
    (r"sphinx-build ", "the site's build: test_docs.py builds it the same way"),
    (r"python -m tgattn verify$", None),
    (r'python -m tgattn show --text "The sky is blue" --pattern causal --out attn\.png$', None),
    (r"python -m tgattn fidelity ", "runs all-MiniLM-L6-v2 under nine patterns on 128 to 512 tokens: a minute or more"),
    (r"python -m tgattn build$", "compiles the C++ kernel: minutes the first time, and the tests build it too"),
    (r"python -m tgattn show .*--checkpoint", "reads a checkpoint that python -m tgattn.lm train writes (minutes)"),
    (r"python -m tgattn show --hf all-MiniLM-L6-v2 ", "runs the real model (tests/test_analysis_show_minilm.py runs the same, slow)"),
    (r"(nice -n \d+ )?python -m tgattn\.bench", "a benchmark: minutes to hours"),
    (r"python -m tgattn\.lm ", "trains, evaluates or benchmarks the tiny GPT: minutes to hours"),
    (r"torchrun |python -m tgattn\.distributed\.", "starts several processes (minutes)"),
]


@dataclass
class Block:
    page: Path
    line: int  # of the opening fence, from 1
    lang: str
    code: str
    fragment: bool

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def blocks(page: Path):
    """The fenced blocks of ``page``, in order (a fence closes on a line of its own characters)."""
    lines, found, i = page.read_text().splitlines(), [], 0
    while i < len(lines):
        opening = re.match(r"^(`{3,}|~{3,})\s*(\S*)", lines[i])
        if not opening:
            i += 1
            continue
        fence, end = opening.group(1), i + 1
        while end < len(lines) and not re.fullmatch(re.escape(fence[0]) + "{%d,}\\s*" % len(fence), lines[end]):
            end += 1
        fragment = i > 0 and lines[i - 1].strip() == FRAGMENT
        found.append(Block(page, i + 1, opening.group(2), "\n".join(lines[i + 1 : end]) + "\n", fragment))
        i = end + 1
    return found


BLOCKS = [block for page in PAGES for block in blocks(page)]
RUNNABLE = [block for block in BLOCKS if block.lang in CODE and not block.fragment]


def _uncommented(line: str) -> str:
    """``line`` without its comment: from a ``#`` that starts a word outside quotes."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].strip()
    return line.strip()


def commands(code: str):
    """The commands of a bash block: one per line, ``\\`` continuations joined, comments dropped."""
    lines = (_uncommented(line) for line in re.sub(r"\s*\\\n\s*", " ", code).splitlines())
    return [line for line in lines if line]


def _reason(command: str):
    for pattern, reason in BASH:
        if re.match(pattern, command):
            return True, reason
    return False, None


def _python_params():
    for block in RUNNABLE:
        if block.lang != "python":
            continue
        slow = [why for (page, text), why in SLOW_PYTHON.items() if block.where.startswith(page) and text in block.code]
        yield pytest.param(block, id=block.where, marks=[pytest.mark.slow] if slow else [])


def _bash_params():
    for block in RUNNABLE:
        if block.lang == "bash":
            for command in commands(block.code):
                known, reason = _reason(command)
                marks = [pytest.mark.slow] if known and reason is None else []
                yield pytest.param(block, command, id=f"{block.where} {command[:60]}", marks=marks)


def test_every_fence_says_what_it_holds():
    unnamed = [f"{b.where} ```{b.lang}" for b in BLOCKS
               if b.lang not in CODE + OUTPUT and not b.lang.startswith("{")]
    assert not unnamed, "name each fence python, bash, text or a {directive}: " + ", ".join(unnamed)


def test_a_fragment_stands_beside_its_runnable_twin():
    lonely = []
    for page in PAGES:
        code = [b for b in blocks(page) if b.lang in CODE or b.fragment]
        for i, block in enumerate(code):
            if block.fragment:
                beside = [code[j] for j in (i - 1, i + 1) if 0 <= j < len(code)]
                if not any(b.lang == block.lang and not b.fragment for b in beside):
                    lonely.append(block.where)
    assert not lonely, f"fragments without a runnable twin next to them: {lonely}"


def test_the_fence_parser_reads_languages_fragments_and_longer_fences(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("text\n\n<!-- fragment -->\n```python\nx = 1\n```\n\n````bash\necho\n```\n````\n\n```text\nout\n```\n")
    found = [(b.line, b.lang, b.code, b.fragment) for b in blocks(page)]
    assert found == [(4, "python", "x = 1\n", True), (8, "bash", "echo\n```\n", False), (13, "text", "out\n", False)]
    assert commands('export A=1   # why\npython -m x --a "#1 b" \\\n    --b 2\n\n# a comment\n') == [
        "export A=1", 'python -m x --a "#1 b" --b 2']


@pytest.mark.parametrize("block", list(_python_params()))
def test_python_block_runs(block, tmp_path, monkeypatch):
    if "transformers" in block.code:
        pytest.importorskip("transformers")
    monkeypatch.setenv("TGATTN_DATA", str(DATA))
    monkeypatch.setenv("TGATTN_QUICK", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.chdir(tmp_path)
    exec(compile(block.code, f"{block.where} (python block)", "exec"), {"__name__": "__main__"})


@pytest.mark.parametrize("block, command", list(_bash_params()))
def test_bash_command_runs_or_says_why_not(block, command, tmp_path):
    known, reason = _reason(command)
    assert known, f"{block.where}: say in BASH whether `{command}` runs here, or why not"
    if reason is not None:
        module = re.search(r"-m (tgattn[\w.]*)", command)
        if module:
            assert importlib.util.find_spec(module.group(1)) is not None, f"{block.where}: no module {module.group(1)}"
        pytest.skip(reason)
    env = {**os.environ, "TGATTN_DATA": str(DATA), "TGATTN_QUICK": "1", "MPLBACKEND": "Agg",
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{block.where}: {command}\n{done.stdout}\n{done.stderr}"
