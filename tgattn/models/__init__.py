"""Models built on graph attention: a nanoGPT-style character GPT and its dense twin.

Layer "applications" (with models, lm, hf, distributed, analysis, verify): built on the layers
below, never importing a benchmark or a command line (docs/conventions.md, "Layering").
"""
from .._cli import lazy_exports

__all__ = ["GPT", "GPTConfig", "PATTERNS", "generate", "make_pattern"]

__getattr__, __dir__ = lazy_exports(
    __name__,
    {"GPT": "gpt", "GPTConfig": "config", "PATTERNS": "config", "generate": "decode", "make_pattern": "patterns"},
)
