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
    out, err = capsys.readouterr()
    first = json.loads(out)  # stdout: the summary alone
    assert first["iters"] == 4 and first["final_val"] > 0 and first["checkpoint"] == str(tmp_path / "out" / "ckpt.pt")
    assert err == f"checkpoint: {tmp_path / 'out' / 'ckpt.pt'} (iteration 4)\n"
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


def _tiny_run(tmp_path, max_iters: int, out: str = "out") -> list:
    """The corpus in ``tmp_path/data``, a tiny model trained for ``max_iters`` into ``tmp_path/out``; its train flags."""
    if not (tmp_path / "data").exists():
        (tmp_path / "data" / "tinyshakespeare").mkdir(parents=True)
        (tmp_path / "data" / "tinyshakespeare" / "input.txt").write_text(TEXT)
    common = ["--data", str(tmp_path / "data"), "--out", str(tmp_path / out), *TINY, "--lr-decay-iters", "8"]
    assert main(["train", *common, "--max-iters", str(max_iters)]) == 0
    return common


def test_train_shows_the_final_evaluation_and_where_the_checkpoint_went(tmp_path, capsys):
    (tmp_path / "data" / "tinyshakespeare").mkdir(parents=True)
    (tmp_path / "data" / "tinyshakespeare" / "input.txt").write_text(TEXT)
    flags = [f for f in TINY if f != "--no-progress"]
    assert main(["train", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "out"), *flags, "--max-iters", "2"]) == 0
    out, err = capsys.readouterr()
    final = err[err.rindex("train graph: 100%"):]  # after the training bar: the final evaluation's two bars, then the path
    assert final.index("iter 2: train loss") < final.index("iter 2: val loss") < final.index(f"checkpoint: {tmp_path / 'out' / 'ckpt.pt'}")
    assert "iter 2: train loss " in out  # the losses, written above the bars


def test_resume_never_goes_back(tmp_path, cli):
    # issue #31: --max-iters 2 --resume after 4 steps relabelled the step-4 weights as iteration 2,
    # and a later --max-iters 6 --resume ran steps 2-5 again (8 optimizer steps)
    common, ckpt = _tiny_run(tmp_path, 4), tmp_path / "out" / "ckpt.pt"
    saved = ckpt.read_bytes()
    status, err = cli(main, ["train", *common, "--max-iters", "2", "--resume"])
    assert status == 2 and one_line_error(err, "python -m tgattn.lm train") == (
        f"checkpoint {ckpt} is already at iteration 4, past --max-iters 2: resuming cannot take it back "
        "(pass --max-iters 4 or more to continue it, or train a new model into another --out)")
    assert ckpt.read_bytes() == saved
    status, err = cli(main, ["train", *common, "--max-iters", "4", "--resume"])
    assert status == 0 and err == f"checkpoint {ckpt} is already at iteration 4 (--max-iters 4): nothing to do\n"
    assert ckpt.read_bytes() == saved
    assert main(["train", *common, "--max-iters", "6", "--resume", "--log", str(tmp_path / "log")]) == 0
    assert [row.split(",")[0] for row in (tmp_path / "log.steps.csv").read_text().splitlines()[1:]] == ["4", "5"]  # 2 steps
    state = torch.load(ckpt, weights_only=True)
    assert state["iter"] == 6 and {float(s["step"]) for s in state["optimizer"]["state"].values()} == {6.0}
    _tiny_run(tmp_path, 6, out="whole")  # the same 6 steps without a stop
    whole = torch.load(tmp_path / "whole" / "ckpt.pt", weights_only=True)
    torch.testing.assert_close(state["model"], whole["model"], rtol=0, atol=0)


def test_resume_refuses_model_flags_that_contradict_the_checkpoint(tmp_path, cli):
    common, ckpt = _tiny_run(tmp_path, 2), tmp_path / "out" / "ckpt.pt"  # n_embd 16, n_layer 1
    saved = ckpt.read_bytes()
    status, err = cli(main, ["train", *common, "--n-embd", "32", "--n-layer", "2", "--max-iters", "4", "--resume"])
    assert status == 2 and one_line_error(err, "python -m tgattn.lm train") == (
        f"checkpoint {ckpt} holds a model with --n-layer 1, --n-embd 16; --resume cannot change it to "
        "--n-layer 2, --n-embd 32 (leave those flags out to resume it, or train a new model into another --out)")
    status, err = cli(main, ["train", *common, "--n-emb", "32", "--max-iters", "4", "--resume"])  # no abbreviation
    assert status == 2 and one_line_error(err, "python -m tgattn.lm") == "unrecognized arguments: --n-emb 32"
    status, err = cli(main, ["train", *common, "--bias", "true", "--max-iters", "4", "--resume"])
    assert status == 2 and "holds a model with --bias false; --resume cannot change it to --bias true" in err
    assert ckpt.read_bytes() == saved
    # flags left out are not contradictions: --block-size's default is 64, the checkpoint's 8
    short = ["--data", str(tmp_path / "data"), "--out", str(tmp_path / "out"), "--eval-iters", "2", "--no-progress"]
    status, err = cli(main, ["train", *short, "--n-embd", "16", "--max-iters", "4", "--resume"])
    state = torch.load(ckpt, weights_only=True)
    assert status == 0 and state["iter"] == 4 and state["config"]["block_size"] == 8 and state["config"]["n_embd"] == 16


