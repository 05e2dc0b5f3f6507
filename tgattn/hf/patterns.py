"""The patterns :func:`tgattn.hf.use_pattern` sets (kept beside each config) and the edges they build per batch."""
from __future__ import annotations

import weakref
from functools import partial
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from .. import builders
from ..builders._common import check_count

Pattern = Callable[[list, bool], Tensor]  # (document lengths, causal model) -> LongTensor[2, E]


class Choice(NamedTuple):
    """What :func:`tgattn.hf.use_pattern` set on a config: the pattern (``None``: the model's own rule) and ``topk``."""

    pattern: Optional[Pattern]
    topk: Optional[int]


# id(config) -> (weak reference to the config, choice); entries die with the config.
_PATTERNS: Dict[int, Tuple[weakref.ref, Choice]] = {}
NO_CHOICE = Choice(None, None)


def choice_of(config) -> Choice:
    """What :func:`tgattn.hf.use_pattern` set on ``config`` (``Choice(None, None)``: the model's own attention)."""
    entry = _PATTERNS.get(id(config)) if config is not None else None
    if entry is None or entry[0]() is not config:
        return NO_CHOICE
    return entry[1]


def pattern_of(config) -> Optional[Pattern]:
    """The pattern :func:`tgattn.hf.use_pattern` set on ``config``, or ``None`` (the model's own rule)."""
    return choice_of(config).pattern


def _forget(key: int, _ref) -> None:
    _PATTERNS.pop(key, None)


def _window(lengths, causal_model: bool, *, w: int, causal: Optional[bool]) -> Tensor:
    return builders.window(lengths, w, causal=causal_model if causal is None else causal)


def _builder(lengths, causal_model: bool, *, builder: Callable, causal: Optional[bool]) -> Tensor:
    return check_built(builder(lengths), lengths, causal_model if causal is None else causal)


def check_built(edge_index, lengths: List[int], causal: bool) -> Tensor:
    """A builder's ``edge_index`` over packed documents of ``lengths``, or a one-line error naming the fault.

    It must be an integer tensor ``[2, E]`` of token ids ``0 .. sum(lengths) - 1`` whose edges stay
    inside one document, and (``causal``) never lead from a later key to an earlier query: a
    ``[E, 2]`` tensor read as ``[2, E]``, or a negative id, would otherwise be other edges, silently.

    Example:
        >>> check_built(torch.tensor([[0, 0, 1], [0, 1, 1]]), [2], causal=True).shape
        torch.Size([2, 3])
        >>> check_built(torch.tensor([[1], [0]]), [2], causal=True)
        Traceback (most recent call last):
        ...
        ValueError: the builder's edge 0 leads from key 1 to the earlier query 0 of a causal model (pass causal=False to allow it)
    """
    if not isinstance(edge_index, Tensor):
        raise TypeError(f"the builder must return a LongTensor edge_index [2, E] (got {type(edge_index).__name__})")
    if edge_index.dtype == torch.bool or edge_index.is_floating_point() or edge_index.is_complex():
        raise TypeError(f"the builder must return integer token ids (got a {edge_index.dtype} tensor)")
    if edge_index.dim() != 2 or edge_index.shape[0] != 2:
        raise ValueError(f"the builder must return edge_index of shape [2, E] (got {list(edge_index.shape)})")
    edge_index = edge_index.long()
    total = sum(lengths)
    if edge_index.numel() and not (0 <= int(edge_index.min()) and int(edge_index.max()) < total):
        bad = int(edge_index.min()) if int(edge_index.min()) < 0 else int(edge_index.max())
        raise ValueError(f"the builder's edges refer to token {bad}, but the batch's {len(lengths)} "
                         f"document{'s' * (len(lengths) > 1)} hold tokens 0 .. {total - 1}")
    doc = torch.repeat_interleave(torch.arange(len(lengths), device=edge_index.device),
                                  torch.as_tensor(lengths, device=edge_index.device))  # [N] document of each token
    src, dst = edge_index
    crossing = (doc[src] != doc[dst]).nonzero()
    if crossing.numel():
        e = int(crossing[0])
        raise ValueError(f"the builder's edge {e} joins token {int(src[e])} of document {int(doc[src[e]])} to token "
                         f"{int(dst[e])} of document {int(doc[dst[e]])} (lengths {lengths}): a builder over lengths "
                         "must keep each document to itself")
    future = (src > dst).nonzero() if causal else None
    if future is not None and future.numel():
        e = int(future[0])
        raise ValueError(f"the builder's edge {e} leads from key {int(src[e])} to the earlier query {int(dst[e])} of "
                         "a causal model (pass causal=False to allow it)")
    return edge_index


