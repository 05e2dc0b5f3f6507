"""Configuration of the character GPT, importable without torch (the command line reads it)."""
from __future__ import annotations

from dataclasses import dataclass

PATTERNS = ("causal", "window", "dilated", "bigbird")
SELECTIONS = ("indexer_topk", "block_topk")  # attentions that choose their keys per forward (tgattn.models.indexer)
ATTENTIONS = ("graph", "dense", *SELECTIONS)


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
    attention: str = "graph"  # "graph": GraphAttention over edges; "dense": the SDPA twin with the mask;
    # "indexer_topk" / "block_topk": graph attention whose keys each layer selects per forward
    pattern: str = "causal"  # "causal", "window", "dilated" or "bigbird" (see make_pattern)
    window: int = 32  # window radius w of window / dilated / bigbird: keys i - w .. i
    dilation: int = 2  # stride between keys of the dilated pattern
    num_global: int = 1  # bigbird: leading tokens every query sees
    num_random: int = 4  # bigbird: random earlier keys per query
    pattern_seed: int = 0  # seed of bigbird's random keys (drawn once per (B, T))
    k_top: int = 64  # indexer_topk: keys per query; block_topk: blocks per query (its own included)
    block: int = 16  # block_topk: keys per block (MoBA's block size)
    indexer_heads: int = 4  # indexer_topk: indexer heads HI (DeepSeek-V3.2: 64)
    indexer_dim: int = 32  # indexer_topk: indexer head dimension dI (DeepSeek-V3.2: 128)
    indexer_warmup: int = 0  # indexer_topk: first training steps that train only the indexer, attention dense

    def __post_init__(self):
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS} (got {self.attention!r})")
        if self.pattern not in PATTERNS:
            raise ValueError(f"unknown attention pattern {self.pattern!r}; choose one of {PATTERNS}")
        for name, minimum in (("block_size", 1), ("vocab_size", 1), ("n_layer", 1), ("n_head", 1), ("n_embd", 1),
                              ("window", 0), ("dilation", 1), ("num_global", 0), ("num_random", 0), ("k_top", 1),
                              ("block", 1), ("indexer_heads", 1), ("indexer_dim", 1), ("indexer_warmup", 0)):
            if getattr(self, name) < minimum:
                raise ValueError(f"{name} must be >= {minimum} (got {getattr(self, name)!r})")
        if self.attention in SELECTIONS and self.pattern != "causal":
            raise ValueError(f"attention {self.attention!r} selects its own causal keys: pattern must be 'causal' (got {self.pattern!r})")
        if self.indexer_warmup and self.attention != "indexer_topk":
            raise ValueError(f"indexer_warmup needs attention 'indexer_topk' (got indexer_warmup={self.indexer_warmup} "
                             f"with attention {self.attention!r})")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd must be divisible by n_head (got n_embd={self.n_embd}, n_head={self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1) (got {self.dropout!r})")
