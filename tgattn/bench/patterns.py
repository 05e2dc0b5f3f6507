"""Edge sets for the attention benchmark, each with its FlexAttention ``mask_mod`` twin.

Their names (:data:`NAMES`) need no torch: the benchmarks' command lines offer them as choices
before importing it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

if TYPE_CHECKING:
    from torch import Tensor

WINDOW = 64  # radius of the window pattern (the PERFORMANCE.md anchor: E = 129 per query)
NAMES = ("full", "causal", f"window{WINDOW}", "bigbird", "dilated32x2", "random0.01", "topk0.01", "random0.05",
         "topk0.05")


@dataclass
class Pattern:
    """One benchmark edge set: ``make(n)`` returns ``LongTensor[2, E]``.

    ``mask_mod(b, h, q_idx, kv_idx)`` is the FlexAttention twin (``None``: none is simple
    enough to compile, Flex is skipped); ``dense`` names the dense SDPA twin that does the
    same work (``"full"`` / ``"causal"``), if any.
    """

    name: str
    make: Callable[[int], Tensor]
    mask_mod: Optional[Callable] = None
    dense: Optional[str] = None


def _random(n: int, p: float, seed: int = 0, device=None) -> Tensor:
    """Each pair independently with probability p (rows drawn in chunks to bound memory), drawn
    on ``device`` (a GPU draws another set than the CPU for the same seed, in milliseconds)."""
    import torch

    g = torch.Generator(device or "cpu").manual_seed(seed)
    parts, step = [], max(1, (1 << 24) // max(n, 1))
    for r0 in range(0, n, step):
        i, j = (torch.rand(min(step, n - r0), n, generator=g, device=g.device) < p).nonzero(as_tuple=True)
        parts.append(torch.stack([j, i + r0]))
    return torch.cat(parts, dim=1)


def _topk(n: int, k: int, seed: int = 0, device=None) -> Tensor:
    """Each query keeps its k best keys under random low-rank scores (the top-k shape), drawn
    and ranked on ``device``."""
    import torch

    g = torch.Generator(device or "cpu").manual_seed(seed)
    a, b = torch.randn(n, 16, generator=g, device=g.device), torch.randn(n, 16, generator=g, device=g.device)
    parts, step = [], max(1, (1 << 24) // max(n, 1))
    for r0 in range(0, n, step):
        idx = (a[r0 : r0 + step] @ b.T).topk(min(k, n), dim=1).indices.sort(dim=1).values  # [rows, k]
        rows = torch.arange(r0, r0 + idx.shape[0], device=g.device).unsqueeze(1).expand_as(idx)
        parts.append(torch.stack([idx.reshape(-1), rows.reshape(-1)]))
    return torch.cat(parts, dim=1)


def patterns() -> dict:
    """All benchmark patterns by name, in the order of :data:`NAMES`.

    Example:
        >>> tuple(patterns()) == NAMES
        True
    """
    import torch

    from .. import builders

    w = WINDOW
    out = {
        "full": Pattern("full", builders.full, lambda b, h, q, kv: q >= 0, dense="full"),
        "causal": Pattern("causal", builders.causal, lambda b, h, q, kv: q >= kv, dense="causal"),
        f"window{w}": Pattern(f"window{w}", lambda n: builders.window(n, w), lambda b, h, q, kv: (q - kv).abs() <= w),
        # window 32 + 2 global tokens + 3 random keys per query (Zaheer et al., 2020)
        "bigbird": Pattern("bigbird", lambda n: builders.bigbird(n, 32, 2, 3, generator=torch.Generator().manual_seed(0))),
        "dilated32x2": Pattern("dilated32x2", lambda n: builders.dilated(n, 32, 2),
                               lambda b, h, q, kv: ((q - kv).abs() <= 64) & ((q - kv) % 2 == 0)),
    }
    for p in (0.01, 0.05):
        out[f"random{p:g}"] = Pattern(f"random{p:g}", lambda n, p=p: _random(n, p))
        out[f"topk{p:g}"] = Pattern(f"topk{p:g}", lambda n, p=p: _topk(n, max(1, round(p * n))))
    return out
