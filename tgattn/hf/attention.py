"""The attention function of ``attn_implementation="tgattn"``: an HF attention call on an edge set."""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator, List, Optional, Tuple

import torch
from torch import Tensor

from ..builders.scored import best_per_target, edge_scores
from ..functional import graph_attention
from .masks import EdgeMask, causal_rule, edge_mask, from_dense, full_rule
from .patterns import NO_CHOICE, choice_of
from .support import first_layer_keeps_no_keys, mask_request

Layer = Tuple[Tensor, Tensor]
_RECORD: ContextVar[Optional[List[Layer]]] = ContextVar("tgattn_hf_record", default=None)
# Arguments of transformers' attention call that select keys outside the mask (sparse indexers):
# ignoring one would be silently wrong, so a call that gives one is refused.
UNSUPPORTED = {
    "indices": "sparse attention over indexer-selected keys",
    "block_indices": "sparse attention over indexer-selected key blocks",
}


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
    if isinstance(mask, Tensor):  # a model's own 4-D mask, broadcast as eager attention reads it
        if choice_of(getattr(module, "config", None)) != NO_CHOICE:
            # The pattern and top-k ride on the masks tgattn builds; this one the model built itself.
            raise ValueError(f"{type(module).__name__}: use_pattern cannot apply here: the model builds this "
                             "attention mask itself, as a dense tensor, not through transformers' mask interface; "
                             "call use_pattern(model) to return to the model's own rule")
        if mask.dim() != 4 or mask.shape[0] not in (1, batch_size) or mask.shape[2] not in (1, q_length) \
                or mask.shape[3] != kv_length:
            raise ValueError(f"a dense attention mask must broadcast to [B, 1 or H, Tq, Tk] = "
                             f"[{batch_size}, 1 or H, {q_length}, {kv_length}] (got {list(mask.shape)})")
        return from_dense(mask.expand(batch_size, -1, q_length, kv_length))
    if mask is not None:
        raise TypeError(f"attention_mask must be an EdgeMask, a 4-D tensor or None (got {type(mask).__name__})")
    # No mask (a model that builds none, or no mask builder registered): like SDPA without
    # a mask, causal aligned to the last key or full; padding is unknown here.
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    return edge_mask(batch_size, q_length, kv_length, q_offset=kv_length - q_length,
                     mask_function=causal_rule if causal else full_rule)


def _sized(mask: EdgeMask, module, batch_size: int, q_length: int, kv_length: int) -> EdgeMask:
    """``mask``, when it is for the call's sizes; the mask a decoding step should have had, when
    transformers sized it by an empty first layer (:func:`tgattn.hf.support.first_layer_keeps_no_keys`).

    MiniMax with ``layer_types = ["linear_attention", ...]`` (the layout of MiniMax-Text-01) keeps
    no keys in its first layer, and transformers sizes each decoding step's mask by that layer's
    cache: one key for the whole cache. Eager attention broadcasts that one cell over every key:
    right without padding (a new token sees the whole cache), wrong with it (the padding is lost).
    So a causal mask over the whole cache is built here, and a padded batch is refused.
    """
    if (mask.batch_size, mask.q_length, mask.kv_length) == (batch_size, q_length, kv_length):
        return mask
    config = getattr(module, "config", None)
    first = first_layer_keeps_no_keys(config)
    if first is None or (mask.batch_size, mask.q_length, mask.kv_length) != (batch_size, q_length, q_length):
        raise ValueError(f"the mask is for [B, Tq, Tk] = {[mask.batch_size, mask.q_length, mask.kv_length]}, "
                         f"but the call has {[batch_size, q_length, kv_length]}")
    request = mask_request()
    name = type(request.model).__name__ if request.model is not None else type(module).__name__
    cause = (f"its first layer is {first!r}, which keeps no keys, and transformers sizes the masks of decoding steps "
             f"by that layer's empty cache ({mask.kv_length} key for the {kv_length} of this step)")
    if mask.padded:
        raise ValueError(f"{name} cannot generate from a padded batch on attn_implementation='tgattn': {cause}, so the "
                         "padding is lost (eager and sdpa ignore it silently); generate each sequence unpadded")
    if getattr(config, "sliding_window", None) is not None:
        raise ValueError(f"{name} cannot generate on attn_implementation='tgattn' with sliding_window="
                         f"{config.sliding_window}: {cause}, and the window cannot be recovered from it")
    return edge_mask(batch_size, q_length, kv_length, q_offset=kv_length - q_length, config=config)


