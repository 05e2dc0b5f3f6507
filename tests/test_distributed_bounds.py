"""Every distributed launch is bounded before it starts (issue 57.4).

Before: ``python -m tgattn.distributed.gpt --nproc 100000`` started ranks one by one (~5 s each,
+1 GB in 25 s) before its watch and timeout applied; ``--timeout inf`` failed 28 s later inside
rank 0 (``OverflowError``); ``spawn(fn, True)`` ran one rank; ``--out /dev/full`` (or any folder
that cannot be written) was found only after training, losing the run.
"""
import math
import os
import subprocess
import sys
import warnings

import pytest

from conftest import one_line_error
from launch_cases import Unloadable, never_reached
from tgattn.distributed import gnn, gpt, init, spawn

launch_module = sys.modules["tgattn.distributed.launch"]  # the attribute tgattn.distributed.launch is the function
COMMANDS = [(gpt, "python -m tgattn.distributed.gpt"), (gnn, "python -m tgattn.distributed.gnn")]


def _never(rank, world):
    raise AssertionError("a rank ran")


@pytest.mark.parametrize("world_size, message", [
    (True, "world_size must be an integer in [1, 1024] (got True)"),
    (100_000, "world_size must be an integer in [1, 1024] (got 100000)"),
    (2.0, "world_size must be an integer in [1, 1024] (got 2.0)"),
])
def test_spawn_refuses_a_rank_count_out_of_bounds_before_starting_any(world_size, message, monkeypatch):
    monkeypatch.setattr("torch.multiprocessing.start_processes", _never)
    with pytest.raises(ValueError) as refused:
        spawn(_never, world_size)
    assert str(refused.value) == message


@pytest.mark.parametrize("keyword", ["peer_timeout_s", "timeout_s"])
@pytest.mark.parametrize("value", [math.inf, math.nan, 0.0, -1.0])
def test_spawn_refuses_a_timeout_that_is_not_finite_and_positive(keyword, value, monkeypatch):
    monkeypatch.setattr("torch.multiprocessing.start_processes", _never)
    with pytest.raises(ValueError) as refused:
        spawn(_never, 2, **{keyword: value})
    assert str(refused.value) == f"{keyword} must be a finite number > 0 (got {value!r})"


def test_init_refuses_an_infinite_timeout_before_joining():
    with pytest.raises(ValueError, match=r"^timeout_s must be a finite number > 0 \(got inf\)$"):
        init("gloo", timeout_s=math.inf)
    with pytest.raises(ValueError, match=r"^join_timeout_s must be a finite number > 0 \(got inf\)$"):
        init("gloo", join_timeout_s=math.inf)


def test_more_ranks_than_cores_is_a_warning(monkeypatch):
    monkeypatch.setattr(launch_module, "cores", lambda: 2)
    with pytest.warns(UserWarning, match=r"^3 local ranks on 2 cores: they share the cores"):
        launch_module.check_world_size(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        launch_module.check_world_size(2)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:6 local ranks on")
def test_the_watch_covers_start_up(monkeypatch):
    """A rank that fails while the others start ends the job then: not all 6 ranks are started first.

    The stand-in for a slow start (each start waits for the first rank to end) makes the order
    certain; before, all 6 started in one call, and only then did the watch begin.
    """
    import torch.multiprocessing as mp

    real, started = mp.start_processes, []

    def one_after_another(fn, args=(), nprocs=1, **kwargs):
        if started:
            started[0].join(120)  # rank 0 has failed before another starts
        context = real(fn, args=args, nprocs=nprocs, **kwargs)
        started.extend(context.processes)
        return context

    monkeypatch.setattr(mp, "start_processes", one_after_another)
    with pytest.raises(ChildProcessError) as ended:
        spawn(never_reached, 6, Unloadable(), timeout_s=240)
    assert str(ended.value) == ("never_reached on 6 ranks ended: "
                                "rank 0 failed: RuntimeError: this argument cannot be loaded in a rank")
    assert 2 <= len(started) < 6


@pytest.mark.parametrize("module, prog", COMMANDS, ids=["gpt", "gnn"])
@pytest.mark.parametrize("argv, message", [
    (["--nproc", "100000"], "argument --nproc: must be an integer in [1, 1024] (got '100000')"),
    (["--nproc", "0"], "argument --nproc: must be an integer in [1, 1024] (got '0')"),
    (["--timeout", "inf"], "argument --timeout: must be finite (got 'inf')"),
    (["--lr", "inf"], "argument --lr: must be finite (got 'inf')"),
])
def test_the_commands_refuse_unbounded_options_in_one_line(module, prog, argv, message, cli, monkeypatch):
    monkeypatch.setattr(launch_module, "launch", _never)
    status, err = cli(module.main, argv)
    assert status == 2 and one_line_error(err, prog) == message


def test_gnn_refuses_a_non_finite_or_negative_weight_decay(cli, monkeypatch):
    monkeypatch.setattr(launch_module, "launch", _never)
    for value, rule in (("inf", "finite"), ("nan", "a number >= 0"), ("-1", "a number >= 0")):
        status, err = cli(gnn.main, [f"--weight-decay={value}"])
        assert status == 2 and one_line_error(err, COMMANDS[1][1]) == f"argument --weight-decay: must be {rule} (got {value!r})"


@pytest.fixture
def tmpfs(tmp_path):
    """A 64 KiB tmpfs mounted with ``options``: ``mount(options) -> folder`` (needs root and mount; skipped elsewhere)."""
    mounted = []

    def mount(options: str):
        folder = tmp_path / f"mnt{len(mounted)}"
        folder.mkdir()
        if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size=64k,{options}", "tmpfs", str(folder)],
                                               capture_output=True).returncode:
            pytest.skip("mounting a small tmpfs needs root")
        mounted.append(folder)
        return folder

    yield mount
    for folder in mounted:
        subprocess.run(["umount", str(folder)], check=True)


def _full(folder):
    (folder / "filler").write_bytes(b"\0" * 64 * 1024)
    return folder


@pytest.mark.parametrize("module, prog", COMMANDS, ids=["gpt", "gnn"])
@pytest.mark.parametrize("out, why", [
    (lambda tmp, mount: "/dev/full", "is not a folder"),
    (lambda tmp, mount: (tmp / "file").write_text("x") and tmp / "file" / "out", "cannot be written: Not a directory"),
    (lambda tmp, mount: mount("ro"), "cannot be written: Read-only file system"),
    (lambda tmp, mount: _full(mount("rw")), "cannot be written: No space left on device"),
], ids=["dev-full", "under-a-file", "read-only", "full-disk"])
def test_an_out_folder_that_cannot_be_written_is_refused_before_any_rank(module, prog, out, why, cli, monkeypatch,
                                                                        data_root, tmp_path, tmpfs):
    monkeypatch.setattr(launch_module, "launch", _never)
    folder = out(tmp_path, tmpfs)
    status, err = cli(module.main, ["--data", str(data_root), "--out", str(folder)])
    assert status == 2 and one_line_error(err, prog) == f"--out {folder} {why}"
