"""Hugging Face's attention masks as edge sets: the mask builder of ``attn_implementation="tgattn"``.

transformers builds one mask per forward (per kind of layer) by calling the function
registered under the model's ``attn_implementation`` in ``AttentionMaskInterface`` with the
batch's sizes, a ``mask_function(batch, head, q_idx, kv_idx) -> bool`` (causal, sliding
window, chunked, packed sequences, ...) and the 2-D padding mask. :func:`edge_mask` is that
function: it returns an :class:`EdgeMask` (never an ``n x n`` tensor) that every layer of the
forward then reads.

Node numbering: a padded batch of ``B`` rows is one graph. Query slot ``i`` of row ``b`` is
query node ``b * q_length + i``; key slot ``j`` (the j-th key of the row's cache) is key
node ``b * kv_length + j``. Padding disappears: no edge touches a padded key, padded query
slots get no edge (their output is 0), and no edge crosses two rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Optional

import torch
from torch import Tensor

from ..builders._common import sort_unique
from ..edgeset import EdgeSet, prepare
from .patterns import choice_of, pattern_edges
from .support import check_class, mask_request

# Mask cells one block of the exact fallback (custom mask functions) may hold at once.
BLOCK_CELLS = 1 << 24


@dataclass(eq=False)
class EdgeMask:
    """The attention pattern of one forward: an edge set over the slots of a padded batch.

    Attributes:
        edge_index: ``LongTensor[2, E]`` sorted by (query, key); row 0 = key node
            ``b * kv_length + j``, row 1 = query node ``b * q_length + i``.
        batch_size, q_length, kv_length: the batch's shape (queries ``[B, Tq]``, keys ``[B, Tk]``).
        bias: additive score of each edge ``[E]``, or ``[E, H]`` per head (a custom float mask), or ``None``.
        topk: keys each query head keeps in each attention call (the ``topk`` of
            :func:`tgattn.hf.use_pattern`; self-attention only), or ``None``: all.
        padded: the 2-D padding mask it was built from marks some token as padding.
    """

    edge_index: Tensor
    batch_size: int
    q_length: int
    kv_length: int
    bias: Optional[Tensor] = None
    topk: Optional[int] = None
    padded: bool = False

    # transformers prepares the mask before the forward when generating with a static cache,
    # then hands it back to the mask builder: it takes a prepared mask for 4-D and copies it.
    ndim = 4

    def contiguous(self) -> "EdgeMask":
        return self

    @cached_property
    def edge_set(self) -> EdgeSet:
        """``edge_index`` prepared (:func:`tgattn.prepare`) once for every layer of the forward: no
        layer checks or looks up the edges again. Already sorted: no sort."""
        return prepare(self.edge_index, self.batch_size * self.q_length, self.batch_size * self.kv_length)

    # A model that reworks its mask as a dense tensor (indexes it, adds it to a tensor, reads a
    # tensor attribute) cannot run on an edge set: refused with the model's name, not left to
    # fail with a TypeError inside its code.
    def __getitem__(self, index):
        raise ValueError(_dense_use(f"indexes it ([{index!r}])"))

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise ValueError(_dense_use(f"calls {getattr(func, '__name__', func)} on it"))

    def __getattr__(self, name: str):
        if name.startswith("__"):  # copy / pickle probes: the ordinary answer
            raise AttributeError(name)
        raise AttributeError(_dense_use(f"reads its .{name}"))

    @property
    def num_queries(self) -> int:
        return self.batch_size * self.q_length

    @property
    def num_keys(self) -> int:
        return self.batch_size * self.kv_length


def _dense_use(what: str) -> str:
    request = mask_request()
    model = type(request.model).__name__ if request.model is not None else "this model"
    return (f"{model} cannot run on attn_implementation='tgattn': it treats the attention mask as a dense tensor "
            f"({what}), but tgattn's mask is an edge set (tgattn.hf.masks.EdgeMask); "
            "use 'eager' or 'sdpa' for this model")


def causal_rule(batch_idx, head_idx, q_idx, kv_idx):
    """transformers' causal rule ``kv_idx <= q_idx`` (the default ``mask_function``)."""
    return kv_idx <= q_idx


