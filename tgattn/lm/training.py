"""Training loop of the character GPT: AdamW, warm-up + cosine decay, validation, checkpoints.

The schedule and defaults follow nanoGPT's ``config/train_shakespeare_char.py`` with its
documented CPU run (block 64, batch 12, 4 layers, 4 heads, 128 wide, 2000 iterations).
Checkpoints (:mod:`tgattn.lm.checkpoint`) are written atomically, hold plain types only and
carry a checksum that :func:`load_checkpoint` verifies.
Resuming restores the model, the optimizer and the random state of batch sampling, so the
resumed run draws the same batches and reaches the same parameters as an uninterrupted one.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import Tensor

from ..models import GPT, GPTConfig
from .checkpoint import CheckpointError, checkpoint_config, load_checkpoint, save_checkpoint
from .config import TrainConfig
from .data import get_batch


RESUME_KEYS = ("iter", "optimizer", "best_val", "rng")  # what train() adds to a checkpoint, beyond the model


def resume_point(state: dict, checkpoint) -> int:
    """The iteration a loaded checkpoint resumes from.

    Raises:
        CheckpointError: naming ``checkpoint``, when it holds no training state (a model saved
            by :func:`tgattn.lm.save_checkpoint` alone) or its ``iter`` is not an integer >= 0.
    """
    missing = [key for key in RESUME_KEYS if key not in state]
    if missing:
        raise CheckpointError(f"checkpoint {checkpoint} cannot be resumed: it has no training state (keys {missing} are missing)")
    if not isinstance(state["iter"], int) or isinstance(state["iter"], bool) or state["iter"] < 0:
        raise CheckpointError(f"checkpoint {checkpoint} cannot be resumed: its iter is {state['iter']!r}, not an integer >= 0")
    return state["iter"]


def check_training_state(state: dict, checkpoint, optimizer: torch.optim.Optimizer) -> None:
    """Raise ``CheckpointError`` naming ``checkpoint`` when its training state does not fit this run.

    Checked as the model's tensors are (:func:`tgattn.lm.checkpoint_config`): the random states
    (``rng``: the batch sampler's and torch's) are byte tensors of the generator's state size,
    ``best_val`` is a number, and the optimizer state has this optimizer's parameter groups,
    with each moment shaped as its parameter; then the values (:func:`_check_values`). Otherwise
    ``load_state_dict`` and ``set_rng_state`` raised tracebacks, or wrong moments loaded and failed
    at the first step.
    """
    where = f"checkpoint {checkpoint} cannot be resumed"
    size = torch.get_rng_state().shape
    rng = state["rng"]
    if not isinstance(rng, dict) or sorted(rng) != ["batches", "torch"]:
        raise CheckpointError(f"{where}: its rng is not a dict of 'batches' and 'torch' random states (got {_kind(rng)})")
    for key, value in rng.items():
        if not isinstance(value, Tensor) or value.dtype != torch.uint8 or value.shape != size:
            raise CheckpointError(f"{where}: its rng {key!r} is {_kind(value)}, not a uint8 random state of shape {list(size)}")
    if not isinstance(state["best_val"], (int, float)) or isinstance(state["best_val"], bool):
        raise CheckpointError(f"{where}: its best_val is {state['best_val']!r}, not a number")
    saved, mine = state["optimizer"], optimizer.state_dict()
    if not isinstance(saved, dict) or not isinstance(saved.get("state"), dict) \
            or not isinstance(saved.get("param_groups"), list):
        raise CheckpointError(f"{where}: its optimizer state is not an optimizer's state dict (got {_kind(saved)})")
    counts = [len(group.get("params", ())) if isinstance(group, dict) else None for group in saved["param_groups"]]
    if counts != [len(group["params"]) for group in mine["param_groups"]]:
        raise CheckpointError(f"{where}: its optimizer has parameter groups of {counts} tensors, this model's "
                              f"{[len(group['params']) for group in mine['param_groups']]}")
    params = dict(zip((i for group in saved["param_groups"] for i in group["params"]),
                      (p for group in optimizer.param_groups for p in group["params"])))
    for index, moments in saved["state"].items():
        if index not in params or not isinstance(moments, dict):
            raise CheckpointError(f"{where}: its optimizer holds state for parameter {index!r}, which it does not list")
        for name, value in moments.items():
            if name != "step" and (not isinstance(value, Tensor) or value.shape != params[index].shape):
                raise CheckpointError(f"{where}: its optimizer's {name} of parameter {index} is {_kind(value)}, "
                                      f"the parameter is {list(params[index].shape)}")
    _check_values(state, where)


def _check_values(state: dict, where: str) -> None:
    """Refuse the values that poison the first step although every shape fits.

    Adam divides by ``sqrt(exp_avg_sq) + eps`` and scales by ``1 - beta ** step``: a NaN or inf
    moment, a negative second moment (its square root is NaN), a non-finite or negative step
    count, a non-finite hyper-parameter or weight made every weight NaN at the first step, and
    the run then overwrote its checkpoint with them.
    """
    best = state["best_val"]
    if not best >= 0:  # inf is the value before the first validation; NaN fails the comparison
        raise CheckpointError(f"{where}: its best_val is {best!r}, not a loss >= 0")
    bad = [name for name, t in state["model"].items() if not torch.isfinite(t).all()]
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise CheckpointError(f"{where}: its weights {bad[0]!r} hold NaN or inf{more}")
    for index, moments in state["optimizer"]["state"].items():
        for name, value in moments.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):  # a step count saved as a number
                value = torch.as_tensor(value)
            real = isinstance(value, Tensor) and (value.is_floating_point() or name == "step" and not value.is_complex())
            if not real:
                raise CheckpointError(f"{where}: its optimizer's {name} of parameter {index} is {_kind(value)}, "
                                      "not real numbers")
            if not torch.isfinite(value).all():
                raise CheckpointError(f"{where}: its optimizer's {name} of parameter {index} holds NaN or inf")
            if name in ("step", "exp_avg_sq", "max_exp_avg_sq") and (value < 0).any():
                raise CheckpointError(f"{where}: its optimizer's {name} of parameter {index} holds a negative value "
                                      f"({float(value.min()):g})")
    for number, group in enumerate(state["optimizer"]["param_groups"]):
        for name, value in group.items():
            values = value if isinstance(value, (list, tuple)) and name != "params" else [value]
            if any(isinstance(v, float) and not math.isfinite(v) for v in values):
                raise CheckpointError(f"{where}: its optimizer's {name} of parameter group {number} is {value!r}, "
                                      "not finite")


def _kind(value) -> str:
    return f"{value.dtype} {list(value.shape)}" if isinstance(value, Tensor) else type(value).__name__


def lr_at(it: int, cfg: TrainConfig) -> float:
    """Linear warm-up to ``lr``, then cosine decay to ``min_lr`` at ``lr_decay_iters``.

    Example:
        >>> cfg = TrainConfig()
        >>> round(lr_at(0, cfg), 8), lr_at(100, cfg), round(lr_at(1050, cfg), 6), lr_at(5000, cfg)
        (9.9e-06, 0.001, 0.00055, 0.0001)
    """
    if it < cfg.warmup_iters:
        return cfg.lr * (it + 1) / (cfg.warmup_iters + 1)
    if it >= cfg.lr_decay_iters:
        return cfg.min_lr
    ratio = (it - cfg.warmup_iters) / (cfg.lr_decay_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg.lr - cfg.min_lr)


@torch.no_grad()
def evaluate(model: GPT, ids: Tensor, *, batch_size: int, iters: int, seed: int, progress: Optional[str] = None) -> float:
    """Mean loss over ``iters`` batches drawn from a fresh generator (the same batches every call).

    ``progress``: the label of a tqdm bar over the batches, removed when done (default: no bar).
    """
    from tqdm import tqdm

    was_training = model.training
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    batches = tqdm(range(iters), desc=progress, disable=progress is None, leave=False)
    losses = [model(*get_batch(ids, model.config.block_size, batch_size, generator))[1] for _ in batches]
    model.train(was_training)
    return float(torch.stack(losses).mean())


def train(
    model_config: GPTConfig,
    cfg: TrainConfig,
    train_ids: Tensor,
    val_ids: Tensor,
    vocab: str,
    *,
    checkpoint: Optional[Path] = None,
    resume: bool = False,
    progress: bool = True,
    on_step: Optional[Callable[[int, float], None]] = None,
) -> dict:
    """Train a GPT; return its history ``{"steps": [...], "evals": [...], "model": GPT}``.

    Args:
        model_config: the model (ignored when resuming: the checkpoint's config is used).
        cfg: optimisation and bookkeeping settings.
        train_ids, val_ids: token ids of the two splits.
        vocab: the tokenizer's characters in id order (stored in the checkpoint).
        checkpoint: where to write checkpoints (every ``cfg.checkpoint_interval`` steps and
            at the end); ``None`` writes none.
        resume: continue from ``checkpoint`` up to ``cfg.max_iters``. A checkpoint already at
            ``max_iters`` takes no step and is not written again; one past it is refused.
        progress: show a tqdm bar with the loss and tokens/s.
        on_step: called as ``on_step(iter, loss)`` after each optimizer step.

    A model with indexers (``attention="indexer_topk"``) also minimises their loss (the KL
    from each layer's attention to its indexer's scores); during the first
    ``model_config.indexer_warmup`` steps it attends densely and only the indexers learn.

    ``steps`` holds ``{"iter", "loss", "lr", "seconds"}`` per step (``seconds`` of the step
    alone); ``evals`` holds ``{"iter", "train", "val"}`` per validation.

    Raises:
        ValueError: before the first step, when a split has no more tokens than ``block_size``
            (validation would fail after training), the checkpoint's vocabulary differs or the
            checkpoint is past ``cfg.max_iters`` (resuming never takes a run back).
        CheckpointError: when resuming from a damaged checkpoint, one whose config does not
            match its weights, or one without training state or with a training state of other
            shapes or of non-finite values (:func:`check_training_state`).
        ValueError: when training diverges (a non-finite loss, or non-finite weights when a
            checkpoint is due): the last checkpoint is kept, never replaced by NaN weights.
    """
    torch.manual_seed(cfg.seed)
    batches = torch.Generator().manual_seed(cfg.seed)
    state = load_checkpoint(checkpoint) if resume else None
    if state is not None:
        model_config = checkpoint_config(state, checkpoint)
        if resume_point(state, checkpoint) > cfg.max_iters:
            raise ValueError(
                f"checkpoint {checkpoint} is at iteration {state['iter']}, past max_iters {cfg.max_iters}: "
                "resuming cannot take it back"
            )
    for name, ids in (("training", train_ids), ("validation", val_ids)):  # refused now, not at the first validation
        if len(ids) <= model_config.block_size:
            raise ValueError(
                f"the {name} split has {len(ids)} tokens, too few for block_size {model_config.block_size}: "
                "use a longer corpus or a smaller block_size"
            )
    model = GPT(model_config)
    optimizer = model.configure_optimizer(lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, cfg.beta2))
    start, best_val = 0, float("inf")
    if state is not None:
        if state["vocab"] != vocab:
            raise ValueError(f"checkpoint {checkpoint} was trained with another vocabulary")
        check_training_state(state, checkpoint, optimizer)
        model.load_state_dict(state["model"])  # its names and shapes checked by checkpoint_config
        optimizer.load_state_dict(state["optimizer"])
        start, best_val = state["iter"], state["best_val"]
        batches.set_state(state["rng"]["batches"])
        torch.set_rng_state(state["rng"]["torch"])

    def snapshot(it: int) -> dict:
        return {
            "model": model.state_dict(),
            "config": asdict(model_config),
            "vocab": vocab,
            "iter": it,
            "optimizer": optimizer.state_dict(),
            "best_val": best_val,
            "rng": {"batches": batches.get_state(), "torch": torch.get_rng_state()},
            "train_config": asdict(cfg),
        }

    def save(it: int) -> None:
        bad = [name for name, p in model.named_parameters() if not torch.isfinite(p).all()]
        if bad:  # a good checkpoint is never replaced by a diverged model
            raise ValueError(f"training diverged: weights {bad[0]!r} hold NaN or inf at iteration {it}; "
                             f"checkpoint {checkpoint} is kept as it was")
        save_checkpoint(checkpoint, snapshot(it))

    def validate(it: int) -> None:
        nonlocal best_val
        kw = dict(batch_size=cfg.batch_size, iters=cfg.eval_iters, seed=cfg.seed + 1)
        row = {"iter": it, **{split: evaluate(model, ids, **kw, progress=f"iter {it}: {split} loss" if progress else None)
                              for split, ids in (("train", train_ids), ("val", val_ids))}}
        best_val = min(best_val, row["val"])
        history["evals"].append(row)
        if progress:
            tqdm.write(f"iter {it}: train loss {row['train']:.4f}, val loss {row['val']:.4f}")

    from tqdm import tqdm

    history = {"steps": [], "evals": [], "model": model}
    bar = tqdm(total=cfg.max_iters, initial=start, desc=f"train {model_config.attention}") if progress else None
    model.train()
    tokens = cfg.batch_size * model_config.block_size
    for it in range(start, cfg.max_iters):
        if it % cfg.eval_interval == 0 and it > start:
            validate(it)
        if checkpoint is not None and it % cfg.checkpoint_interval == 0 and it > start:
            save(it)
        t0 = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(it, cfg)
        x, y = get_batch(train_ids, model_config.block_size, cfg.batch_size, batches)
        if model.has_indexer:
            warmup = it < model_config.indexer_warmup  # DeepSeek's warm-up: dense attention, only the indexer learns
            _, loss, kl = model(x, y, dense=warmup, return_indexer_loss=True)
            (kl if warmup else loss + kl).backward()  # the two losses reach disjoint parameters
        else:
            _, loss = model(x, y)
            loss.backward()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - t0
        if not math.isfinite(loss.item()):  # every later step and checkpoint would hold NaN: stop now
            kept = f"; checkpoint {checkpoint} is kept as it was" if checkpoint is not None else ""
            raise ValueError(f"training diverged: the loss is {loss.item()} at iteration {it}{kept}")
        history["steps"].append({"iter": it, "loss": loss.item(), "lr": lr_at(it, cfg), "seconds": seconds})
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{tokens / seconds:.0f}")
        if on_step is not None:
            on_step(it, loss.item())
    if bar is not None:
        bar.close()  # the final evaluation shows its own bars
    if start < cfg.max_iters or not history["evals"]:
        validate(cfg.max_iters)
    if checkpoint is not None and (state is None or start < cfg.max_iters):  # resumed with no step to take: left as it was
        save(cfg.max_iters)
    return history
