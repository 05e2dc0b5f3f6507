"""Training loop: schedule, checkpoints loadable with weights_only=True, and exact resume."""
import re
from dataclasses import replace

import pytest
import torch

from tgattn.lm import (CharTokenizer, CheckpointError, TrainConfig, load_checkpoint, lr_at, model_from_checkpoint,
                       save_checkpoint, split, train)
from tgattn.lm.data import get_batch, load_corpus
from tgattn.models import GPTConfig

TEXT = "to be or not to be, that is the question: whether 'tis nobler in the mind to suffer\n" * 20
MODEL = GPTConfig(block_size=8, n_layer=1, n_head=2, n_embd=16, dropout=0.1)
CFG = TrainConfig(max_iters=6, batch_size=4, warmup_iters=2, lr_decay_iters=6, eval_interval=3, eval_iters=2, checkpoint_interval=2)


class Killed(Exception):
    pass


def corpus():
    tok = CharTokenizer.from_text(TEXT)
    return (*split(tok.encode(TEXT)), tok)


def run(tmp_path, cfg=CFG, **kw):
    train_ids, val_ids, tok = corpus()
    config = GPTConfig(**{**MODEL.__dict__, "vocab_size": len(tok)})
    return train(config, cfg, train_ids, val_ids, tok.vocab, checkpoint=tmp_path / "ckpt.pt", progress=False, **kw)


def test_resume_after_a_kill_continues_the_same_run(tmp_path):
    whole = run(tmp_path / "a")

    def kill_at_5(it, loss):
        if it == 4:  # after 5 steps; the last checkpoint holds 4 steps (interval 2)
            raise Killed

    with pytest.raises(Killed):
        run(tmp_path / "b", on_step=kill_at_5)
    assert load_checkpoint(tmp_path / "b" / "ckpt.pt")["iter"] == 4  # lost: 1 step < one interval
    resumed = run(tmp_path / "b", resume=True)
    assert [s["iter"] for s in resumed["steps"]] == [4, 5]
    assert [s["loss"] for s in resumed["steps"]] == [s["loss"] for s in whole["steps"][4:]]  # dropout RNG too
    for (name, p), q in zip(whole["model"].named_parameters(), resumed["model"].parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
    assert resumed["evals"][-1] == whole["evals"][-1]


def test_resume_never_takes_a_run_back(tmp_path):
    steps = []
    run(tmp_path)  # 6 steps
    ckpt = tmp_path / "ckpt.pt"
    saved = ckpt.read_bytes()
    with pytest.raises(ValueError, match=re.escape(f"checkpoint {ckpt} is at iteration 6, past max_iters 4: resuming")):
        run(tmp_path, replace(CFG, max_iters=4), resume=True, on_step=lambda it, loss: steps.append(it))
    done = run(tmp_path, resume=True, on_step=lambda it, loss: steps.append(it))  # already at max_iters: nothing to do
    assert steps == [] and done["steps"] == [] and [e["iter"] for e in done["evals"]] == [6]
    assert ckpt.read_bytes() == saved  # neither relabelled nor written again


def test_resume_checks_the_checkpoint_first(tmp_path):
    run(tmp_path)
    state = load_checkpoint(tmp_path / "ckpt.pt")
    save_checkpoint(tmp_path / "ckpt.pt", {**state, "config": {**state["config"], "n_layer": 2}})
    with pytest.raises(CheckpointError, match="has weights that do not match its config .*: no weights for 'transformer.h.1"):
        run(tmp_path, resume=True)
    save_checkpoint(tmp_path / "ckpt.pt", {key: state[key] for key in ("model", "config", "vocab")})
    with pytest.raises(CheckpointError, match=r"cannot be resumed: it has no training state \(keys \['iter', 'optimizer'"):
        run(tmp_path, resume=True)


def test_checkpoint_holds_plain_types_and_rebuilds_the_model(tmp_path):
    history = run(tmp_path)
    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert {"model", "config", "vocab", "iter", "optimizer", "best_val"} <= state.keys()
    assert state["iter"] == 6 and state["vocab"] == CharTokenizer.from_text(TEXT).vocab
    assert state["best_val"] == min(e["val"] for e in history["evals"])
    assert not (tmp_path / "ckpt.pt.tmp").exists()
    model = model_from_checkpoint(state)
    x = torch.randint(len(state["vocab"]), (2, 8))
    history["model"].eval()
    torch.testing.assert_close(model(x)[0], history["model"](x)[0], rtol=0, atol=0)


def test_lr_schedule_warms_up_then_decays():
    cfg = TrainConfig(lr=1.0, min_lr=0.1, warmup_iters=10, lr_decay_iters=110)
    lrs = [lr_at(i, cfg) for i in range(120)]
    assert lrs[0] == pytest.approx(1 / 11) and lrs[10] == 1.0 and lrs[60] == pytest.approx(0.55) and lrs[115] == 0.1
    assert all(a <= b for a, b in zip(lrs[:11], lrs[1:11])) and all(a >= b for a, b in zip(lrs[10:], lrs[11:]))


def test_tokenizer_split_and_batches():
    tok = CharTokenizer.from_text(TEXT)
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT and len(tok) == len(set(TEXT))
    train_ids, val_ids = split(ids)
    assert len(train_ids) == int(0.9 * len(ids)) and torch.equal(torch.cat([train_ids, val_ids]), ids)
    x, y = get_batch(train_ids, 8, 3, torch.Generator().manual_seed(0))
    assert x.shape == (3, 8) and torch.equal(x[:, 1:], y[:, :-1])
    with pytest.raises(ValueError, match="not in the vocabulary"):
        tok.encode("Z")


def test_missing_corpus_says_where_to_put_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="TGATTN_DATA"):
        load_corpus(tmp_path)


def test_shakespeare_vocabulary(data_root):
    tok = CharTokenizer.from_text(load_corpus(data_root))
    assert len(tok) == 65 and tok.vocab[0] == "\n"
