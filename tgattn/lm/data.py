"""Characters of Tiny Shakespeare as token ids: tokenizer, 90/10 split, random batches."""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from ..datasets import load_tiny_shakespeare

class CharTokenizer:
    """One id per distinct character of a corpus, in sorted order (nanoGPT's shakespeare_char).

    Example:
        >>> tok = CharTokenizer.from_text("hello")
        >>> tok.vocab, tok.encode("hole").tolist(), tok.decode([3, 1])
        ('ehlo', [1, 3, 2, 0], 'oh')
    """

    def __init__(self, vocab: str):
        if len(set(vocab)) != len(vocab):
            raise ValueError(f"vocab holds repeated characters: {vocab!r}")
        self.vocab = vocab
        self._ids = {c: i for i, c in enumerate(vocab)}

    @classmethod
    def from_text(cls, text: str) -> "CharTokenizer":
        return cls("".join(sorted(set(text))))

    def __len__(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> Tensor:
        unknown = sorted(set(text) - self._ids.keys())
        if unknown:
            raise ValueError(f"characters not in the vocabulary: {''.join(unknown)!r}")
        return torch.tensor([self._ids[c] for c in text], dtype=torch.long)

    def decode(self, ids) -> str:
        return "".join(self.vocab[int(i)] for i in ids)


def load_corpus(data: Optional[Union[str, Path]] = None) -> str:
    """The corpus text, from ``data`` or ``TGATTN_DATA`` (:func:`tgattn.datasets.load_tiny_shakespeare`).

    Raises:
        FileNotFoundError: one message naming the corpus, where it looked and how to get it.
    """
    return load_tiny_shakespeare(data)


def split(ids: Tensor, train_fraction: float = 0.9) -> Tuple[Tensor, Tensor]:
    """The first ``train_fraction`` of the ids for training, the rest for validation."""
    if not 0.0 < train_fraction < 1.0:
        raise ValueError(f"train_fraction must be in (0, 1) (got {train_fraction})")
    n = int(train_fraction * len(ids))
    return ids[:n], ids[n:]


def get_batch(ids: Tensor, block_size: int, batch_size: int, generator: torch.Generator) -> Tuple[Tensor, Tensor]:
    """``batch_size`` random windows ``x [B, T]`` and their next characters ``y [B, T]``.

    Example:
        >>> x, y = get_batch(torch.arange(100), 8, 4, torch.Generator().manual_seed(0))
        >>> x.shape, bool((y == x + 1).all())
        (torch.Size([4, 8]), True)
    """
    if len(ids) <= block_size:
        raise ValueError(f"the text has {len(ids)} tokens, too few for block_size {block_size}")
    start = torch.randint(len(ids) - block_size, (batch_size,), generator=generator)  # [B]
    offsets = start.unsqueeze(1) + torch.arange(block_size)  # [B, T]
    return ids[offsets], ids[offsets + 1]