def test_resume_needs_training_state(tmp_path, cli, checkpoint):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "ckpt.pt").write_bytes(checkpoint.read_bytes())  # a model saved without train()
    status, err = cli(main, ["train", "--out", str(tmp_path / "out"), "--resume", "--max-iters", "1"])
    assert status == 2 and one_line_error(err, "python -m tgattn.lm train") == (
        f"checkpoint {tmp_path / 'out' / 'ckpt.pt'} cannot be resumed: it has no training state "
        "(keys ['optimizer', 'best_val', 'rng'] are missing)")


def test_missing_data_is_a_clear_error(tmp_path, capsys):
    assert main(["train", "--data", str(tmp_path / "nowhere"), "--max-iters", "1"]) == 2
    err = capsys.readouterr().err
    assert "Tiny Shakespeare not found" in err and "TGATTN_DATA" in err


def test_a_data_folder_without_the_corpus_names_it_once(tmp_path, cli, monkeypatch):
    monkeypatch.setenv("TGATTN_DATA", str(tmp_path))
    status, err = cli(main, ["train", "--out", str(tmp_path / "out"), "--max-iters", "1"])
    message = one_line_error(err, "python -m tgattn.lm train")
    assert status == 2 and message.count("Tiny Shakespeare") == 1, message  # was wrapped twice: "not found (... not found: ...)"
    assert message.startswith(f"Tiny Shakespeare not found: {tmp_path / 'tinyshakespeare' / 'input.txt'} does not exist")
    assert "TGATTN_DATA" in message


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "--attention", "bogus"],
         "argument --attention: invalid choice: 'bogus' (choose from 'graph', 'dense', 'indexer_topk', 'block_topk')"),
        (["train", "--attention", "indexer_topk", "--k-top", "0"], "--k-top must be >= 1 (got 0)"),
        (["train", "--attention", "block_topk", "--block", "0"], "--block must be >= 1 (got 0)"),
        (["train", "--attention", "indexer_topk", "--indexer-heads", "0"], "--indexer-heads must be >= 1 (got 0)"),
        (["train", "--attention", "indexer_topk", "--indexer-dim", "-2"], "--indexer-dim must be >= 1 (got -2)"),
        (["train", "--attention", "indexer_topk", "--indexer-warmup", "-1"], "--indexer-warmup must be >= 0 (got -1)"),
        (["train", "--indexer-warmup", "5"],
         "--indexer-warmup needs --attention 'indexer_topk' (got --indexer-warmup=5 with --attention 'graph')"),
        (["train", "--attention", "block_topk", "--pattern", "window"],
         "--attention 'block_topk' selects its own causal keys: --pattern must be 'causal' (got 'window')"),
        (["train", "--pattern", "spiral"], "argument --pattern: invalid choice: 'spiral'"),
        (["train", "--n-embd", "30", "--n-head", "4"], "--n-embd must be divisible by --n-head (got --n-embd=30, --n-head=4)"),
        (["train", "--eval-interval", "0"], "--eval-interval must be >= 1 (got 0)"),
        (["train", "--eval-iters", "0"], "--eval-iters must be >= 1 (got 0)"),
        (["train", "--max-iters", "-5"], "--max-iters must be >= 0 (got -5)"),
        (["train", "--lr", "nan"], "--lr must be > 0 and finite (got nan)"),
        (["train", "--dropout", "1"], "--dropout must be in [0, 1) (got 1.0)"),
        (["train", "--bias", "Treu"], "argument --bias: must be true or false (got 'Treu')"),
        (["train", "--threads", "-1"], "argument --threads: must be an integer >= 0 (got '-1')"),
        (["eval", "--eval-iters", "0"], "argument --eval-iters: must be an integer >= 1 (got '0')"),
        (["sample", "--top-k", "0"], "argument --top-k: must be an integer >= 1 (got '0')"),
        (["sample", "--temperature", "0"], "argument --temperature: must be a number > 0 (got '0')"),
        (["sample", "--temperature", "inf"], "argument --temperature: must be finite (got 'inf')"),
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


