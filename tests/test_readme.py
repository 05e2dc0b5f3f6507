"""The README's Python examples run as written.

Blocks fenced ```python run here; long reproductions (tens of seconds) are fenced ```py and
are covered by the test of the function they call instead.
"""
import re

import pytest

from conftest import REPO

BLOCKS = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index):
    exec(compile(BLOCKS[index], f"README.md python block {index}", "exec"), {})
