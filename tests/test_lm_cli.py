"""``python -m tgattn.lm``: train, resume, eval and sample on a tiny corpus laid out like the shared data."""
import json
import subprocess
import sys

import pytest
import torch

from conftest import REPO, one_line_error
from tgattn.lm import save_checkpoint
from tgattn.lm.__main__ import main
from tgattn.models import GPT, GPTConfig

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


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "--attention", "bogus"], "argument --attention: invalid choice: 'bogus' (choose from 'graph', 'dense')"),
        (["train", "--pattern", "spiral"], "argument --pattern: invalid choice: 'spiral'"),
        (["train", "--n-embd", "30", "--n-head", "4"], "--n-embd must be divisible by --n-head (got --n-embd=30, --n-head=4)"),
        (["train", "--eval-interval", "0"], "--eval-interval must be >= 1 (got 0)"),
        (["train", "--eval-iters", "0"], "--eval-iters must be >= 1 (got 0)"),
        (["train", "--max-iters", "-5"], "--max-iters must be >= 0 (got -5)"),
        (["train", "--lr", "nan"], "--lr must be > 0 (got nan)"),
        (["train", "--dropout", "1"], "--dropout must be in [0, 1) (got 1.0)"),
        (["train", "--bias", "Treu"], "argument --bias: must be true or false (got 'Treu')"),
        (["train", "--threads", "-1"], "argument --threads: must be an integer >= 0 (got '-1')"),
        (["eval", "--eval-iters", "0"], "argument --eval-iters: must be an integer >= 1 (got '0')"),
        (["sample", "--top-k", "0"], "argument --top-k: must be an integer >= 1 (got '0')"),
        (["sample", "--temperature", "0"], "argument --temperature: must be a number > 0 (got '0')"),
        (["sample", "--num-tokens", "-3"], "argument --num-tokens: must be an integer >= 0 (got '-3')"),
        (["sample", "--seed", "-1"], "argument --seed: must be an integer in [0, 2**63) (got '-1')"),
        (["sample", "--prompt", ""], "--prompt must hold at least one character"),
        (["bench-decode", "--lengths", "256,-3"], "argument --lengths: must be an integer >= 1 (got '-3')"),
        (["bench-train", "--steps", "0"], "argument --steps: must be an integer >= 1 (got '0')"),
        (["bench-memory", "--batch-size", "0"], "argument --batch-size: must be an integer >= 1 (got '0')"),
    ],
)
def test_bad_arguments_are_one_line_errors(cli, argv, message):
    status, err = cli(main, argv)
    assert status == 2 and one_line_error(err, f"python -m tgattn.lm {argv[0]}").startswith(message)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    config = GPTConfig(block_size=8, vocab_size=3, n_layer=1, n_head=2, n_embd=8)
    path = tmp_path_factory.mktemp("ckpt") / "ckpt.pt"
    save_checkpoint(path, {"model": GPT(config).state_dict(), "config": config.__dict__, "vocab": "abc", "iter": 0})
    return path


@pytest.mark.parametrize("prompt", ["abd", "ab\u00e9"])
def test_a_prompt_outside_the_vocabulary_is_named(cli, checkpoint, prompt):
    status, err = cli(main, ["sample", "--checkpoint", str(checkpoint), "--prompt", prompt, "--num-tokens", "2"])
    assert status == 2 and one_line_error(err, "python -m tgattn.lm sample") == (
        f"--prompt holds characters that {checkpoint} has no token for: {prompt[-1]!r}")


def test_a_damaged_checkpoint_is_a_one_line_error(cli, checkpoint, tmp_path):
    cut = tmp_path / "cut.pt"
    cut.write_bytes(checkpoint.read_bytes()[:1000])
    for command in (["sample"], ["eval", "--data", str(tmp_path)]):
        status, err = cli(main, [*command, "--checkpoint", str(cut)])
        assert status == 2 and f"checkpoint {cut} (1,000 bytes) is truncated or corrupted" in one_line_error(
            err, f"python -m tgattn.lm {command[0]}")


def test_a_corpus_too_short_to_validate_is_refused_before_training(cli, tmp_path):
    (tmp_path / "data" / "tinyshakespeare").mkdir(parents=True)
    (tmp_path / "data" / "tinyshakespeare" / "input.txt").write_text("First Citizen: speak, speak." * 2)  # 56 characters: 50 + 6
    status, err = cli(main, ["train", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "out"), *TINY, "--max-iters", "4"])
    assert status == 2 and one_line_error(err, "python -m tgattn.lm train") == (
        "the validation split has 6 tokens, too few for block_size 8: use a longer corpus or a smaller block_size")
    assert not (tmp_path / "out").exists()  # no step was taken


def test_help_hides_the_internal_command(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["--help"])
    out = capsys.readouterr().out
    assert exit.value.code == 0
    assert "SUPPRESS" not in out and "memory-probe" not in out and "bench-memory" in out


def test_help_and_bad_arguments_import_no_torch():
    # what makes `python -m tgattn.lm --help` answer at once (5-12 s when it imported torch and PyG)
    code = ("import sys\nfrom tgattn.lm.__main__ import main\n"
            "for argv in (['--help'], ['train', '--help'], ['train', '--max-iters', '-5']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "print(sorted(m for m in ('torch', 'torch_geometric', 'networkx') if m in sys.modules), file=sys.stderr)")
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.stderr.strip().splitlines()[-1] == "[]", run.stderr
