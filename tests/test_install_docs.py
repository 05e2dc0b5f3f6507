"""What a newcomer copies from the README and the install page: lines that install what they say.

On Linux, ``pip install torch==2.13.0`` resolves to the CUDA build (a 527 MB wheel and 15
``nvidia-*`` packages); a machine without an NVIDIA GPU needs PyTorch's CPU wheel index, the
line PyTorch's own install page gives. Code blocks stay narrow enough for the site's column.
"""
import re

import pytest

from conftest import REPO

CPU_TORCH = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
# Furo's content column (46em) shows about 90 characters of its code font: wider lines scroll.
SITE_CODE_WIDTH = 90


def _bash_lines(page: str):
    text = (REPO / page).read_text()
    blocks = re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M)
    return [line.split("#")[0].strip() for block in blocks for line in block.splitlines()]


@pytest.mark.parametrize("page", ["README.md", "docs/quickstart.md"])
def test_the_cpu_only_torch_line_stands_beside_the_default_and_says_when(page):
    steps = [step.strip() for line in _bash_lines(page) for step in line.split("&&")]
    assert "pip install torch==2.13.0" in steps and CPU_TORCH in steps
    prose = " ".join((REPO / page).read_text().split())
    assert "Linux without an NVIDIA GPU" in prose


def test_pyproject_says_which_torch_and_why_the_test_extra_keeps_triton():
    text = (REPO / "pyproject.toml").read_text()
    assert CPU_TORCH in text
    test_extra = re.search(r"^test = \[(.*?)\]", text, flags=re.S | re.M).group(1)
    # a range that admits the triton of each torch tested (3.7.1 with 2.13, 3.9.0 with 2.15), no exact pin:
    # with one, pip replaced a newer torch by an older one whose triton matched
    triton = re.findall(r'"triton([^"]*)"', test_extra)
    assert triton == [">=3.7"] and re.findall(r'"triton([^"]*)"', text) == triton * 2  # the test and gpu extras
    assert '"torch>=2.13"' in text and "2.15.0" in text  # the oldest and the newest torch tested
    comment = text[: text.index("\ntest = [")].rsplit("\n\n", 1)[-1]
    assert "interpreter" in comment  # the reason the test extra needs triton without a GPU


def test_the_hugging_face_page_code_fits_the_site_column():
    text = (REPO / "docs/hf.md").read_text()
    blocks = re.findall(r"^```\w*\n(.*?)^```", text, flags=re.S | re.M)
    wide = [line for block in blocks for line in block.splitlines() if len(line) > SITE_CODE_WIDTH]
    assert not wide, wide
