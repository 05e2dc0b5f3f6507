"""Models built on graph attention: a nanoGPT-style character GPT and its dense twin."""
from .decode import generate
from .gpt import GPT, GPTConfig
from .patterns import PATTERNS, make_pattern

__all__ = ["GPT", "GPTConfig", "PATTERNS", "generate", "make_pattern"]