@pytest.mark.parametrize("attention, flags", [
    ("indexer_topk", ["--k-top", "3", "--indexer-heads", "2", "--indexer-dim", "4", "--indexer-warmup", "4"]),
    ("block_topk", ["--k-top", "2", "--block", "2"]),
])
def test_a_selecting_gpt_learns_and_its_checkpoint_evaluates_samples_and_resumes(tmp_path, capsys, cli, attention, flags):
    (tmp_path / "data" / "tinyshakespeare").mkdir(parents=True)
    (tmp_path / "data" / "tinyshakespeare" / "input.txt").write_text(TEXT)
    ckpt = tmp_path / "out" / "ckpt.pt"
    common = ["--data", str(tmp_path / "data"), "--out", str(tmp_path / "out"), *TINY, "--attention", attention, *flags,
              "--lr", "1e-2", "--lr-decay-iters", "20"]
    assert main(["train", *common, "--max-iters", "20", "--log", str(tmp_path / "log")]) == 0
    losses = [float(line.split(",")[1]) for line in (tmp_path / "log.steps.csv").read_text().splitlines()[1:]]
    assert len(losses) == 20 and sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.2
    state = torch.load(ckpt, weights_only=True)
    assert state["config"]["attention"] == attention and state["config"]["k_top"] == int(flags[1])
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(ckpt), "--data", str(tmp_path / "data"), "--eval-iters", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["val"] > 0
    assert main(["sample", "--checkpoint", str(ckpt), "--prompt", "First", "--num-tokens", "12"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("First") and len(text) == len("First") + 12 + 1
    assert main(["train", *common, "--max-iters", "22", "--resume"]) == 0
    assert torch.load(ckpt, weights_only=True)["iter"] == 22
    status, err = cli(main, ["train", *common, "--k-top", "5", "--max-iters", "24", "--resume"])
    assert status == 2 and one_line_error(err, "python -m tgattn.lm train").startswith(
        f"checkpoint {ckpt} holds a model with --k-top {flags[1]}; --resume cannot change it to --k-top 5")


def test_the_indexer_warmup_trains_only_the_indexers(tmp_path):
    (tmp_path / "data" / "tinyshakespeare").mkdir(parents=True)
    (tmp_path / "data" / "tinyshakespeare" / "input.txt").write_text(TEXT)
    assert main(["train", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "out"), *TINY, "--max-iters", "3",
                 "--attention", "indexer_topk", "--indexer-warmup", "3", "--seed", "5"]) == 0
    state = torch.load(tmp_path / "out" / "ckpt.pt", weights_only=True)
    torch.manual_seed(5)  # train() seeds the initialisation with --seed
    initial = GPT(GPTConfig(**state["config"])).state_dict()
    for name, weight in state["model"].items():
        assert torch.equal(weight, initial[name]) != (".indexer." in name), name


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


@pytest.mark.parametrize(
    "change, message",
    [
        ({"n_embd": 16}, "has weights that do not match its config (n_layer 1, n_embd 16, vocab_size 3, block_size 8, bias False): "
                         "'transformer.wte.weight' is [3, 8], the config needs [3, 16] (and 11 more)"),
        ({"n_layer": 2}, "has weights that do not match its config (n_layer 2, n_embd 8, vocab_size 3, block_size 8, bias False): "
                         "no weights for 'transformer.h.1.ln_1.weight' (and 7 more)"),
        ({"bias": True}, "has weights that do not match its config (n_layer 1, n_embd 8, vocab_size 3, block_size 8, bias True): "
                         "no weights for 'transformer.h.0.ln_1.bias' (and 8 more)"),
        ({"rope": True, "flash": 1}, "has config keys unknown to GPTConfig: 'flash', 'rope'"),
        ({"vocab_size": 4}, "has config vocab_size 4, but its vocabulary holds 3 characters"),
        ({"n_head": 3}, "has an invalid config: n_embd must be divisible by n_head (got n_embd=8, n_head=3)"),
        ({"n_embd": "8"}, "has config n_embd = '8' (a str), not an int"),
    ],
)
def test_a_config_that_does_not_fit_its_checkpoint_is_a_one_line_error(cli, checkpoint, tmp_path, change, message):
    state = torch.load(checkpoint, weights_only=True)
    bad = tmp_path / "bad.pt"
    save_checkpoint(bad, {**state, "config": {**state["config"], **change}})
    for command in (["sample"], ["eval", "--data", str(tmp_path)]):
        status, err = cli(main, [*command, "--checkpoint", str(bad)])
        assert status == 2 and one_line_error(err, f"python -m tgattn.lm {command[0]}") == f"checkpoint {bad} {message}"


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


def test_bench_train_times_any_attentions_side_by_side(capsys):
    assert main(["bench-train", "--models", "dense", "window", "indexer_topk", "block_topk", "--window", "3",
                 "--k-top", "8", "--block", "4", "--block-size", "16", "--batch-size", "1", "--steps", "1",
                 "--threads", "1"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert set(row) >= {"dense_ms", "window_ms", "indexer_topk_ms", "block_topk_ms", "window/dense",
                        "indexer_topk/dense", "block_topk/dense"}
    assert all(row[f"{name}_ms"] > 0 for name in ("dense", "window", "indexer_topk", "block_topk"))
    assert main(["bench-train", "--block-size", "8", "--batch-size", "1", "--steps", "1"]) == 0
    assert {"graph_ms", "dense_ms", "ratio"} <= set(json.loads(capsys.readouterr().out))  # the default pair
