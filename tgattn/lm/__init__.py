"""A character-level language model on Tiny Shakespeare: ``python -m tgattn.lm train|sample|eval``."""
from .data import CharTokenizer, get_batch, load_corpus, split
from .train import TrainConfig, evaluate, load_checkpoint, lr_at, model_from_checkpoint, save_checkpoint, train

__all__ = [
    "CharTokenizer",
    "TrainConfig",
    "evaluate",
    "get_batch",
    "load_checkpoint",
    "load_corpus",
    "lr_at",
    "model_from_checkpoint",
    "save_checkpoint",
    "split",
    "train",
]
