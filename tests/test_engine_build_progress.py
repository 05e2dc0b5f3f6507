"""A build of several units runs them side by side and says how far it is; prebuild builds ahead of use.

The builds here compile one-line C++ files (seconds), never the fused kernel; the fused kernel's
own build is checked by what it is made of (every unit and header of csrc/ listed) and by the
measurement its estimate quotes.
"""
import json
import logging
import os
import re
import subprocess
import sys
import time

import pytest

from conftest import REPO
from tgattn.engine import build

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="fcntl locks: POSIX only")


def units(folder, names, tag=""):
    """One-function C++ units (and a header they include) in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    header = folder / "shared.h"
    header.write_text(f"// {tag}\nconstexpr int kOne = 1;\n")
    paths = []
    for name in names:
        path = folder / f"{name}.cpp"
        path.write_text(f'#include "shared.h"\nextern "C" int tgattn_{name}() {{ return kOne; }}\n')
        paths.append(path)
    return paths, header


def shown(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_several_units_say_what_is_built_a_line_each_and_the_time(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TGATTN_BUILD_DIR", str(tmp_path / "builds"))
    monkeypatch.setenv("MAX_JOBS", "2")
    sources, header = units(tmp_path / "src", ["one", "two", "three"])
    with caplog.at_level(logging.WARNING, logger="tgattn.engine.build"):
        assert build.load_extension("multi", sources, headers=[header], label="the test kernel", expect="about 9 s")
    lines = shown(caplog)
    folder = build.build_dir("multi", sources, headers=[header])
    assert lines[0] == (f"tgattn: compiling the test kernel for this machine (once, about 9 s; 3 units, 2 at a time "
                        f"(MAX_JOBS); cached in {folder})")
    done = [re.fullmatch(r"tgattn: \[(\d)/3\] compiled (\w+)\.cpp \(\d+ s\)", line) for line in lines]
    done = [m.groups() for m in done if m]
    assert [n for n, _ in done] == ["1", "2", "3"] and sorted(u for _, u in done) == ["one", "three", "two"]
    assert re.fullmatch(rf"tgattn: compiled multi in [\d.]+ s, once for this torch, CPU and source \(3 units, 2 at "
                        rf"a time \(MAX_JOBS\); cached in {re.escape(str(folder))}\)", lines[-1])
    # every other line is a progress line
    assert all(line.startswith("tgattn: [") for line in lines[1:-1])

    # Another version (a header edited): a new folder, and the notice quotes the last build's time.
    caplog.clear()
    header.write_text(header.read_text() + "// edited\n")
    assert build.build_dir("multi", sources, headers=[header]) != folder
    with caplog.at_level(logging.WARNING, logger="tgattn.engine.build"):
        assert build.load_extension("multi", sources, headers=[header], label="the test kernel", expect="about 9 s")
    seconds = json.loads((folder / "built.json").read_text())["seconds"]
    assert f"(once, the last build here took {seconds:.0f} s on " in shown(caplog)[0]


def test_the_progress_names_the_units_in_the_compiler_and_never_stays_quiet(tmp_path, monkeypatch):
    if not os.path.isdir("/proc"):
        pytest.skip("the units in the compiler are found through /proc")
    monkeypatch.setattr(build, "HEARTBEAT_S", 0.2)
    folder = tmp_path / "build"
    folder.mkdir()
    a, b = tmp_path / "a.cpp", tmp_path / "b.cpp"
    said = []
    # a process working in the build folder with a.cpp among its arguments, as ninja's compiler is
    compiler = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", str(a)], cwd=folder)
    try:
        with build._Progress(folder, [a, b], time.perf_counter(), lambda *args: said.append(args[0] % args[1:])):
            deadline = time.monotonic() + 30
            while not any("compiling a.cpp" in line for line in said) and time.monotonic() < deadline:
                time.sleep(0.1)
            (folder / "a.o").touch()
            while not any("compiled a.cpp" in line for line in said) and time.monotonic() < deadline:
                time.sleep(0.1)
            (folder / "b.o").touch()  # finished as the build ends: still reported
    finally:
        compiler.kill()
        compiler.wait()
    assert re.fullmatch(r"tgattn: \[0/2\] \d+ s, compiling a\.cpp", said[0])
    assert [line for line in said if "compiled" in line] == [
        next(line for line in said if "compiled a.cpp" in line), said[-1]]
    assert re.fullmatch(r"tgattn: \[1/2\] compiled a\.cpp \(\d+ s\)", next(line for line in said if "compiled a" in line))
    assert re.fullmatch(r"tgattn: \[2/2\] compiled b\.cpp \(\d+ s\)", said[-1])


def test_prebuild_builds_every_extension_once_then_only_checks(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TGATTN_BUILD_DIR", str(tmp_path / "builds"))
    sources, header = units(tmp_path / "src", ["first", "second"])
    ext = build.Extension("pre", tuple(sources), (header,), label="the test kernel")
    monkeypatch.setattr(build, "EXTENSIONS", (ext,))
    with caplog.at_level(logging.WARNING, logger="tgattn.engine.build"):
        assert build.prebuild() > 0
    done = build.build_dir("pre", sources, headers=[header]) / "built.json"
    assert done.is_file()
    record, stamp = done.read_text(), done.stat().st_mtime_ns
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tgattn.engine.build"):
        build.prebuild()  # built: the check and a load, no compiler
    assert shown(caplog) == []
    assert done.read_text() == record and done.stat().st_mtime_ns == stamp  # no second build recorded


def test_prebuild_names_what_it_could_not_build(tmp_path, monkeypatch):
    monkeypatch.setenv("TGATTN_BUILD_DIR", str(tmp_path / "builds"))
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(build, "EXTENSIONS", (build.Extension("broken", (broken,), label="the broken kernel"),))
    with pytest.warns(UserWarning, match="broken unavailable"), pytest.raises(
            RuntimeError, match=r"could not build the broken kernel"):
        build.prebuild(progress=False)


def test_the_fused_kernel_is_every_unit_and_header_of_csrc():
    csrc = REPO / "tgattn" / "engine" / "csrc"
    assert sorted(p.name for p in build.FUSED.sources) == sorted(p.name for p in csrc.glob("*.cpp"))
    assert sorted(p.name for p in build.FUSED.headers) == sorted(p.name for p in csrc.glob("*.h"))
    assert len(set(build.FUSED.sources)) == len(build.FUSED.sources)
