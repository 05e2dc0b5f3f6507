"""Building the C++ extension: a killed build does not hang later processes, one build serves every venv.

The builds here compile a one-line C++ file (a second or two), never the fused kernel.
"""
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import REPO
from tgattn.engine import build

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="fcntl locks: POSIX only")


def ours(caplog):
    """tgattn's build log (torch's cpp_extension warns on its own, e.g. "No CUDA runtime is found" on a CUDA
    build without a GPU)."""
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name == build.logger.name]


@pytest.fixture
def source(tmp_path, monkeypatch, request):
    """A tiny C++ source, unique per test, built under a fresh TGATTN_BUILD_DIR."""
    monkeypatch.setenv("TGATTN_BUILD_DIR", str(tmp_path / "builds"))
    path = tmp_path / "dummy.cpp"
    path.write_text(f'// {request.node.name}\nextern "C" int tgattn_dummy() {{ return 1; }}\n')
    return path


def test_the_build_folder_is_keyed_by_torch_cpu_and_source_not_by_the_venv(source, tmp_path, monkeypatch):
    folder = build.build_dir("dummy", source, cflags=["-O3"])
    assert folder.parent == tmp_path / "builds"
    with monkeypatch.context() as venv:  # another virtual environment, the same torch
        for attr in ("prefix", "exec_prefix", "base_prefix", "executable"):
            venv.setattr(sys, attr, "/elsewhere/venv")
        venv.setenv("VIRTUAL_ENV", "/elsewhere/venv")
        assert build.build_dir("dummy", source, cflags=["-O3"]) == folder
    assert build.build_dir("dummy", source, cflags=["-O2"]) != folder
    with monkeypatch.context() as other:
        other.setattr(build, "cpu_tag", lambda: "deadbeef")  # another CPU: -march=native differs
        assert build.build_dir("dummy", source, cflags=["-O3"]) != folder
    with monkeypatch.context() as other:
        other.setattr(torch, "__version__", "2.99.0+cpu")
        assert build.build_dir("dummy", source, cflags=["-O3"]) != folder
    with monkeypatch.context() as other:
        other.delenv("TGATTN_BUILD_DIR")
        other.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "torch-ext"))
        assert build.build_dir("dummy", source, cflags=["-O3"]) == tmp_path / "torch-ext" / folder.name
    source.write_text(source.read_text() + "// edited\n")
    assert build.build_dir("dummy", source, cflags=["-O3"]) != folder


def test_a_build_killed_while_holding_the_lock_does_not_hang_the_next(source):
    folder = build.build_dir("dummy", source)
    folder.mkdir(parents=True)
    # A process that locks the folder the way a build does, leaves torch's lock file, then is killed.
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import fcntl, os, sys, time
        fh = open(sys.argv[1], "a+")
        fcntl.flock(fh, fcntl.LOCK_EX)
        fh.write('{"pid": %d}' % os.getpid()); fh.flush()
        open(sys.argv[2], "w").write("stale")  # torch.utils.cpp_extension's lock file
        print("locked", flush=True)
        time.sleep(600)
        """), str(folder / "build.lock"), str(folder / "lock")], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=30)
    assert (folder / "lock").exists() and str(holder.pid) in (folder / "build.lock").read_text()
    loader = ("import sys; from tgattn.engine.build import load_extension; "
              "print(load_extension('dummy', sys.argv[1], wait=30))")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, "-c", loader, str(source)], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=60)  # torch's own lock file alone made this wait forever
    assert run.stdout.strip() == "True", run.stderr
    # The stale lock file went before torch's build; torch 2.13's own lock file is gone after it, while
    # torch 2.15's (filelock, emptied as it locks) stays: either way not the stale one.
    assert "compiled dummy in" in run.stderr
    assert not (folder / "lock").exists() or (folder / "lock").read_text() != "stale"


def test_a_live_build_elsewhere_is_waited_for_then_given_up_with_a_warning(source, caplog):
    import fcntl

    folder = build.build_dir("dummy", source)
    folder.mkdir(parents=True)
    with open(folder / "build.lock", "a+") as fh:  # another process building right now (here: this one)
        fcntl.flock(fh, fcntl.LOCK_EX)
        fh.write('{"pid": 4242, "host": "builder"}')
        fh.flush()
        with pytest.warns(UserWarning, match=r"dummy unavailable \(TimeoutError: waited 0.5 s for .*build.lock, held by "
                                             r'\{"pid": 4242, "host": "builder"\}\); using the CSR backend'):
            assert build.load_extension("dummy", source, wait=0.5, fallback="the CSR backend") is False
    assert ours(caplog) == [
        f'tgattn: waiting up to 0.5 s for the build in {folder} by {{"pid": 4242, "host": "builder"}}']


def test_the_first_build_logs_one_line_and_later_loads_reuse_it(source, caplog, monkeypatch):
    with caplog.at_level(logging.INFO, logger="tgattn.engine.build"):
        assert build.load_extension("dummy", source)
    shown = ours(caplog)
    assert len(shown) == 2 and shown[0].startswith("tgattn: compiling dummy for this machine (once; cached in ")
    assert shown[1].startswith("tgattn: compiled dummy in ") and " s, once for this torch" in shown[1]
    caplog.clear()

    def no_compiler(*args, **kwargs):
        raise AssertionError("compiled again")

    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    monkeypatch.setattr(sys, "prefix", "/another/venv")  # another environment, the same torch
    assert build.load_extension("dummy", source)
    assert ours(caplog) == []


@pytest.mark.parametrize("record", ['{"units": 1, "seconds": "x"}', "[1, 2]", '{"units": 1, "seconds": NaN}',
                                    '{"units": 1, "seconds": 5, "cores": "two"}', '"built"', "null"])
def test_a_damaged_record_of_another_build_is_ignored(source, tmp_path, caplog, record):
    old = tmp_path / "builds" / "dummy-old"  # another version's build folder, its record damaged or hand-made
    old.mkdir(parents=True)
    (old / "built.json").write_text(record)
    with caplog.at_level(logging.WARNING, logger="tgattn.engine.build"):
        assert build.load_extension("dummy", source, expect="about 2 s")
    notice = next(r.getMessage() for r in caplog.records if "compiling dummy" in r.getMessage())
    if record.startswith('{"units": 1, "seconds": 5'):
        assert "(once, the last build here took 5 s; cached in " in notice  # the time is good, the cores are not
    else:
        assert "(once, about 2 s; cached in " in notice


def unwritable(tmp_path):
    """A build root where no folder can be made, and the errno of trying: a read-only folder for a user, a
    path under /sys for root (who writes through permission bits); skips where neither holds."""
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o555)
        return locked / "builds", 13  # EACCES
    root = "/sys/tgattn-test-builds"
    try:
        os.mkdir(root)
    except PermissionError as err:
        return root, err.errno
    except OSError:
        pytest.skip("no read-only place to build in")
    os.rmdir(root)
    pytest.skip("no read-only place to build in")


def test_build_in_a_read_only_folder_names_the_cause_in_one_line(tmp_path):
    root, errno = unwritable(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(REPO), "TGATTN_BUILD_DIR": str(root)}
    run = subprocess.run([sys.executable, "-m", "tgattn", "build"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 1 and run.stdout == "" and "Traceback" not in run.stderr, run.stderr
    assert run.stderr.splitlines()[-1] == ("python -m tgattn build: error: could not build the fused C++ kernel: "
                                           f"PermissionError: [Errno {errno}] {os.strerror(errno)}: '{root}'")
    assert sum("tgattn" in line for line in run.stderr.splitlines()) == 1  # that line alone (torch may warn)
