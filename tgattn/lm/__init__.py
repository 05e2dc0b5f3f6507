"""A character-level language model on Tiny Shakespeare: ``python -m tgattn.lm train|sample|eval``."""
from .checkpoint import CheckpointError, load_checkpoint, model_from_checkpoint, save_checkpoint, state_digest
from .data import CharTokenizer, get_batch, load_corpus, split
from .train import TrainConfig, evaluate, lr_at, train

__all__ = [
    "CharTokenizer",
    "CheckpointError",
    "TrainConfig",
    "evaluate",
    "get_batch",
    "load_checkpoint",
    "load_corpus",
    "lr_at",
    "model_from_checkpoint",
    "save_checkpoint",
    "split",
    "state_digest",
    "train",
]
