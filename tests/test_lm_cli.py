"""``python -m tgattn.lm``: train, resume, eval and sample on a tiny corpus laid out like the shared data."""
import json

import torch

from tgattn.lm.__main__ import main

TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n" * 40
TINY = ["--block-size", "8", "--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--batch-size", "4",
        "--eval-iters", "2", "--eval-interval", "4", "--checkpoint-interval", "4", "--warmup-iters", "2", "--no-progress"]


def test_train_resume_eval_sample(tmp_path, capsys):
    (tmp_path / "data" / "tinyshakespeare").mkdir(parents=True)
    (tmp_path / "data" / "tinyshakespeare" / "input.txt").write_text(TEXT)
    common = ["--data", str(tmp_path / "data"), "--out", str(tmp_path / "out"), *TINY]
    assert main(["train", *common, "--max-iters", "4", "--lr-decay-iters", "8", "--log", str(tmp_path / "log")]) == 0
    first = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert first["iters"] == 4 and first["final_val"] > 0
    assert main(["train", *common, "--max-iters", "8", "--lr-decay-iters", "8", "--resume"]) == 0
    state = torch.load(tmp_path / "out" / "ckpt.pt", weights_only=True)
    assert state["iter"] == 8 and state["config"]["n_embd"] == 16
    assert (tmp_path / "log.steps.csv").read_text().count("\n") == 1 + 4
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(tmp_path / "out" / "ckpt.pt"), "--data", str(tmp_path / "data"), "--eval-iters", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["iter"] == 8
    assert main(["sample", "--checkpoint", str(tmp_path / "out" / "ckpt.pt"), "--prompt", "First", "--num-tokens", "12"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("First") and len(text) == len("First") + 12 + 1  # prompt + new characters + newline


def test_missing_data_is_a_clear_error(tmp_path, capsys):
    assert main(["train", "--data", str(tmp_path / "nowhere"), "--max-iters", "1"]) == 2
    err = capsys.readouterr().err
    assert "Tiny Shakespeare not found" in err and "TGATTN_DATA" in err
