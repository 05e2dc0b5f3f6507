"""Configuration of the character GPT, importable without torch (the command line reads it)."""
from __future__ import annotations

from dataclasses import dataclass

PATTERNS = ("causal", "window", "dilated", "bigbird")
ATTENTIONS = ("graph", "dense")


@dataclass
class GPTConfig:
    """Sizes and attention of :class:`tgattn.models.GPT`, checked when created.

    Example:
        >>> GPTConfig(n_embd=64, n_head=4).n_embd // 4
        16
        >>> GPTConfig(n_embd=30, n_head=4)
        Traceback (most recent call last):
        ...
        ValueError: n_embd must be divisible by n_head (got n_embd=30, n_head=4)
    """

    block_size: int = 64  # longest context; learned positions 0 .. block_size - 1 (nanoGPT CPU run)
    vocab_size: int = 65  # distinct characters of Tiny Shakespeare
    n_layer: int = 4  # transformer blocks (nanoGPT CPU run)
    n_head: int = 4  # attention heads per block
    n_embd: int = 128  # model width D
    dropout: float = 0.0  # dropout on embeddings, attention weights and residual branches
    bias: bool = False  # biases in Linear and LayerNorm (nanoGPT's default: none)
    attention: str = "graph"  # "graph": GraphAttention over edges; "dense": the SDPA twin with the mask
    pattern: str = "causal"  # "causal", "window", "dilated" or "bigbird" (see make_pattern)
    window: int = 32  # window radius w of window / dilated / bigbird: keys i - w .. i
    dilation: int = 2  # stride between keys of the dilated pattern
    num_global: int = 1  # bigbird: leading tokens every query sees
    num_random: int = 4  # bigbird: random earlier keys per query
    pattern_seed: int = 0  # seed of bigbird's random keys (drawn once per (B, T))

    def __post_init__(self):
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention must be 'graph' or 'dense' (got {self.attention!r})")
        if self.pattern not in PATTERNS:
            raise ValueError(f"unknown attention pattern {self.pattern!r}; choose one of {PATTERNS}")
        for name, minimum in (("block_size", 1), ("vocab_size", 1), ("n_layer", 1), ("n_head", 1), ("n_embd", 1),
                              ("window", 0), ("dilation", 1), ("num_global", 0), ("num_random", 0)):
            if getattr(self, name) < minimum:
                raise ValueError(f"{name} must be >= {minimum} (got {getattr(self, name)!r})")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd must be divisible by n_head (got n_embd={self.n_embd}, n_head={self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1) (got {self.dropout!r})")