def full_rule(batch_idx, head_idx, q_idx, kv_idx):
    """Every key (bidirectional attention)."""
    return torch.ones_like(kv_idx, dtype=torch.bool)


def padding_of(attention_mask: Optional[Tensor], length: int, device=None) -> Optional[Tensor]:
    """The 2-D padding mask ``[B, length]`` as bools (``True`` = real token), or ``None``.

    Cut or extended with ``False`` to ``length`` positions, as transformers does for keys
    beyond the mask (a static cache's empty slots).
    """
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be a 2-D padding mask [B, T] (got shape {list(attention_mask.shape)})")
    pad = attention_mask.to(device=device, dtype=torch.bool)[:, :length]
    if pad.shape[1] < length:
        pad = torch.nn.functional.pad(pad, (0, length - pad.shape[1]), value=False)
    return pad


def _allowed(rule: Callable, b: Tensor, q: Tensor, kv: Tensor) -> Tensor:
    """``rule`` at the pairs ``(q, kv)`` of each row, element-wise ``[B, Tq]`` bools."""
    return torch.as_tensor(rule(b, torch.zeros_like(q), q, kv)).to(torch.bool).expand(q.shape)


def intervals(rule: Callable, batch_size: int, q_pos: Tensor, k_lo: int, k_hi: int):
    """First and last key position each query may see under ``rule``, by binary search.

    Assumes what transformers' own rules (causal, sliding window, chunked, packed,
    bidirectional, and their intersections) satisfy: each query's allowed keys form one
    contiguous range that contains the query's own position (clamped to ``[k_lo, k_hi]``).
    Costs ``2 log2(k_hi - k_lo + 1)`` evaluations of ``rule`` on ``[B, Tq]`` index tensors.

    Returns:
        ``(lo, hi)``, each ``[B, Tq]``; a query that may see no key has ``lo > hi``.

    Example:
        >>> lo, hi = intervals(lambda b, h, q, kv: (kv <= q) & (kv > q - 2), 1, torch.arange(4), 0, 3)
        >>> lo.tolist(), hi.tolist()
        ([[0, 0, 1, 2]], [[0, 1, 2, 3]])
    """
    b = torch.arange(batch_size, device=q_pos.device).unsqueeze(1)  # [B, 1]
    q = q_pos.unsqueeze(0).expand(batch_size, -1)  # [B, Tq]
    anchor = q.clamp(k_lo, k_hi)
    ok = _allowed(rule, b, q, anchor)
    # Smallest allowed key in [k_lo, anchor]: invariant lo <= answer <= top, rule(top) holds.
    lo, top = torch.full_like(anchor, k_lo), anchor.clone()
    while bool((lo < top).any()):
        mid = (lo + top) // 2
        hit = _allowed(rule, b, q, mid)
        top, lo = torch.where(hit, mid, top), torch.where(hit, lo, mid + 1)
    # Largest allowed key in [anchor, k_hi]: invariant bottom <= answer <= hi, rule(bottom) holds.
    bottom, hi = anchor.clone(), torch.full_like(anchor, k_hi)
    while bool((bottom < hi).any()):
        mid = (bottom + hi + 1) // 2
        hit = _allowed(rule, b, q, mid)
        bottom, hi = torch.where(hit, mid, bottom), torch.where(hit, hi, mid - 1)
    return torch.where(ok, lo, k_hi + 1), torch.where(ok, hi, k_lo)


def interval_edges(lo: Tensor, hi: Tensor, kv_offset: int, kv_length: int) -> Tensor:
    """Edges from each query node ``b * Tq + i`` to its key positions ``lo[b, i] .. hi[b, i]``.

    Example:
        >>> interval_edges(torch.tensor([[0, 0]]), torch.tensor([[0, 1]]), 0, 2)
        tensor([[0, 0, 1],
                [0, 1, 1]])
    """
    batch_size, q_length = lo.shape
    count = (hi - lo + 1).clamp(min=0).flatten()  # [B Tq]
    start = (lo - kv_offset + torch.arange(batch_size, device=lo.device).unsqueeze(1) * kv_length).flatten()
    dst = torch.repeat_interleave(torch.arange(count.numel(), device=lo.device), count)  # [E]
    shift = start - (count.cumsum(0) - count)  # [B Tq] first key node minus the row's first edge number
    src = torch.arange(dst.numel(), device=lo.device) + shift[dst]  # [E]
    return torch.stack([src, dst])


