"""Models built on graph attention: a nanoGPT-style character GPT and its dense twin."""
from .._lazy import lazy_exports

__all__ = ["GPT", "GPTConfig", "PATTERNS", "generate", "make_pattern"]

__getattr__, __dir__ = lazy_exports(
    __name__,
    {"GPT": "gpt", "GPTConfig": "config", "PATTERNS": "config", "generate": "decode", "make_pattern": "patterns"},
)
