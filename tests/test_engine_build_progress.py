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
from tgattn.engine import build, build_progress

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
    """tgattn's build log (not torch's own warnings, such as "No CUDA runtime is found" on a CUDA build)."""
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name == build.logger.name]


def test_several_units_say_what_is_built_a_line_each_and_the_time(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TGATTN_BUILD_DIR", str(tmp_path / "builds"))
    monkeypatch.setenv("MAX_JOBS", "2")
    sources, header = units(tmp_path / "src", ["one", "two", "three"])
    cpu = {"one": 1.0, "two": 3.0, "three": 4.0}  # "measured" CPU seconds: the progress is their share
    monkeypatch.setattr(build_progress, "compiling", lambda folder, units: {})  # only finished units count (see below)
    with caplog.at_level(logging.WARNING, logger="tgattn.engine.build"):
        assert build.load_extension("multi", sources, headers=[header], label="the test kernel", expect="about 9 s",
                                    cpu=[cpu[p.stem] for p in sources])
    lines = shown(caplog)
    folder = build.build_dir("multi", sorted(sources, key=lambda p: -cpu[p.stem]), headers=[header])
    assert lines[0] == (f"tgattn: compiling the test kernel for this machine (once, about 9 s; 3 units, 2 at a time "
                        f"(MAX_JOBS); cached in {folder})")
    done = [re.fullmatch(r"tgattn: \[(\d)/3\] (\d+)% compiled (\w+)\.cpp \(\d+ s\)", line) for line in lines]
    done = [m.groups() for m in done if m]
    assert [n for n, _, _ in done] == ["1", "2", "3"] and sorted(u for _, _, u in done) == ["one", "three", "two"]
    finished = [u for _, _, u in done]
    assert [int(share) for _, share, _ in done] == [  # 12 %, 50 %, ... of 8 s as the units finish
        round(100 * sum(cpu[u] for u in finished[: i + 1]) / 8) for i in range(3)]
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


def test_no_more_units_at_once_than_cores_and_the_longest_first(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TGATTN_BUILD_DIR", str(tmp_path / "builds"))
    monkeypatch.delenv("MAX_JOBS", raising=False)
    monkeypatch.setattr(build, "_cores", lambda: 2)
    sources, header = units(tmp_path / "src", ["short", "long", "middle"])
    seen = {}

    def compile_step(**kwargs):  # what torch's build (ninja) is handed
        seen.update(jobs=os.environ.get("MAX_JOBS"), order=[os.path.basename(s) for s in kwargs["sources"]])
        raise OSError("stop here")

    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "load", compile_step)
    with caplog.at_level(logging.WARNING, logger="tgattn.engine.build"), pytest.warns(UserWarning, match="stop here"):
        assert not build.load_extension("order", sources, headers=[header], cpu=[2.0, 30.0, 9.5])
    assert seen == {"jobs": "2", "order": ["long.cpp", "middle.cpp", "short.cpp"]}
    assert "; 3 units, 2 at a time; cached in " in shown(caplog)[0]
    assert "MAX_JOBS" not in os.environ  # as it was
    with pytest.raises(ValueError, match=r"cpu=\[1.0\]: expected one measured time per unit \(3\)"):
        build._build_and_load("order", sources, headers=[header], cflags=(), ldflags=(), wait=1, label="", expect="",
                              cpu=[1.0], progress=False)


def test_the_share_counts_the_compiler_cpu_of_the_units_in_it(tmp_path):
    a, b, c = (tmp_path / f"{n}.cpp" for n in "abc")
    progress = build_progress.Progress(tmp_path, [a, b, c], 0.0, None, [10.0, 6.0, 4.0])
    assert progress.share() == 0.0
    assert progress.share({a: 5.0, b: 1.5}) == pytest.approx(100 * 6.5 / 20)
    assert progress.share({a: 50.0}) == pytest.approx(100 * 9.5 / 20)  # a unit over its measured time: 95 % of it
    progress.done.append(a)
    assert progress.share({a: 10.0, c: 2.0}) == pytest.approx(100 * 12 / 20)  # a done counts once


def test_the_progress_names_the_units_in_the_compiler_and_never_stays_quiet(tmp_path, monkeypatch):
    if not os.path.isdir("/proc"):
        pytest.skip("the units in the compiler are found through /proc")
    monkeypatch.setattr(build_progress, "HEARTBEAT_S", 0.2)
    folder = tmp_path / "build"
    folder.mkdir()
    a, b = tmp_path / "a.cpp", tmp_path / "b.cpp"
    said = []
    # a process working in the build folder with a.cpp among its arguments, as ninja's compiler is
    compiler = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", str(a)], cwd=folder)
    try:
        with build_progress.Progress(folder, [a, b], time.perf_counter(), lambda *args: said.append(args[0] % args[1:])):
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
    assert re.fullmatch(r"tgattn: \[0/2\] \d+% \d+ s, compiling a\.cpp", said[0])  # the sleeper: ~0 % of its 1 s
    assert [line for line in said if "compiled" in line] == [
        next(line for line in said if "compiled a.cpp" in line), said[-1]]
    assert re.fullmatch(r"tgattn: \[1/2\] 50% compiled a\.cpp \(\d+ s\)", next(line for line in said if "compiled a" in line))
    assert re.fullmatch(r"tgattn: \[2/2\] 100% compiled b\.cpp \(\d+ s\)", said[-1])


def test_the_units_in_the_compiler_come_with_their_cpu_time(tmp_path):
    if not os.path.isdir("/proc"):
        pytest.skip("the units in the compiler are found through /proc")
    folder = tmp_path / "build"
    folder.mkdir()
    a, b = tmp_path / "a.cpp", tmp_path / "b.cpp"
    spin = "import sys, time\nend = time.process_time() + 0.6\nwhile time.process_time() < end: pass\nprint(1, flush=True)\ntime.sleep(60)"
    compiler = subprocess.Popen([sys.executable, "-c", spin, str(b)], cwd=folder, stdout=subprocess.PIPE, text=True)
    try:
        assert compiler.stdout.readline().strip() == "1"  # 0.6 s of CPU spent
        busy = build_progress.compiling(folder, [a, b])
    finally:
        compiler.kill()
        compiler.wait()
    assert list(busy) == [b] and 0.55 <= busy[b] <= 5.0


def test_prebuild_builds_every_extension_once_then_only_checks(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TGATTN_BUILD_DIR", str(tmp_path / "builds"))
    sources, header = units(tmp_path / "src", ["first", "second"])
    ext = build.Extension("pre", tuple(sources), (header,), label="the test kernel")
    with caplog.at_level(logging.WARNING, logger="tgattn.engine.build"):
        assert build.prebuild([ext]) > 0
    done = build.build_dir("pre", sources, headers=[header]) / "built.json"
    assert done.is_file()
    record, stamp = done.read_text(), done.stat().st_mtime_ns
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tgattn.engine.build"):
        build.prebuild([ext])  # built: the check and a load, no compiler
    assert shown(caplog) == []
    assert done.read_text() == record and done.stat().st_mtime_ns == stamp  # no second build recorded


def test_prebuild_names_what_it_could_not_build(tmp_path, monkeypatch):
    monkeypatch.setenv("TGATTN_BUILD_DIR", str(tmp_path / "builds"))
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    with pytest.raises(RuntimeError, match=r"^could not build the broken kernel: RuntimeError: Error building extension"):
        build.prebuild([build.Extension("broken", (broken,), label="the broken kernel")], progress=False)


def test_an_extension_that_needs_another_links_against_its_library_and_loads_it_first(tmp_path, monkeypatch):
    monkeypatch.setenv("TGATTN_BUILD_DIR", str(tmp_path / "builds"))
    base = tmp_path / "base.cpp"
    base.write_text('extern "C" int tgattn_base_value() { return 41; }\n')
    user = tmp_path / "user.cpp"  # calls into the base library: links only with it
    user.write_text('extern "C" int tgattn_base_value();\nextern "C" int tgattn_user_value() { return tgattn_base_value() + 1; }\n')
    first = build.Extension("base", (base,))
    second = build.Extension("user", (user,), ldflags=("-Wl,--no-undefined",), needs=first)
    assert second.load(progress=False)
    import ctypes

    assert first.library().is_file() and ctypes.CDLL(str(second.library())).tgattn_user_value() == 42
    assert str(first.library()) in second._ldflags() and second.library().parent != first.library().parent


def test_the_fused_kernel_is_every_unit_and_header_of_csrc():
    csrc = REPO / "tgattn" / "engine" / "csrc"
    units = build.FUSED.sources + build.FUSED_HALF.sources
    parts = re.findall(r'^#include "(\w+\.cpp)"$', (csrc / "host.cpp").read_text(), flags=re.M)  # one unit of three
    assert sorted(parts) == ["graph.cpp", "maps.cpp", "ops.cpp"]
    assert sorted([p.name for p in units] + parts) == sorted(p.name for p in csrc.glob("*.cpp"))
    assert len(set(units)) == len(units)
    for ext in build.FUSED, build.FUSED_HALF:  # what the units include is in the build's key
        assert sorted(p.name for p in ext.headers) == sorted([p.name for p in csrc.glob("*.h")] + parts)
        assert len(ext.cpu) == len(ext.sources) and all(t > 0 for t in ext.cpu)
    assert build.FUSED_HALF.needs is build.FUSED and build.EXTENSIONS == (build.FUSED, build.FUSED_HALF)
    assert str(build.FUSED.library()) in build.FUSED_HALF._ldflags()  # it links against the main library


@pytest.mark.parametrize("ext", ["FUSED", "FUSED_HALF"])
def test_the_fused_kernels_estimates_and_unit_times_are_the_measurement_in_the_docs(ext):
    ext = getattr(build, ext)
    numbers = re.findall(r"(\d+) s of CPU", ext.expect)
    assert len(numbers) == 1 and "docs/engine.md" in ext.expect
    section = (REPO / "docs" / "engine.md").read_text().split("## Building the fused kernel")[1].split("\n## ")[0]
    measured = {}  # the table of the units' compiler CPU, each measured alone
    for unit in ext.sources:
        found = re.search(rf"^\| `{unit.name}` \| ([\d.]+) s \|", section, flags=re.M)
        assert found, unit.name
        measured[unit] = float(found.group(1))
    assert list(ext.cpu) == [measured[u] for u in ext.sources]  # the progress's weights are that measurement
    assert int(numbers[0]) == round(sum(measured.values()))  # and the estimate is their sum
