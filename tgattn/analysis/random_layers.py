"""Seeded random attention layers over a text (``python -m tgattn show`` without a model), whole or streamed.

:func:`random_attention` returns every layer's weights; :func:`random_attention_blocks` makes the
same weights one block of queries at a time, so that the page data (:mod:`tgattn.analysis.streamed`)
keeps only what it shows: memory follows the kept keys, not the ``N^2 / 2`` edges of a causal text.
"""
from __future__ import annotations

from typing import Iterator, List, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from ..nn.attention import GraphAttention
from .budget import DIM, ROWS, key_ranges
from .streamed import Block
from .weights import Layer


def random_attention(tokens: Sequence[str], edge_index, *, layers: int = 2, heads: int = 2, dim: int = DIM,
                     seed: int = 0) -> List[Layer]:
    """Attention of ``layers`` random (seeded) GraphAttention layers with residuals over ``tokens``.

    Equal tokens share a random embedding; a random position embedding tells them apart.
    The global random state is left untouched.

    Example:
        >>> from tgattn import builders
        >>> ei = builders.causal(4)
        >>> att = random_attention("The sky is blue".split(), ei, layers=3)
        >>> len(att), att[0][1].shape
        (3, torch.Size([10, 2]))
        >>> torch.equal(att[2][1], random_attention("The sky is blue".split(), ei, layers=3)[2][1])
        True
    """
    x, stack = _random_stack(tokens, layers, heads, dim, seed)
    attention = []
    with torch.no_grad():
        for layer in stack:
            out, (ei, alpha) = layer(x, edge_index, return_attention_weights=True)
            attention.append((ei, alpha))
            x = F.layer_norm(x + out, (dim,))
    return attention


def random_attention_blocks(tokens: Sequence[str], pattern: str, *, window: int = 2, layers: int = 2, heads: int = 2,
                            dim: int = DIM, seed: int = 0) -> Iterator[Block]:
    """The weights of :func:`random_attention` over ``pattern``, made :data:`~tgattn.analysis.budget.ROWS`
    queries at a time: layer by layer, a :class:`~tgattn.analysis.streamed.Block` per run of queries.

    A block's edge set holds only its queries' edges, so each layer sees at most ``ROWS`` rows of
    weights at once; the next layer's input is the whole layer's output, ``[N, D]``.

    Example (the same weights as the whole layer, block by block):
        >>> from tgattn import builders
        >>> words = "The sky is blue".split()
        >>> whole = random_attention(words, builders.causal(4), layers=2)
        >>> blocks = list(random_attention_blocks(words, "causal", layers=2))
        >>> [(b.layer, b.start) for b in blocks], torch.allclose(blocks[1].alpha, whole[1][1])
        ([(0, 0), (1, 0)], True)
    """
    n = len(tokens)
    lo, hi = key_ranges(pattern, n, window)
    x, stack = _random_stack(tokens, layers, heads, dim, seed)
    with torch.no_grad():
        for number, layer in enumerate(stack):
            out = torch.empty_like(x)  # [N, D]
            for start in range(0, n, ROWS):
                stop = min(start + ROWS, n)
                edge_index = _run_edges(lo[start:stop], hi[start:stop], start)  # [2, E_b]
                block_out, (ei, alpha) = layer(x, edge_index, return_attention_weights=True)
                out[start:stop] = block_out[start:stop]  # the other rows have no edge here
                yield Block(number, start, ei, alpha)
            x = F.layer_norm(x + out, (dim,))


def _run_edges(lo: np.ndarray, hi: np.ndarray, start: int) -> torch.Tensor:
    """The edges ``(j, i)`` of queries ``start, start + 1, ...`` with keys ``[lo[r], hi[r])``, sorted by (i, j)."""
    counts = hi - lo
    queries = np.repeat(np.arange(start, start + len(counts)), counts)
    keys = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts) + np.repeat(lo, counts)
    return torch.from_numpy(np.stack([keys, queries]).astype(np.int64))


def _random_stack(tokens: Sequence[str], layers: int, heads: int, dim: int, seed: int) -> Tuple[torch.Tensor, list]:
    """The input ``[T, D]`` and the seeded layers (the global random state left untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vocab = {token: number for number, token in enumerate(sorted(set(tokens)))}
        embed = torch.randn(len(vocab), dim)  # [V, D]
        position = 0.5 * torch.randn(len(tokens), dim)  # [T, D]
        stack = [GraphAttention(dim, heads) for _ in range(layers)]
    x = embed[torch.tensor([vocab[t] for t in tokens], dtype=torch.long)] + position  # [T, D]
    return x, stack
