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


def _measured_main_library_cpu() -> float:
    """The compiler CPU of the main library's units, summed from docs/engine.md's table of units.

    Read from the measurement's rows (one per unit, each compiled alone), not from the notice the
    docs quote nor from ``build.FUSED``, so that an estimate the measurement does not back fails.
    """
    section = (REPO / "docs" / "engine.md").read_text().split("## Building the fused kernel")[1].split("\n## ")[0]
    rows = re.findall(r"^\| `(\w+)\.cpp` \| ([\d.]+) s \| tgattn_fused(_half)?\b", section, flags=re.M)
    main = [float(seconds) for _, seconds, half in rows if not half]
    assert len(main) == 3 and len(rows) == 7  # the table as measured: three units of tgattn_fused, four of the half library
    return sum(main)


def test_the_fused_kernel_announces_itself_by_name(monkeypatch):
    calls = []
    monkeypatch.setattr(build, "load_extension", lambda *args, **kwargs: calls.append(kwargs) or False)
    monkeypatch.setitem(native._state, "tried", False)
    monkeypatch.setitem(native._state, "ok", False)
    monkeypatch.delenv("TGATTN_NO_FUSED", raising=False)
    assert fused.available() is False
    assert calls[0]["label"] == "the fused C++ kernel"
    assert calls[0]["expect"] == f"about {round(_measured_main_library_cpu())} s of CPU (measured, docs/engine.md)"


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
