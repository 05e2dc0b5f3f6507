"""Edge sets for the attention benchmark, each with its FlexAttention ``mask_mod`` twin."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

from .. import builders

WINDOW = 64  # radius of the window pattern (the PERFORMANCE.md anchor: E = 129 per query)


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
    g = torch.Generator(device or "cpu").manual_seed(seed)
    parts, step = [], max(1, (1 << 24) // max(n, 1))
    for r0 in range(0, n, step):
        i, j = (torch.rand(min(step, n - r0), n, generator=g, device=g.device) < p).nonzero(as_tuple=True)
        parts.append(torch.stack([j, i + r0]))
    return torch.cat(parts, dim=1)


def _topk(n: int, k: int, seed: int = 0, device=None) -> Tensor:
    """Each query keeps its k best keys under random low-rank scores (the top-k shape), drawn
    and ranked on ``device``."""
    g = torch.Generator(device or "cpu").manual_seed(seed)
    a, b = torch.randn(n, 16, generator=g, device=g.device), torch.randn(n, 16, generator=g, device=g.device)
    parts, step = [], max(1, (1 << 24) // max(n, 1))
    for r0 in range(0, n, step):
        idx = (a[r0 : r0 + step] @ b.T).topk(min(k, n), dim=1).indices.sort(dim=1).values  # [rows, k]
        rows = torch.arange(r0, r0 + idx.shape[0], device=g.device).unsqueeze(1).expand_as(idx)
        parts.append(torch.stack([idx.reshape(-1), rows.reshape(-1)]))
    return torch.cat(parts, dim=1)


def _bigbird(n: int, w: int = 32, g: int = 2, r: int = 3, seed: int = 0) -> Tensor:
    """Window ``w`` + ``g`` global tokens + ``r`` random keys per query (Zaheer et al., 2020)."""
    if hasattr(builders, "bigbird"):
        return builders.bigbird(n, w, g, r, generator=torch.Generator().manual_seed(seed))
    gen = torch.Generator().manual_seed(seed)
    i = torch.arange(n)
    parts = [builders.window(n, w)]
    parts.append(torch.stack([torch.arange(g).repeat(n), i.repeat_interleave(g)]))  # everyone sees the globals
    parts.append(torch.stack([i.repeat(g), torch.arange(g).repeat_interleave(n)]))  # the globals see everyone
    parts.append(torch.stack([torch.randint(0, n, (n * r,), generator=gen), i.repeat_interleave(r)]))
    ei = torch.cat(parts, dim=1)
    return builders._common.sort_unique(ei, n)


def patterns() -> dict:
    """All benchmark patterns by name (``dilated`` only when the builder exists)."""
    w = WINDOW
    out = {
        "full": Pattern("full", builders.full, lambda b, h, q, kv: q >= 0, dense="full"),
        "causal": Pattern("causal", builders.causal, lambda b, h, q, kv: q >= kv, dense="causal"),
        f"window{w}": Pattern(f"window{w}", lambda n: builders.window(n, w), lambda b, h, q, kv: (q - kv).abs() <= w),
        "bigbird": Pattern("bigbird", _bigbird),
    }
    if hasattr(builders, "dilated"):
        out["dilated32x2"] = Pattern(
            "dilated32x2",
            lambda n: builders.dilated(n, 32, 2),
            lambda b, h, q, kv: ((q - kv).abs() <= 64) & ((q - kv) % 2 == 0),
        )
    for p in (0.01, 0.05):
        out[f"random{p:g}"] = Pattern(f"random{p:g}", lambda n, p=p: _random(n, p))
        out[f"topk{p:g}"] = Pattern(f"topk{p:g}", lambda n, p=p: _topk(n, max(1, round(p * n))))
    return out
