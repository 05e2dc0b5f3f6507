"""The attention function of ``attn_implementation="tgattn"``: an HF attention call on an edge set."""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator, List, Optional, Tuple

import torch
from torch import Tensor

from ..functional import graph_attention
from .masks import EdgeMask, causal_rule, edge_mask, from_dense, full_rule

Layer = Tuple[Tensor, Tensor]
_RECORD: ContextVar[Optional[List[Layer]]] = ContextVar("tgattn_hf_record", default=None)
UNSUPPORTED = ("softcap", "s_aux", "sinks", "position_bias")


@contextmanager
def recording() -> Iterator[List[Layer]]:
    """Collect ``(edge_index [2, E], alpha [E, H])`` of every tgattn attention call inside.

    Edges use :class:`~tgattn.hf.masks.EdgeMask` numbering (for one unpadded sequence: token
    positions); ``alpha`` has one column per query head.

    Example:
        >>> q = k = v = torch.randn(1, 2, 3, 4)  # [B, H, T, d]
        >>> with recording() as layers:
        ...     _ = attention_forward(None, q, k, v, edge_mask(1, 3, 3))
        >>> layers[0][0].shape, layers[0][1].shape
        (torch.Size([2, 6]), torch.Size([6, 2]))
    """
    layers: List[Layer] = []
    token = _RECORD.set(layers)
    try:
        yield layers
    finally:
        _RECORD.reset(token)


def _as_edge_mask(mask, module, batch_size: int, q_length: int, kv_length: int, is_causal: Optional[bool]) -> EdgeMask:
    if isinstance(mask, EdgeMask):
        return mask
    if isinstance(mask, Tensor):
        return from_dense(mask)
    if mask is not None:
        raise TypeError(f"attention_mask must be an EdgeMask, a 4-D tensor or None (got {type(mask).__name__})")
    # No mask (a model that builds none, or no mask builder registered): like SDPA without
    # a mask, causal aligned to the last key or full; padding is unknown here.
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    return edge_mask(batch_size, q_length, kv_length, q_offset=kv_length - q_length,
                     mask_function=causal_rule if causal else full_rule)


def attention_forward(
    module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask,
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    **kwargs,
) -> Tuple[Tensor, None]:
    """transformers' attention call, run by :func:`tgattn.functional.graph_attention`.

    Grouped-query attention reads each key / value head in place: the query heads
    ``g, G + g, 2G + g, ...`` (one per key head, ``G = Hq / Hkv``) attend in one call, so
    query head ``h`` uses key head ``h // G`` and keys / values are never repeated. (Measured
    at n = 8192, Hkv = 2, G = 4, d = 64, causal window 256 on 2 cores: 0.87 s for the G
    calls against 2.95 s for one call over G query nodes per token with G times the edges.)

    Args:
        module: the attention module (its ``is_causal`` is used only when no mask is given).
        query: ``[B, Hq, Tq, d]``; key, value: ``[B, Hkv, Tk, d]`` (``Hq`` a multiple of ``Hkv``).
        attention_mask: the :class:`~tgattn.hf.masks.EdgeMask` of the forward; a 4-D mask
            tensor; or ``None`` (causal / full without padding, as SDPA without a mask).
        dropout: dropout on the attention weights (transformers passes 0 in eval mode).
        scaling: score scale (default: ``1 / sqrt(d)``).
        is_causal: overrides ``module.is_causal`` when there is no mask.

    float16 / bfloat16 inputs are computed in float32, as the engine does (eager attention, too,
    runs its softmax in float32); they are cast here once, not once per query-head group.

    Returns:
        ``(out [B, Tq, Hq, dv], None)``; weights go to :func:`recording`, not to the caller.
    """
    given = [name for name in UNSUPPORTED if kwargs.get(name) is not None]
    if given:
        raise NotImplementedError(f"tgattn attention does not support {given} (use eager or sdpa for this model)")
    batch_size, heads, q_length, dim = query.shape
    kv_heads, kv_length = key.shape[1], key.shape[2]
    if heads % kv_heads:
        raise ValueError(f"query heads ({heads}) must be a multiple of key/value heads ({kv_heads})")
    mask = _as_edge_mask(attention_mask, module, batch_size, q_length, kv_length, is_causal)
    if (mask.batch_size, mask.q_length, mask.kv_length) != (batch_size, q_length, kv_length):
        raise ValueError(f"the mask is for [B, Tq, Tk] = {[mask.batch_size, mask.q_length, mask.kv_length]}, "
                         f"but the call has {[batch_size, q_length, kv_length]}")
    groups = heads // kv_heads
    dtype = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
    q = query.transpose(1, 2).reshape(batch_size * q_length, kv_heads, groups, dim).to(dtype)  # [Nq, Hkv, G, d]
    k = key.transpose(1, 2).reshape(batch_size * kv_length, kv_heads, dim).to(dtype)  # [Nk, Hkv, d]
    v = value.transpose(1, 2).reshape(batch_size * kv_length, kv_heads, value.shape[-1]).to(dtype)  # [Nk, Hkv, dv]
    record = _RECORD.get()
    outs, weights = [], []
    for g in range(groups):
        result = graph_attention(q[:, :, g].contiguous(), k, v, mask.edge_index, bias=mask.bias, scale=scaling,
                                 dropout_p=dropout, return_weights=record is not None)
        if record is not None:
            result, alpha = result
            weights.append(alpha)
        outs.append(result)  # [Nq, Hkv, dv]
    out = torch.stack(outs, dim=2).reshape(batch_size, q_length, heads, -1).to(query.dtype)  # head h = (h // G, h % G)
    if record is not None:
        record.append((mask.edge_index, torch.stack(weights, dim=2).reshape(-1, heads)))  # [E, Hq]
    return out, None