def _evaluated_edges(batch_size, q_length, kv_length, q_offset, kv_offset, rule, attention_mask, device) -> Tensor:
    """Exact edges of any ``rule`` (custom overlays): transformers' own boolean mask, block by block.

    ``O(Tq Tk)`` time but never more than :data:`BLOCK_CELLS` mask cells at once.
    """
    from transformers.masking_utils import sdpa_mask

    rows = max(1, BLOCK_CELLS // max(batch_size * kv_length, 1))
    parts = []
    for first in range(0, q_length, rows):
        n = min(rows, q_length - first)
        mask = sdpa_mask(batch_size=batch_size, q_length=n, kv_length=kv_length, q_offset=q_offset + first,
                         kv_offset=kv_offset, mask_function=rule, attention_mask=attention_mask,
                         allow_is_causal_skip=False, use_vmap=True, device=device)  # [B, 1, n, Tk]
        b, i, j = mask[:, 0].nonzero(as_tuple=True)
        parts.append(torch.stack([b * kv_length + j, b * q_length + first + i]))
    return sort_unique(torch.cat(parts, dim=1), batch_size * kv_length)


def _drop(edge_index: Tensor, keep: Tensor) -> Tensor:
    return edge_index if bool(keep.all()) else edge_index[:, keep]


def edge_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable = causal_rule,
    attention_mask: Optional[Tensor] = None,
    *,
    config=None,
    use_vmap: bool = False,
    device=None,
    **kwargs,
) -> EdgeMask:
    """transformers' mask for one forward, as an :class:`EdgeMask` in ``O(E)`` memory.

    Registered with ``AttentionMaskInterface`` by :func:`tgattn.hf.register`; transformers
    calls it with the arguments of its own ``sdpa_mask`` (extra ones are ignored). Query
    ``i`` sits at position ``q_offset + i`` and key ``j`` at ``kv_offset + j`` (a decoding
    step: ``q_length`` new queries into a cache of ``kv_length`` keys). The edges are exactly
    the cells transformers' boolean mask would hold, minus the padded query slots:

    * default rules (``mask_function`` index based: causal, sliding window, chunked, packed
      sequences, bidirectional): each query's key range comes from :func:`intervals`, then
      padded keys are dropped. ``O(E + B Tq log Tk)``.
    * custom rules (``use_vmap=True``, e.g. ``or_mask_function`` overlays of vision tokens):
      transformers' own mask, evaluated in row blocks (``O(Tq Tk)`` time, bounded memory).
    * a pattern set by :func:`tgattn.hf.use_pattern` on this model's ``config`` replaces the
      model's rule in self-attention (see there); its ``topk`` goes with the mask to each
      attention call.

    Cross attention is told from the call (:func:`tgattn.hf.support.mask_request`: transformers'
    mask function was given ``encoder_hidden_states``), not from config flags, which a
    decoder's own sub-config does not carry. There the padding mask is the encoder's: it drops
    keys only, query slot ``i`` (a decoder token) keeps its edges, and no pattern applies.
    In self-attention, where query ``i`` is key position ``q_offset + i`` of its own row,
    padded query slots get no edge.

    Raises ``ValueError`` naming the model when the forward that asks for the mask belongs to
    a model that cannot run on tgattn (:func:`tgattn.hf.support.unsupported`), before any
    attention runs.

    Args:
        batch_size, q_length, kv_length: the sizes of the attention call.
        q_offset, kv_offset: position of the first query and of the first key.
        mask_function: ``rule(b, h, q_idx, kv_idx) -> bool`` (default: causal).
        attention_mask: 2-D padding mask ``[B, >= kv_offset + kv_length]``, ``None``, or an
            :class:`EdgeMask` this function made earlier (returned as it is).
        config: the model's config (reads its pattern).
        use_vmap: transformers' flag for custom rules that are not index based.
        device: where to build the edges.

    Example:
        >>> m = edge_mask(1, 3, 3)  # causal, one row of 3 tokens
        >>> m.edge_index
        tensor([[0, 0, 1, 0, 1, 2],
                [0, 1, 1, 2, 2, 2]])
        >>> pad = torch.tensor([[0, 1, 1]])  # left padding
        >>> edge_mask(1, 3, 3, attention_mask=pad).edge_index
        tensor([[1, 1, 2],
                [1, 2, 2]])
    """
    if isinstance(attention_mask, EdgeMask):  # prepared before the forward (static caches)
        return attention_mask
    request = mask_request()
    if request.model is not None:
        check_class(type(request.model), request.model.config._attn_implementation)
    q_offset, kv_offset = int(q_offset), int(kv_offset)
    end = kv_offset + kv_length
    pad = padding_of(attention_mask, end, device)
    padded = attention_mask is not None and not bool(attention_mask.bool().all())
    choice = choice_of(None if request.cross else config)
    pattern = choice.pattern
    if pattern is not None:
        edge_index = pattern_edges(pattern, mask_function, batch_size, q_length, kv_length, q_offset, kv_offset, pad)
    elif use_vmap:
        edge_index = _evaluated_edges(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, pad, device)
    elif kv_length == 0 or q_length == 0:
        edge_index = torch.empty(2, 0, dtype=torch.long, device=device)
    else:
        q_pos = torch.arange(q_length, device=device) + q_offset
        lo, hi = intervals(mask_function, batch_size, q_pos, kv_offset, end - 1)
        edge_index = interval_edges(lo, hi, kv_offset, kv_length)
        if pad is not None:
            src = edge_index[0]
            edge_index = _drop(edge_index, pad[src // kv_length, src % kv_length + kv_offset])
    if pad is not None and not request.cross and q_offset + q_length <= end:
        dst = edge_index[1]
        edge_index = _drop(edge_index, pad[dst // q_length, dst % q_length + q_offset])
    return EdgeMask(edge_index, batch_size, q_length, kv_length, topk=choice.topk, padded=padded)


def from_dense(mask: Tensor) -> EdgeMask:
    """An :class:`EdgeMask` from a 4-D mask ``[B, 1 or H, Tq, Tk]`` that a caller built by hand.

    Boolean masks keep the ``True`` cells; float masks are additive (transformers' eager
    convention): cells above the dtype's minimum become edges whose bias is the cell's value.
    A mask per head keeps the cells some head keeps, with a bias per head (``-inf`` where a
    head drops the cell: a head that sees no key outputs 0, as for a query without edges).

    Example:
        >>> from_dense(torch.tensor([[[[True, False], [True, True]]]])).edge_index
        tensor([[0, 0, 1],
                [0, 1, 1]])
        >>> low = torch.finfo(torch.float32).min
        >>> from_dense(torch.tensor([[[[0.0, low]], [[0.5, 2.0]]]])).bias  # [B, H, Tq, Tk] = [1, 2, 1, 2]
        tensor([[0.0000, 0.5000],
                [  -inf, 2.0000]])
    """
    if mask.dim() != 4:
        raise ValueError(f"a dense attention mask must have shape [B, 1 or H, Tq, Tk] (got {list(mask.shape)})")
    batch_size, heads, q_length, kv_length = mask.shape
    cells = mask.permute(0, 2, 3, 1)  # [B, Tq, Tk, H]
    kept = cells if mask.dtype == torch.bool else cells > torch.finfo(mask.dtype).min
    b, i, j = kept.any(dim=-1).nonzero(as_tuple=True)
    edge_index = torch.stack([b * kv_length + j, b * q_length + i])
    dropped = ~kept[b, i, j]  # [E, H]: heads that mask an edge another head keeps
    if mask.dtype != torch.bool:
        bias = cells[b, i, j].masked_fill(dropped, float("-inf"))
    elif heads > 1:
        bias = torch.zeros(dropped.shape, device=mask.device).masked_fill(dropped, float("-inf"))
    else:
        bias = None
    if bias is not None and not bool(bias.any()):
        bias = None
    if bias is not None and heads == 1:
        bias = bias[:, 0]  # [E]
    return EdgeMask(edge_index, batch_size, q_length, kv_length, bias=bias)
