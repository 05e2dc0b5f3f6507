"""The first call that needs the fused kernel says so before its build, and turning it off warns.

A newcomer's first call sat 16-23 s on a blank terminal while the kernel compiled; the notice is
a WARNING log record, which Python shows on stderr with no logging set up.
"""
import logging
import re
import sys

import pytest

from conftest import REPO
from tgattn.engine import build, fused, native

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="fcntl locks: POSIX only")


def test_the_notice_comes_before_the_compile_and_names_the_cache(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TGATTN_BUILD_DIR", str(tmp_path / "empty"))
    source = tmp_path / "ext.cpp"
    source.write_text('extern "C" int tgattn_notice() { return 1; }\n')
    seen_at_compile = []

    def compile_step(**kwargs):  # stands for the 16-23 s of the real kernel's build
        seen_at_compile.extend(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING
                               and r.name == build.logger.name)  # not torch's "No CUDA runtime is found"
        raise OSError("no compiler here")

    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "load", compile_step)
    folder = build.build_dir("ext", source)
    with caplog.at_level(logging.WARNING, logger="tgattn.engine.build"), pytest.warns(UserWarning, match="ext unavailable"):
        assert build.load_extension("ext", source, label="the test kernel", expect="15-60 s") is False
    assert seen_at_compile == [f"tgattn: compiling the test kernel for this machine (once, 15-60 s; cached in {folder})"]


def _measured_build_seconds() -> dict:
    """The idle-machine build times of docs/engine.md's table, by cores: ``{2: [63.0, 65.1], 1: [112.7]}``.

    Read from the measurement's rows (their "after (seven units)" cells), not from the notice the
    docs quote, so that an estimate the measurement does not back fails.
    """
    lines = (REPO / "docs" / "engine.md").read_text().splitlines()
    start = lines.index("| cores | before (single unit) | after (seven units) | after / before |")
    seconds = {}
    for row in lines[start + 2:]:
        if not row.startswith("|"):
            break
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        seconds[int(cells[0].split()[0])] = [float(x) for x in re.findall(r"(\d+\.\d) s", cells[2])]
    return seconds


def test_the_fused_kernel_announces_itself_by_name(monkeypatch):
    calls = []
    monkeypatch.setattr(build, "load_extension", lambda *args, **kwargs: calls.append(kwargs) or False)
    monkeypatch.setitem(native._state, "tried", False)
    monkeypatch.setitem(native._state, "ok", False)
    monkeypatch.delenv("TGATTN_NO_FUSED", raising=False)
    assert fused.available() is False
    measured = _measured_build_seconds()
    assert len(measured[2]) == 2 and len(measured[1]) == 1  # the table as measured: two runs on 2 cores, one on 1
    two, one = round(max(measured[2])), round(max(measured[1]))  # the slower run: an estimate, not a promise
    assert calls[0]["label"] == "the fused C++ kernel"
    assert calls[0]["expect"] == f"about {two} s on 2 idle cores, {one} s on one (measured, docs/engine.md)"


@pytest.mark.parametrize("value", ["1", "yes"])
def test_no_fused_warns_once_and_names_the_setting(monkeypatch, value):
    monkeypatch.setitem(native._state, "tried", False)
    monkeypatch.setitem(native._state, "ok", False)
    monkeypatch.setenv("TGATTN_NO_FUSED", value)
    with pytest.warns(UserWarning, match=rf"TGATTN_NO_FUSED={value} turns the fused C\+\+ kernel off; using the CSR "
                                         r"backend \(same results, slower\)") as caught:
        assert fused.available() is False
        assert fused.available() is False
    assert len(caught) == 1
