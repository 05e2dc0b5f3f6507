"""A character-level language model on Tiny Shakespeare: ``python -m tgattn.lm train|sample|eval``.

Layer "applications" (with models, lm, hf, distributed, analysis, verify): built on the layers
below, never importing a benchmark or a command line (docs/conventions.md, "Layering").
Its benchmark, :mod:`tgattn.lm.bench`, sits with the benchmarks.
"""
from .._cli import lazy_exports

__all__ = [
    "CharTokenizer",
    "CheckpointError",
    "TrainConfig",
    "checkpoint_config",
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

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        **dict.fromkeys(
            ["CheckpointError", "checkpoint_config", "load_checkpoint", "model_from_checkpoint", "save_checkpoint", "state_digest"],
            "checkpoint",
        ),
        **dict.fromkeys(["CharTokenizer", "get_batch", "load_corpus", "split"], "data"),
        "TrainConfig": "config",
        **dict.fromkeys(["evaluate", "lr_at", "train"], "training"),
    },
)
