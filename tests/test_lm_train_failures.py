"""``lm train`` on a full disk and ``--resume`` of a training state of other shapes: one line each (issue 46.10).

Before, a full disk ended in torch's zip-writer traceback (``RuntimeError: [enforce fail at
inline_container.cc:672] . unexpected pos 832 vs 726``, the ``OSError`` only its context), and a
checkpoint whose random states or optimizer moments had other shapes ended in raw tracebacks
from ``set_rng_state`` or the first optimizer step.
"""
import errno
import os
import subprocess

import pytest
import torch

from conftest import one_line_error
from test_lm_cli import _tiny_run
from tgattn.lm import save_checkpoint
from tgattn.lm.__main__ import main

PROG = "python -m tgattn.lm train"


def _zip_writer_on_a_full_disk(obj, fh):
    """What torch.save raises when the disk fills: the zip writer's RuntimeError, the OSError as its context."""
    try:
        raise OSError(errno.ENOSPC, "No space left on device")
    except OSError:
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 832 vs 726")  # noqa: B904


def test_a_full_disk_is_one_line_and_keeps_the_last_checkpoint(tmp_path, cli, monkeypatch):
    common = _tiny_run(tmp_path, 4)
    ckpt = tmp_path / "out" / "ckpt.pt"
    before = ckpt.read_bytes()
    monkeypatch.setattr(torch, "save", _zip_writer_on_a_full_disk)
    status, err = cli(main, ["train", *common, "--max-iters", "8", "--resume"])
    assert status == 2 and one_line_error(err, PROG) == (
        f"[Errno 28] No space left on device: checkpoint {ckpt} was not written (the previous one, if any, is kept)")
    assert ckpt.read_bytes() == before and sorted(p.name for p in ckpt.parent.iterdir()) == ["ckpt.pt"]


@pytest.fixture
def full_disk(tmp_path):
    """A 64 KiB tmpfs (needs root and mount; skipped elsewhere), unmounted afterwards."""
    folder = tmp_path / "full"
    folder.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(folder)],
                                           capture_output=True).returncode:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def test_a_real_full_disk_is_one_line(tmp_path, cli, full_disk):
    common = _tiny_run(tmp_path, 1)
    status, err = cli(main, ["train", *common, "--max-iters", "2", "--out", str(full_disk), "--n-embd", "64"])
    assert status == 2 and one_line_error(err, PROG) == (
        f"[Errno 28] No space left on device: checkpoint {full_disk / 'ckpt.pt'} was not written "
        "(the previous one, if any, is kept)")
    assert list(full_disk.iterdir()) == []


def _moment_of_another_shape(state):
    first = min(state["optimizer"]["state"])
    moments = state["optimizer"]["state"][first]
    return {**state, "optimizer": {**state["optimizer"], "state": {
        **state["optimizer"]["state"], first: {**moments, "exp_avg": moments["exp_avg"].flatten()[:3]}}}}, first


@pytest.mark.parametrize("change, message", [
    (lambda s: ({**s, "rng": {**s["rng"], "torch": s["rng"]["torch"][:100]}}, None),
     "its rng 'torch' is torch.uint8 [100], not a uint8 random state of shape [5056]"),
    (lambda s: ({**s, "rng": {**s["rng"], "batches": s["rng"]["batches"].float()}}, None),
     "its rng 'batches' is torch.float32 [5056], not a uint8 random state of shape [5056]"),
    (lambda s: ({**s, "rng": [1, 2]}, None), "its rng is not a dict of 'batches' and 'torch' random states (got list)"),
    (_moment_of_another_shape, "its optimizer's exp_avg of parameter {first} is torch.float32 [3], the parameter is "),
    (lambda s: ({**s, "optimizer": {**s["optimizer"], "param_groups": s["optimizer"]["param_groups"][:1]}}, None),
     "its optimizer has parameter groups of ["),
    (lambda s: ({**s, "best_val": "low"}, None), "its best_val is 'low', not a number"),
])
def test_resume_checks_the_training_state_like_the_weights(tmp_path, cli, change, message):
    common = _tiny_run(tmp_path, 4)
    ckpt = tmp_path / "out" / "ckpt.pt"
    state, first = change(torch.load(ckpt, weights_only=True))
    save_checkpoint(ckpt, state)
    status, err = cli(main, ["train", *common, "--max-iters", "8", "--resume"])
    assert status == 2 and one_line_error(err, PROG).startswith(
        f"checkpoint {ckpt} cannot be resumed: " + message.format(first=first))