def edge_bias(position_bias: Tensor, mask: EdgeMask) -> Tensor:
    """A dense additive score bias ``[B or 1, H or 1, Tq, Tk]`` read at the edges of ``mask``: ``[E, H or 1]``.

    T5's relative position bias (and any 4-D float bias) reaches the attention call as such a
    tensor; gathered per edge it is the engine's ``bias``, with gradients to the dense one.

    Example:
        >>> bias = torch.arange(8.0).view(1, 2, 2, 2)  # [1, H, Tq, Tk]
        >>> edge_bias(bias, edge_mask(1, 2, 2))  # causal edges (0, 0), (0, 1), (1, 1)
        tensor([[0., 4.],
                [2., 6.],
                [3., 7.]])
    """
    if position_bias.dim() != 4 or position_bias.shape[0] not in (1, mask.batch_size) \
            or tuple(position_bias.shape[2:]) != (mask.q_length, mask.kv_length):
        raise ValueError(f"a position bias must have shape [B or 1, H or 1, Tq, Tk] = "
                         f"[{mask.batch_size} or 1, H or 1, {mask.q_length}, {mask.kv_length}] "
                         f"(got {list(position_bias.shape)})")
    src, dst = mask.edge_index
    row = dst // mask.q_length if position_bias.shape[0] > 1 else torch.zeros_like(dst)
    return position_bias.permute(0, 2, 3, 1)[row, dst % mask.q_length, src % mask.kv_length]  # [E, H or 1]


def _score_bias(mask: EdgeMask, position_bias: Optional[Tensor], heads: int, dtype) -> Optional[Tensor]:
    """The mask's own bias plus the gathered position bias, ``[E, Hq]`` (or ``[E]`` / ``None``)."""
    bias = mask.bias
    if position_bias is not None:
        gathered = edge_bias(position_bias, mask)
        bias = gathered if bias is None else gathered + bias.view(bias.shape[0], -1)
    if bias is None:
        return None
    if bias.dim() == 2:
        if bias.shape[1] not in (1, heads):
            raise ValueError(f"the score bias has {bias.shape[1]} heads, but the call has {heads} query heads")
        bias = bias.expand(-1, heads)
    return bias.to(dtype)


def _with_sink_keys(sinks: Tensor, k: Tensor, v: Tensor, mask: EdgeMask, bias: Optional[Tensor], heads: int, module):
    """Sinks of one logit per query (``[B, Hq, Tq, 1]``, Inkling 2) as one extra key per query.

    A sink is a logit in the softmax's denominator without a value: a key of zeros (score 0,
    after soft-capping too) whose edge to its query carries the sink as its bias, with a value
    of zeros. Returns the keys and values with ``Nq`` such rows appended, the edges with one
    more per query (the mask's first) and the bias ``[E + Nq, Hq]``.
    """
    num_queries = mask.num_queries
    if tuple(sinks.shape) != (mask.batch_size, heads, mask.q_length, 1):
        raise ValueError(f"sinks must have shape [Hq] = [{heads}] or [B, Hq, Tq, 1] = "
                         f"{[mask.batch_size, heads, mask.q_length, 1]} (got {list(sinks.shape)})")
    if mask.topk is not None:
        caller = type(module).__name__ if module is not None else "attention_forward"
        raise NotImplementedError(f"{caller}: use_pattern's topk with a sink per query is not supported; "
                                  "call use_pattern(model, topk=None)")
    queries = torch.arange(num_queries, device=k.device)
    edge_index = torch.cat([mask.edge_index, torch.stack([queries + mask.num_keys, queries])], dim=1)
    sink_bias = sinks[..., 0].permute(0, 2, 1).reshape(num_queries, heads)  # [Nq, Hq]
    edge_bias = torch.zeros(mask.edge_index.shape[1], heads, dtype=sink_bias.dtype, device=k.device) if bias is None \
        else bias.view(bias.shape[0], -1).expand(-1, heads)
    zeros = k.new_zeros(num_queries, *k.shape[1:]), v.new_zeros(num_queries, *v.shape[1:])
    return torch.cat([k, zeros[0]]), torch.cat([v, zeros[1]]), edge_index, torch.cat([edge_bias, sink_bias])


