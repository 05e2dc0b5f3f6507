"""The influence page's defaults and size budget, without torch (the command line checks them first)."""
from __future__ import annotations

from typing import Tuple

import numpy as np

TOP_K = 10  # keys kept per token and view by default
THRESHOLD = 1e-3  # weights below are dropped by default
MAX_BYTES = 64_000_000  # the default budget: pages beyond it open slowly or not at all in a browser
DIM = 32  # width of the random layers
FLOW_EDGES = 300_000  # the largest flow cone solved for the data, and the most edges all tokens' cones may hold together


def estimate_bytes(num_tokens: int, num_layers: int, num_heads: int, top_k: int) -> int:
    """An upper estimate of the size of the influence data as JSON (and of the page around it).

    Per token and view (the mean and every head of each layer, and the rollout): ``top_k``
    keys and weights of 2 bytes each (keys take 4 past 65,536 tokens) and a count and scale,
    all in base64 (4/3), plus the tokens' text and the flow into every token when the page can
    hold it: all cones within :data:`FLOW_EDGES` edges, so at most that many inputs listed (each
    cone holds at least a token's own path through the layers, and an input per edge at most).

    Example:
        >>> round(estimate_bytes(10_000, 4, 4, 10) / 1e6, 1)  # MB
        16.5
    """
    views = num_layers * (num_heads + 1) + 1
    key = 4 if num_tokens > 65536 else 2
    per_row = top_k * (key + 2) + 8  # kept keys and weights; the count (2), the scale (4) and slack
    flows = 0
    if num_tokens * num_layers <= FLOW_EDGES:  # an input (up to 5 digits) and a value (12 decimals) per listed input
        flows = 21 * min(num_tokens * top_k, FLOW_EDGES) + 30 * num_tokens
    return int(views * num_tokens * per_row * 4 / 3 + 60 * num_tokens + flows + 50_000)


def key_ranges(pattern: str, n: int, window: int = 2) -> Tuple[np.ndarray, np.ndarray]:
    """The keys of every query under one of ``show``'s patterns: ``[lo[i], hi[i])``, rows = queries i.

    Each of the four patterns gives a query one run of keys that holds the query itself, and
    ``lo``, ``hi`` never decrease with i, so the keys of a run of queries form one run too
    (what the streamed page data and its memory estimate rely on).

    Example:
        >>> [r.tolist() for r in key_ranges("causal_window", 5, 1)]  # 0 <= i - j <= 1
        [[0, 0, 1, 2, 3], [1, 2, 3, 4, 5]]
    """
    i = np.arange(n, dtype=np.int64)
    rule = {"full": (np.zeros_like(i), np.full_like(i, n)), "causal": (np.zeros_like(i), i + 1),
            "window": (np.maximum(i - window, 0), np.minimum(i + window + 1, n)),
            "causal_window": (np.maximum(i - window, 0), i + 1)}
    if pattern not in rule:
        raise ValueError(f"pattern must be one of {tuple(rule)} (got {pattern!r})")
    return rule[pattern]


ROWS = 128  # queries per streamed block and per rollout tile (rollout.TILE)
BASE_BYTES = 700_000_000  # python, torch, tgattn and SciPy loaded, the model, the kept data: 0.54 GB measured (200 words)
# per edge of the largest block in work (the layer's scores and weights, its indices, weights per view, padded top-k,
# CSR rows): 460-550 measured at 5,000 and 10,000 causal tokens (peak RSS less the base and the tiles)
EDGE_BYTES = 600


def estimate_memory(num_tokens: int, num_layers: int, num_heads: int, top_k: int, pattern: str, window: int = 2) -> int:
    """An upper estimate of the peak memory (bytes) of ``show --html / --json`` with random layers, streamed.

    The weights are made and pruned one block of :data:`ROWS` queries at a time, so what stays is
    the rollout: the dense tiles of one layer's product (two while a third layer is made from
    them), 8 bytes per entry of each block's span; and, in work, the largest block's edges
    (:data:`EDGE_BYTES` each), and the page (4 copies while it is written).

    Example:
        >>> round(estimate_memory(10_000, 2, 2, 10, "causal") / 1e9, 2)  # GB (1.65 measured)
        1.9
    """
    lo, hi = key_ranges(pattern, num_tokens, window)
    starts = np.arange(0, num_tokens, ROWS)
    stops = np.minimum(starts + ROWS, num_tokens)
    first, last = starts.copy(), stops - 1  # the rows whose keys a block's rollout tile spans, layer by layer
    tiles = []
    for _ in range(num_layers - 1):  # the last layer's tiles are pruned as they are made
        first, last = lo[first], hi[last] - 1
        tiles.append(int(8 * ((stops - starts) * (last - first + 1)).sum()))
    held = max((a + b for a, b in zip([0] + tiles, tiles)), default=0)
    edges = int(max(np.add.reduceat(hi - lo, starts))) if num_tokens else 0
    page = estimate_bytes(num_tokens, num_layers, num_heads, top_k)
    return BASE_BYTES + held + EDGE_BYTES * edges + 4 * page
