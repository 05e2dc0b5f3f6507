"""Training settings of the character GPT, importable without torch (the command line reads them)."""
from __future__ import annotations

import math
from dataclasses import dataclass

SEED_LIMIT = 2**63  # seeds are in [0, SEED_LIMIT)


@dataclass
class TrainConfig:
    """Optimisation and bookkeeping of :func:`tgattn.lm.train`, checked when created.

    Example:
        >>> TrainConfig(max_iters=10).lr_decay_iters
        2000
        >>> TrainConfig(eval_interval=0)
        Traceback (most recent call last):
        ...
        ValueError: eval_interval must be >= 1 (got 0)
    """

    max_iters: int = 2000  # optimizer steps
    batch_size: int = 12  # sequences per step
    lr: float = 1e-3  # peak learning rate
    min_lr: float = 1e-4  # floor of the cosine decay (lr / 10)
    warmup_iters: int = 100  # linear warm-up steps
    lr_decay_iters: int = 2000  # the cosine reaches min_lr here
    weight_decay: float = 0.1  # AdamW decay of matrices
    beta2: float = 0.99  # AdamW beta2 (small batches: a shorter memory)
    grad_clip: float = 1.0  # clip the global gradient norm (0 = off)
    eval_interval: int = 250  # validate every so many steps
    eval_iters: int = 200  # batches per validation estimate
    checkpoint_interval: int = 250  # write a checkpoint every so many steps
    seed: int = 1337  # model initialisation and batch sampling

    def __post_init__(self):
        for name, minimum in (("max_iters", 0), ("batch_size", 1), ("warmup_iters", 0), ("lr_decay_iters", 0),
                              ("eval_interval", 1), ("eval_iters", 1), ("checkpoint_interval", 1), ("seed", 0)):
            if getattr(self, name) < minimum:
                raise ValueError(f"{name} must be >= {minimum} (got {getattr(self, name)!r})")
        if self.seed >= SEED_LIMIT:
            raise ValueError(f"seed must be < 2**63 (got {self.seed})")
        for name, ok, rule in (("lr", 0 < self.lr < math.inf, "> 0 and finite"),
                               ("min_lr", 0 <= self.min_lr < math.inf, ">= 0 and finite"),
                               ("weight_decay", 0 <= self.weight_decay < math.inf, ">= 0 and finite"),
                               ("beta2", 0 <= self.beta2 < 1, "in [0, 1)"),
                               ("grad_clip", 0 <= self.grad_clip < math.inf, ">= 0 and finite")):
            if not ok:  # NaN fails every comparison; an infinite lr made every weight NaN at the first step
                raise ValueError(f"{name} must be {rule} (got {getattr(self, name)!r})")