def best_keys(q: Tensor, k: Tensor, mask: EdgeMask, bias: Optional[Tensor], scale: Optional[float],
              softcap: Optional[float]) -> Tuple[Tensor, Tensor, Tensor]:
    """Each query head's ``mask.topk`` keys with the largest logits, as the softmax sees them.

    ``q [Nq, H, d]``, ``k [Nk, H or Hkv, d]`` (grouped heads: query head ``h`` uses key head ``h // (H / Hkv)``),
    ``bias [E, H]``, ``[E]`` or ``None`` on ``mask``'s edges.
    Returns ``(edge_index [2, E'], bias [E', H], used [E])``: the edges some head keeps, their
    bias (``-inf`` where a head drops the edge) and which of the mask's edges they are.
    """
    src, dst = mask.edge_index
    with torch.no_grad():
        k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)  # one key head per query head (a copy, scores only)
        logits = edge_scores(q, k, src, dst) * (q.shape[-1] ** -0.5 if scale is None else scale)  # [E, H]
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        if bias is not None:
            logits = logits + bias.view(bias.shape[0], -1)
        keep = best_per_target(logits, dst, mask.num_queries, mask.topk)  # [E, H]
    used = keep.any(dim=1)  # [E]
    zero = torch.zeros((), dtype=q.dtype, device=q.device)
    kept_bias = torch.where(keep[used], zero, torch.full_like(zero, float("-inf")))  # [E', H]
    if bias is not None:
        kept_bias = kept_bias + bias[used].view(kept_bias.shape[0], -1)
    return mask.edge_index[:, used], kept_bias, used


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

    Grouped-query attention is one call of :func:`~tgattn.functional.graph_attention` with
    ``k``, ``v`` of ``Hkv`` heads (query head ``h`` uses key head ``h // G``, ``G = Hq / Hkv``):
    the ``tc`` backend reads them in place, G query heads a tile; the others repeat them.

    Args:
        module: the attention module (its ``is_causal`` is used only when no mask is given).
        query: ``[B, Hq, Tq, d]``; key, value: ``[B, Hkv, Tk, d]`` (``Hq`` a multiple of ``Hkv``).
        attention_mask: the :class:`~tgattn.hf.masks.EdgeMask` of the forward; a 4-D mask
            tensor; or ``None`` (causal / full without padding, as SDPA without a mask).
        dropout: dropout on the attention weights (transformers passes 0 in eval mode).
        scaling: score scale (default: ``1 / sqrt(d)``).
        is_causal: overrides ``module.is_causal`` when there is no mask.
        position_bias: an additive score bias ``[B or 1, H or 1, Tq, Tk]`` (T5's relative
            position bias), read at the edges (:func:`edge_bias`); added to a float mask's own.
        softcap: logit soft-capping (Gemma 2, VaultGemma, T5Gemma): ``c * tanh(s / c)`` on the
            scaled scores, before the mask's bias, as their eager attention.
        s_aux: attention sinks ``[Hq]`` (gpt-oss and others; also accepted as ``sinks``): one
            logit per query head in each softmax's denominator, without a value; or
            ``[B, Hq, Tq, 1]``, one per query and head (Inkling 2), run as one more key per query
            (:func:`_with_sink_keys`).

    A mask with ``topk`` (:func:`tgattn.hf.use_pattern`) keeps each query head's ``topk`` keys
    with the largest logits (:func:`best_keys`); recorded weights are 0 on the others.

    float16 / bfloat16 inputs are computed in float32 by the engine (eager attention, too, runs its
    softmax in float32): q, k, v go to it as they are (the fused kernel reads them so, at half
    the bytes), a score bias and sinks in float32.

    Returns:
        ``(out [B, Tq, Hq, dv], None)``; weights go to :func:`recording`, not to the caller.
    """
    given = [name for name in UNSUPPORTED if kwargs.get(name) is not None]
    if given:
        caller = type(module).__name__ if module is not None else "attention_forward"
        raise NotImplementedError(f"{caller}: attention called with {given[0]}= ({UNSUPPORTED[given[0]]}), which "
                                  "tgattn does not support; use attn_implementation='eager' for this model")
    batch_size, heads, q_length, dim = query.shape
    kv_heads, kv_length = key.shape[1], key.shape[2]
    if heads % kv_heads:
        raise ValueError(f"query heads ({heads}) must be a multiple of key/value heads ({kv_heads})")
    mask = _sized(_as_edge_mask(attention_mask, module, batch_size, q_length, kv_length, is_causal), module,
                  batch_size, q_length, kv_length)
    dtype = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
    bias = _score_bias(mask, kwargs.get("position_bias"), heads, dtype)  # [E, Hq], [E] or None
    sinks = kwargs.get("s_aux") if kwargs.get("s_aux") is not None else kwargs.get("sinks")
    sinks = None if sinks is None else sinks.to(dtype)  # [Hq], or [B, Hq, Tq, 1]: one per query (Inkling 2)
    q = query.transpose(1, 2).reshape(batch_size * q_length, heads, dim)  # [Nq, Hq, d]
    k = key.transpose(1, 2).reshape(batch_size * kv_length, kv_heads, dim)  # [Nk, Hkv, d]
    v = value.transpose(1, 2).reshape(batch_size * kv_length, kv_heads, value.shape[-1])  # [Nk, Hkv, dv]
    per_query = sinks is not None and sinks.dim() > 1
    edge_index, used = mask.edge_set, None
    if per_query:
        k, v, edge_index, bias = _with_sink_keys(sinks, k, v, mask, bias, heads, module)
        sinks = None
    if mask.topk is not None:
        edge_index, bias, used = best_keys(q, k, mask, bias, scaling, kwargs.get("softcap"))
    record = _RECORD.get()
    result = graph_attention(q, k, v, edge_index, bias=bias, scale=scaling, dropout_p=dropout,
                             return_weights=record is not None, softcap=kwargs.get("softcap"), sinks=sinks)
    if record is not None:
        result, alpha = result
        alpha = alpha[:mask.edge_index.shape[1]]  # without the sink keys' weights
        record.append((mask.edge_index, alpha if used is None else alpha.new_zeros(used.shape[0], heads).index_copy_(
            0, used.nonzero().view(-1), alpha)))  # [E, Hq]: 0 on the keys no head kept
    return result.reshape(batch_size, q_length, heads, -1).to(query.dtype), None
