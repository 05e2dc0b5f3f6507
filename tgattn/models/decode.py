"""Sampling from a :class:`~tgattn.models.GPT`: incremental (cached keys and values) or full recomputation.

Incremental decoding grows the graph by one node per step: token t is a new query node whose
in-edges are the keys its pattern grants it (``w + 1`` for a causal window of radius ``w``,
``t + 1`` for causal), and keys/values of earlier tokens come from a cache instead of being
recomputed. Both modes use the same edge set, the single-sequence pattern at ``block_size``
restricted to the first tokens, so they produce the same logits and tokens.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..functional import graph_attention
from .config import SELECTIONS


class DecodePattern:
    """The in-edges of each position of one sequence of ``block_size`` tokens, in CSR form.

    ``keys(t)`` are the positions that token t attends to; ``prefix(t, batch)`` is the packed
    edge set of ``batch`` sequences of the first ``t`` tokens.
    """

    def __init__(self, model):
        length = model.config.block_size
        edge_index = model.pattern([length])  # [2, E], sorted by (target, source)
        src, dst = edge_index
        if (src > dst).any():
            raise ValueError("decoding needs a causal pattern (keys j <= i)")
        self.edge_index = edge_index
        self.rowptr = torch.zeros(length + 1, dtype=torch.long)
        self.rowptr[1:] = torch.bincount(dst, minlength=length).cumsum(0)

    def keys(self, t: int) -> Tensor:
        return self.edge_index[0, self.rowptr[t] : self.rowptr[t + 1]]

    def prefix(self, t: int, batch: int) -> Tensor:
        e = self.edge_index[:, : self.rowptr[t]]  # targets < t, hence (causal) sources < t
        return torch.cat([e + b * t for b in range(batch)], dim=1)


def _sample(logits: Tensor, temperature: float, top_k: Optional[int], generator) -> Tensor:
    logits = logits / temperature  # [B, V]
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)  # [B, 1]


class KVCache:
    """Keys and values ``[B, block_size, H, d]`` per layer, filled one position at a time."""

    def __init__(self, model, batch: int):
        c = model.config
        p = next(model.parameters())
        shape = (batch, c.block_size, c.n_head, c.n_embd // c.n_head)
        self.k = [p.new_zeros(shape) for _ in range(c.n_layer)]
        self.v = [p.new_zeros(shape) for _ in range(c.n_layer)]
        self.length = 0


@torch.no_grad()
def step(model, cache: KVCache, pattern: DecodePattern, token: Tensor) -> Tensor:
    """Append ``token [B]`` at position ``cache.length``; return its next-token logits ``[B, V]``.

    Per layer: project the new node only, store its key and value, and attend along its
    in-edges from the cached keys (one :func:`graph_attention` call over ``B * m`` edges).
    """
    t, tr = cache.length, model.transformer
    if t >= model.config.block_size:
        raise ValueError(f"the cache is full (block_size {model.config.block_size})")
    b = token.shape[0]
    x = tr.wte(token) + tr.wpe.weight[t]  # [B, D]
    keys = pattern.keys(t).to(token.device)  # [m]
    length = cache.k[0].shape[1]
    src = (torch.arange(b, device=token.device).unsqueeze(1) * length + keys).reshape(-1)  # [B * m]
    dst = torch.arange(b, device=token.device).repeat_interleave(keys.numel())  # [B * m]
    edge_index = torch.stack([src, dst])
    for layer, block in enumerate(tr.h):
        q, k, v = block.attn.project(block.ln_1(x))  # [B, H, d] each
        cache.k[layer][:, t], cache.v[layer][:, t] = k, v
        h, d = q.shape[1], q.shape[2]
        keys_all = cache.k[layer].view(-1, h, d)  # [B * block_size, H, d], a view
        values_all = cache.v[layer].view(-1, h, d)
        # One query per sequence: the per-edge path is the cheapest (no edge-set analysis to amortise).
        out = graph_attention(q, keys_all, values_all, edge_index, backend="gather")  # [B, H, d]
        x = x + block.attn.out_proj(out.reshape(b, h * d))
        x = x + block.mlp(block.ln_2(x))
    cache.length = t + 1
    return model.lm_head(tr.ln_f(x))  # [B, V]


@torch.no_grad()
def generate(
    model,
    idx: Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    generator: Optional[torch.Generator] = None,
    use_cache: bool = True,
    return_logits: bool = False,
):
    """Continue each prompt ``idx [B, T0]`` by ``max_new_tokens`` sampled tokens.

    With ``use_cache`` each step costs one node and its in-edges while the text fits in
    ``block_size``; beyond it, like nanoGPT, every step recomputes the last ``block_size``
    tokens (learned positions cannot slide). A model that selects its keys per forward
    (``attention="indexer_topk"`` / ``"block_topk"``) always recomputes (no fixed pattern to cache).

    Returns:
        ``idx [B, T0 + max_new_tokens]``, and the logits of every sampled step
        ``[B, max_new_tokens, V]`` with ``return_logits=True``.

    Example:
        >>> from tgattn.models import GPT, GPTConfig
        >>> model = GPT(GPTConfig(block_size=16, vocab_size=7, n_layer=1, n_head=2, n_embd=8)).eval()
        >>> prompt = torch.zeros(1, 3, dtype=torch.long)
        >>> a = generate(model, prompt, 5, generator=torch.Generator().manual_seed(0))
        >>> b = generate(model, prompt, 5, generator=torch.Generator().manual_seed(0), use_cache=False)
        >>> a.shape, bool((a == b).all())
        (torch.Size([1, 8]), True)
    """
    if idx.dim() != 2 or idx.shape[1] == 0:
        raise ValueError(f"idx must be a non-empty [B, T] prompt (got shape {list(idx.shape)})")
    if not temperature > 0:  # NaN too
        raise ValueError(f"temperature must be > 0 (got {temperature})")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1 or None (got {top_k})")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0 (got {max_new_tokens})")
    selects = model.config.attention in SELECTIONS  # keys chosen per forward: no fixed pattern to cache along
    pattern = None if selects else DecodePattern(model)
    block = model.config.block_size
    cache = KVCache(model, idx.shape[0]) if use_cache and not selects else None
    if cache is not None:
        for t in range(min(idx.shape[1], block) - 1):  # prefill all prompt tokens but the last
            step(model, cache, pattern, idx[:, t])
    all_logits = []
    for _ in range(max_new_tokens):
        if cache is not None and idx.shape[1] <= block:
            logits = step(model, cache, pattern, idx[:, -1])
        else:
            ctx = idx[:, -block:]
            full, _ = model(ctx) if selects else model(ctx, edge_index=pattern.prefix(ctx.shape[1], ctx.shape[0]))
            logits = full[:, -1]
        all_logits.append(logits)
        idx = torch.cat([idx, _sample(logits, temperature, top_k, generator)], dim=1)
    if return_logits:
        return idx, torch.stack(all_logits, dim=1)
    return idx
