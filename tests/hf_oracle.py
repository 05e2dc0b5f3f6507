"""A dense float64 oracle for transformers models, registered under the name ``"dense_oracle"``.

transformers' own boolean mask (``sdpa_mask``, never skipped) and
:func:`tgattn.reference.dense_attention` on it, one row of the batch at a time, with the
call's score bias (T5's ``position_bias``, a float mask) added densely. (transformers' eager
attention runs its softmax in float32 and gives NaN on left padding in float64, so it cannot be
the float64 reference.) Importing this module registers it.
"""
import torch
import transformers
from transformers import masking_utils as masking

from tgattn.reference import dense_attention

NAME = "dense_oracle"
CALLS = [0]  # attention calls the oracle has run (tests compare it with tgattn's)
# When set to w: every call with as many queries as keys (self-attention without a cache; the tests
# give encoder and decoder different lengths) also keeps only keys with |i - j| <= w.
SELF_WINDOW = [None]


def oracle_mask(**kw):
    """transformers' boolean mask [B, 1, Tq, Tk], always built (no ``None`` for plain masks)."""
    return masking.sdpa_mask(**{**kw, "allow_is_causal_skip": False, "allow_is_bidirectional_skip": False})


def capped_sink_attention(q, k, v, keep, bias, scale, softcap=None, sinks=None):
    """Dense attention of one batch row ``q [H, Tq, d]``, ``k``, ``v [H, Tk, d]``, ``keep`` / ``bias``
    ``[H, Tq, Tk]``, with logit soft-capping and sinks (``[H]``, or ``[H, Tq, 1]``: one per query).

    The scaled scores are capped, ``c * tanh(s / c)``, then the bias is added and the masked keys
    removed; a sink adds one more logit per head (value 0) to the softmax, dropped afterwards. A
    query left with no logit outputs 0. Returns ``[Tq, H, dv]``.
    """
    scores = scale * q @ k.transpose(-1, -2)  # [H, Tq, Tk]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = (scores + bias).masked_fill(~keep, float("-inf"))
    sink = torch.full_like(scores[..., :1], float("-inf")) if sinks is None else sinks.view(
        sinks.shape[0], -1, 1).expand_as(scores[..., :1]).to(scores.dtype)  # [H] or [H, Tq, 1]
    logits = torch.cat([scores, sink], dim=-1)  # [H, Tq, Tk + 1]
    nothing = (logits == float("-inf")).all(-1, keepdim=True)
    probs = logits.masked_fill(nothing, 0.0).softmax(-1).masked_fill(nothing, 0.0)[..., :-1]
    return (probs @ v).transpose(0, 1)


def top_logits(query, key, keep, bias, scaling, softcap, k_top):
    """Cells among the ``k_top`` largest logits of their row and head ``[B, H, Tq, Tk]`` (torch.topk)."""
    logits = query @ key.transpose(-1, -2) * (query.shape[-1] ** -0.5 if scaling is None else scaling)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    logits = (logits + bias).masked_fill(~keep, float("-inf"))
    best = logits.topk(min(k_top, logits.shape[-1]), dim=-1).indices
    return torch.zeros_like(keep).scatter_(-1, best, True)


def oracle_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                     position_bias=None, softcap=None, s_aux=None, sinks=None, **kw):
    """transformers' attention call by the dense oracle.

    A module with an ``oracle_window = w`` attribute also keeps only keys with ``|i - j| <= w``
    (the tests pad only at the ends of a row, so positions differ as the real tokens' ranks do);
    one with ``oracle_topk = K`` keeps each row's and head's K largest logits (:func:`top_logits`).
    ``softcap`` and sinks (``s_aux`` or ``sinks``) go through :func:`capped_sink_attention`.
    """
    CALLS[0] += 1
    batch_size, heads, q_length, _ = query.shape
    kv_length = key.shape[2]
    groups = heads // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)  # [B, H, Tk, d]
    if attention_mask is None:  # a model that builds no mask: causal (aligned to the last key) or full, as sdpa
        causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        keep = torch.ones(q_length, kv_length, dtype=torch.bool, device=query.device)
        attention_mask = (keep.tril(kv_length - q_length) if causal else keep).expand(batch_size, 1, -1, -1)
    bias = torch.zeros(batch_size, heads, q_length, kv_length, dtype=query.dtype, device=query.device)
    if attention_mask.dtype != torch.bool:  # additive: the kept cells are those above the dtype's minimum
        bias = bias + attention_mask
        attention_mask = attention_mask > torch.finfo(attention_mask.dtype).min
    if position_bias is not None:
        bias = bias + position_bias
    keep = attention_mask.expand(batch_size, heads, q_length, kv_length)  # [B, H, Tq, Tk]
    window = getattr(module, "oracle_window", SELF_WINDOW[0] if q_length == kv_length else None)
    if window is not None:
        i, j = torch.arange(q_length).view(-1, 1), torch.arange(kv_length).view(1, -1)
        keep = keep & ((i - j).abs() <= window)
    topk = getattr(module, "oracle_topk", None)
    if topk is not None:
        keep = keep & top_logits(query, key, keep, bias, scaling, softcap, topk)
    sinks = s_aux if s_aux is not None else sinks
    if softcap is not None or sinks is not None:
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        rows = [capped_sink_attention(query[b], key[b], value[b], keep[b], bias[b], scale, softcap,
                                      sinks[b] if sinks is not None and sinks.dim() == 4 else sinks)  # one per query
                for b in range(batch_size)]
        return torch.stack(rows), None
    rows = [dense_attention(query[b].transpose(0, 1), key[b].transpose(0, 1), value[b].transpose(0, 1), keep[b],
                            bias=bias[b], scale=scaling) for b in range(batch_size)]  # each [Tq, H, d]
    return torch.stack(rows), None


transformers.AttentionInterface.register(NAME, oracle_attention)
masking.AttentionMaskInterface.register(NAME, oracle_mask)
