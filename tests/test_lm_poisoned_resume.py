"""A crafted checkpoint, a diverging run or an infinite option never poisons a run (issue 57.3).

Before: ``--resume`` of a checkpoint whose Adam ``exp_avg_sq`` held NaN (right shapes, the SHA-256
recomputed as anyone can) ended with exit status 0, NaN weights and the checkpoint overwritten with
them; ``--lr inf`` was accepted (``--lr nan`` was refused) and did the same from a fresh start.
"""
import shutil

import pytest
import torch

from conftest import one_line_error
from test_lm_cli import _tiny_run
from tgattn.lm import save_checkpoint
from tgattn.lm.__main__ import main

PROG = "python -m tgattn.lm train"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny run of 4 steps: ``(its folder, its train flags)``; each test works on a copy."""
    folder = tmp_path_factory.mktemp("trained")
    return folder, _tiny_run(folder, 4)


@pytest.fixture
def run(trained, tmp_path):
    """A copy of the trained run in ``tmp_path``: ``(its train flags, its checkpoint)``."""
    folder, common = trained
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    return [a.replace(str(folder), str(tmp_path)) for a in common], tmp_path / "out" / "ckpt.pt"


def _moment(state, name, fill):
    """``state`` with one entry of the first parameter's Adam state replaced: ``fill(value)``."""
    first = min(state["optimizer"]["state"])
    moments = state["optimizer"]["state"][first]
    return {**state, "optimizer": {**state["optimizer"], "state": {
        **state["optimizer"]["state"], first: {**moments, name: fill(moments[name].clone())}}}}


def _nan_at_one(t):
    t.view(-1)[1] = float("nan")
    return t


def _group(state, name, value):
    groups = [dict(g) for g in state["optimizer"]["param_groups"]]
    groups[0][name] = value
    return {**state, "optimizer": {**state["optimizer"], "param_groups": groups}}


@pytest.mark.parametrize("change, message", [
    (lambda s: _moment(s, "exp_avg_sq", _nan_at_one), "its optimizer's exp_avg_sq of parameter 0 holds NaN or inf"),
    (lambda s: _moment(s, "exp_avg", lambda t: t.fill_(float("inf"))), "its optimizer's exp_avg of parameter 0 holds NaN or inf"),
    (lambda s: _moment(s, "exp_avg_sq", lambda t: t - 1), "its optimizer's exp_avg_sq of parameter 0 holds a negative value"),
    (lambda s: _moment(s, "step", lambda t: t.fill_(float("inf"))), "its optimizer's step of parameter 0 holds NaN or inf"),
    (lambda s: _moment(s, "step", lambda t: t.fill_(float("nan"))), "its optimizer's step of parameter 0 holds NaN or inf"),
    (lambda s: _moment(s, "step", lambda t: t.fill_(-3)), "its optimizer's step of parameter 0 holds a negative value (-3)"),
    (lambda s: _group(s, "eps", float("nan")), "its optimizer's eps of parameter group 0 is nan, not finite"),
    (lambda s: _group(s, "betas", (0.9, float("inf"))), "its optimizer's betas of parameter group 0 is (0.9, inf), not finite"),
    (lambda s: {**s, "model": {**s["model"], "lm_head.weight": s["model"]["lm_head.weight"] * float("nan")}},
     "its weights 'lm_head.weight' hold NaN or inf"),
    (lambda s: {**s, "best_val": float("nan")}, "its best_val is nan, not a loss >= 0"),
])
def test_resume_refuses_poisoned_values_and_keeps_the_checkpoint(run, cli, change, message):
    common, ckpt = run
    state = torch.load(ckpt, weights_only=True)
    save_checkpoint(ckpt, change(state))  # the checksum recomputed: only the values give it away
    crafted = ckpt.read_bytes()
    status, err = cli(main, ["train", *common, "--max-iters", "8", "--resume"])
    assert status == 2 and one_line_error(err, PROG).startswith(f"checkpoint {ckpt} cannot be resumed: {message}")
    assert ckpt.read_bytes() == crafted


def test_a_sound_checkpoint_still_resumes_to_finite_weights(run, cli):
    common, ckpt = run
    status, _ = cli(main, ["train", *common, "--max-iters", "6", "--resume"])
    state = torch.load(ckpt, weights_only=True)
    assert status == 0 and state["iter"] == 6 and all(torch.isfinite(t).all() for t in state["model"].values())


@pytest.mark.parametrize("poisoned_at, message", [
    (6, "training diverged: weights 'transformer.wte.weight' hold NaN or inf at iteration 6; checkpoint {ckpt} is kept as it was"),
    (5, "training diverged: the loss is nan at iteration 5; checkpoint {ckpt} is kept as it was"),
])
def test_a_diverged_model_never_replaces_the_checkpoint(run, cli, monkeypatch, poisoned_at, message):
    """A weight turned NaN after step ``poisoned_at``: the next loss (or the final save) stops the run."""
    common, ckpt = run
    before = ckpt.read_bytes()
    step = torch.optim.AdamW.step

    def poisoning_step(self, *args, **kwargs):
        out = step(self, *args, **kwargs)
        if self.state[self.param_groups[0]["params"][0]]["step"] == poisoned_at:  # the count goes on from the resumed 4
            self.param_groups[0]["params"][0].data.fill_(float("nan"))
        return out

    monkeypatch.setattr(torch.optim.AdamW, "step", poisoning_step)
    status, err = cli(main, ["train", *common, "--max-iters", "6", "--resume"])
    assert status == 2 and one_line_error(err, PROG) == message.format(ckpt=ckpt)
    assert ckpt.read_bytes() == before


@pytest.mark.parametrize("flag", ["--lr", "--min-lr", "--weight-decay", "--grad-clip"])
@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
def test_non_finite_float_options_are_refused(cli, flag, value):
    status, err = cli(main, ["train", f"{flag}={value}", "--data", "/no/such/folder"])  # on main it trained
    assert status == 2 and one_line_error(err, PROG).startswith(f"{flag} must be ")
    assert f"and finite (got {float(value)})" in err
