"""The influence page's defaults and size budget, without torch (the command line checks them first)."""
from __future__ import annotations

TOP_K = 10  # keys kept per token and view by default
THRESHOLD = 1e-3  # weights below are dropped by default
MAX_BYTES = 64_000_000  # the default budget: pages beyond it open slowly or not at all in a browser


def estimate_bytes(num_tokens: int, num_layers: int, num_heads: int, top_k: int) -> int:
    """An upper estimate of the size of the influence data as JSON (and of the page around it).

    Per token and view (the mean and every head of each layer, and the rollout): ``top_k``
    keys and weights of 2 bytes each (keys take 4 past 65,536 tokens) and a count and scale,
    all in base64 (4/3), plus the tokens' text.

    Example:
        >>> round(estimate_bytes(10_000, 4, 4, 10) / 1e6, 1)  # MB
        14.1
    """
    views = num_layers * (num_heads + 1) + 1
    key = 4 if num_tokens > 65536 else 2
    per_row = top_k * (key + 2) + 8  # kept keys and weights; the count (2), the scale (4) and slack
    return int(views * num_tokens * per_row * 4 / 3 + 60 * num_tokens + 50_000)