def make_choice(builder: Optional[Callable], window: Optional[int], causal: Optional[bool],
                topk: Optional[int]) -> Choice:
    """The :class:`Choice` of :func:`tgattn.hf.use_pattern`'s arguments (named errors for bad ones)."""
    if builder is not None and window is not None:
        raise ValueError(f"give builder or window, not both (got builder={builder!r}, window={window!r})")
    if builder is not None and not callable(builder):
        raise TypeError(f"builder must be a callable lengths -> edge_index (got {builder!r})")
    if causal is not None and not isinstance(causal, bool):
        raise TypeError(f"causal must be True, False or None (got {causal!r})")
    if causal is not None and builder is None and window is None:
        raise ValueError(f"causal applies to a builder or a window, and neither was given (got causal={causal!r})")
    if builder is None and window is None:
        pattern = None
    elif window is not None:
        pattern = partial(_window, w=check_count("window", window), causal=causal)
    else:
        pattern = partial(_builder, builder=builder, causal=causal)
    return Choice(pattern, None if topk is None else check_count("topk", topk, 1))


def set_choice(model, choice: Choice) -> None:
    """Keep ``choice`` beside ``model``'s configs (``Choice(None, None)``: forget theirs)."""
    # Stacks may hold copies of the model's (or text model's) config of their own (T5's encoder and
    # decoder): those too; a config of another kind (a vision tower's) keeps its model's rule.
    configs = {id(c): c for c in (model.config, model.config.get_text_config())}
    kinds = tuple({type(c) for c in configs.values()})
    configs.update((id(m.config), m.config) for m in model.modules() if isinstance(getattr(m, "config", None), kinds))
    for key, config in configs.items():
        if choice == NO_CHOICE:
            _PATTERNS.pop(key, None)
        else:
            _PATTERNS[key] = (weakref.ref(config, partial(_forget, key)), choice)


def documents(rule: Callable, real: Tensor, q_offset: int, q_length: int) -> Tuple[Tensor, Tensor]:
    """Documents of a batch: ``(lengths [D], slots [R, 2])`` over its real tokens in order.

    ``real [B, P]`` marks real tokens at positions ``0 .. P-1``; a document starts at each
    row's first position and at each query position ``q`` whose predecessor ``rule`` hides.
    ``slots`` holds ``(row, position)`` of each real token.
    """
    batch_size, positions = real.shape
    start = torch.zeros_like(real)
    start[:, 0] = True
    first = max(q_offset, 1)
    if first < q_offset + q_length:
        q = torch.arange(first, q_offset + q_length, device=real.device).expand(batch_size, -1)  # [B, Q]
        b = torch.arange(batch_size, device=real.device).unsqueeze(1)
        seen = torch.as_tensor(rule(b, torch.zeros_like(q), q, q - 1)).to(torch.bool).expand(q.shape)
        start[:, first:q_offset + q_length] = ~seen
    doc = torch.cumsum(start, dim=1) + torch.arange(batch_size, device=real.device).unsqueeze(1) * positions
    _, lengths = torch.unique_consecutive(doc[real], return_counts=True)
    return lengths, real.nonzero()


def causal_model(rule: Callable, batch_size: int, q_offset: int, q_length: int, end: int, device=None) -> bool:
    """Whether ``rule`` hides from every query the next position (a decoding step counts as causal)."""
    q = torch.arange(q_offset, min(q_offset + q_length, end - 1), device=device).expand(batch_size, -1)
    b = torch.arange(batch_size, device=device).unsqueeze(1)
    return not bool(torch.as_tensor(rule(b, torch.zeros_like(q), q, q + 1)).any()) if q.numel() else True


def pattern_edges(pattern: Pattern, rule: Callable, batch_size: int, q_length: int, kv_length: int,
                  q_offset: int, kv_offset: int, pad: Optional[Tensor]) -> Tensor:
    """The edges of ``pattern`` over the documents of a batch, in :class:`EdgeMask` numbering."""
    end = kv_offset + kv_length
    device = pad.device if pad is not None else None
    real = pad if pad is not None else torch.ones(batch_size, end, dtype=torch.bool, device=device)
    lengths, slots = documents(rule, real, q_offset, q_length)
    causal = causal_model(rule, batch_size, q_offset, q_length, end, device)
    edge_index = pattern(lengths.tolist(), causal).to(real.device)
    (b_k, pos_k), (b_q, pos_q) = slots[edge_index[0]].unbind(1), slots[edge_index[1]].unbind(1)
    keep = (pos_q >= q_offset) & (pos_q < q_offset + q_length) & (pos_k >= kv_offset)
    return torch.stack([b_k * kv_length + pos_k - kv_offset, b_q * q_length + pos_q - q_offset])[:, keep]
