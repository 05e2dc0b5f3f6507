"""Token sequences as PyG graphs: one node per token, the attention pattern as ``edge_index``.

A batch of variable-length sequences is one :class:`torch_geometric.data.Batch`: node ids
of sequence b are offset by the lengths before it, so no edge crosses two sequences (the
same as a padding mask, without the padding). Edge convention as everywhere in tgattn:
``edge_index[0]`` = key j, ``edge_index[1]`` = query i.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor
from torch_geometric.data import Batch, Data
from torch_geometric.utils import to_dense_batch

from .builders import causal

Builder = Callable[..., Tensor]


def _one(tokens, builder: Builder, strings: Optional[Sequence[str]], device, builder_args) -> Data:
    x = torch.as_tensor(tokens, device=device)
    if isinstance(tokens, (list, tuple)) and not tokens:
        x = x.long()  # an empty list is an empty sequence of ids
    if x.dim() == 0 or (x.dim() == 1 and x.is_floating_point()):
        raise ValueError(f"tokens must be token ids [T] (integers) or features [T, D] (got shape {list(x.shape)}, {x.dtype})")
    n = x.shape[0]
    edge_index = builder(n, **builder_args).to(x.device)
    if edge_index.dim() != 2 or edge_index.shape[0] != 2:
        raise ValueError(f"the builder must return edge_index [2, E] (got {list(edge_index.shape)})")
    if edge_index.numel() and int(edge_index.max()) >= n:
        raise ValueError(f"the builder returned node {int(edge_index.max())} for a sequence of {n} tokens")
    data = Data(x=x, edge_index=edge_index, position=torch.arange(n, device=x.device), num_nodes=n)
    if strings is not None:
        if len(strings) != n:
            raise ValueError(f"got {len(strings)} token strings for {n} tokens")
        data.text = list(strings)
    return data


def sequence_to_graph(
    tokens,
    builder: Builder = causal,
    *,
    strings: Optional[Sequence] = None,
    device=None,
    **builder_args,
) -> Union[Data, Batch]:
    """One sequence -> a :class:`~torch_geometric.data.Data`; a list of sequences -> a :class:`~torch_geometric.data.Batch`.

    Each graph has ``x`` (token ids ``[T]`` long, or node features ``[T, D]``), ``edge_index``
    = ``builder(T, **builder_args)`` (e.g. ``builders.window`` with ``w=2``), ``position``
    ``[T]`` (0 .. T - 1, restarting in every sequence) and, if given, ``text``: the token
    strings. Random builders are called once per sequence, so every sequence gets its own draw.

    Args:
        tokens: ``[T]`` ids (tensor or list of ints) or ``[T, D]`` features (tensor), or a
            list of such sequences (a list whose items are tensors or lists is a batch).
        builder: a builder taking the length first (default: :func:`tgattn.builders.causal`).
        strings: the token strings (a list per sequence for a batch).
        device: where to put the graph.
        **builder_args: passed to ``builder`` (``w=``, ``generator=``, ...).

    Example:
        >>> from tgattn import builders
        >>> g = sequence_to_graph([5, 7, 9], builders.window, w=1, strings=["a", "b", "c"])
        >>> g.edge_index.tolist(), g.position.tolist(), g.text
        ([[0, 1, 0, 1, 2, 1, 2], [0, 0, 1, 1, 1, 2, 2]], [0, 1, 2], ['a', 'b', 'c'])
        >>> batch = sequence_to_graph([[1, 2, 3], [4, 5]])  # causal by default
        >>> batch.edge_index.tolist()  # nodes 3, 4 are the second sequence: no edge crosses
        [[0, 0, 1, 0, 1, 2, 3, 3, 4], [0, 1, 1, 2, 2, 2, 3, 4, 4]]
        >>> batch.batch.tolist(), batch.position.tolist()
        ([0, 0, 0, 1, 1], [0, 1, 2, 0, 1])
    """
    if _is_batch(tokens):
        if strings is not None and len(strings) != len(tokens):
            raise ValueError(f"got {len(strings)} string lists for {len(tokens)} sequences")
        items = [
            _one(t, builder, None if strings is None else strings[b], device, builder_args) for b, t in enumerate(tokens)
        ]
        return Batch.from_data_list(items)
    return _one(tokens, builder, strings, device, builder_args)


def _is_batch(tokens) -> bool:
    """A list whose items are tensors or lists is a batch; a tensor or a flat list is one sequence."""
    return isinstance(tokens, (list, tuple)) and any(isinstance(t, (Tensor, list, tuple)) for t in tokens)


def from_padded(tokens: Tensor, padding_mask: Tensor, builder: Builder = causal, **builder_args) -> Batch:
    """A padded batch ``[B, T]`` (ids) or ``[B, T, D]`` (features) -> a :class:`Batch` without the padding.

    ``padding_mask [B, T]`` is True at padding (the ``key_padding_mask`` convention of
    :class:`torch.nn.MultiheadAttention`; pass ``~attention_mask.bool()`` for a Hugging Face
    mask). The kept tokens of each row, in order, form one sequence, so left and right
    padding both work; ``position`` counts kept tokens only.

    Example:
        >>> tokens = torch.tensor([[4, 5, 6], [7, 8, 0]])
        >>> pad = torch.tensor([[False, False, False], [False, False, True]])
        >>> batch = from_padded(tokens, pad)
        >>> batch.x.tolist(), batch.ptr.tolist()
        ([4, 5, 6, 7, 8], [0, 3, 5])
        >>> padded, mask = to_padded(batch)
        >>> torch.equal(padded, tokens) and torch.equal(mask, pad)
        True
    """
    if tokens.dim() < 2 or padding_mask.shape != tokens.shape[:2] or padding_mask.dtype != torch.bool:
        raise ValueError(
            f"padding_mask must be a bool tensor of shape [B, T] = {list(tokens.shape[:2])} "
            f"(got {list(padding_mask.shape)}, {padding_mask.dtype})"
        )
    rows: List[Tensor] = [row[~pad] for row, pad in zip(tokens, padding_mask)]
    return Batch.from_data_list([_one(row, builder, None, None, builder_args) for row in rows])


def to_padded(
    data: Union[Data, Batch, Tensor], batch: Optional[Tensor] = None, *, fill_value: float = 0, max_len: Optional[int] = None
) -> Tuple[Tensor, Tensor]:
    """Node values back to a padded batch: ``(padded [B, T, ...], padding_mask [B, T])``.

    ``padding_mask`` is True at padding. Works on a graph from :func:`sequence_to_graph` /
    :func:`from_padded` (uses its ``x`` and ``batch``) or on any per-node tensor, e.g. the
    layer's output ``[N, D]``, with the ``batch`` vector. Sequences are right-padded.

    Args:
        data: a ``Data`` / ``Batch`` or a node tensor ``[N, ...]``.
        batch: sequence id of each node ``[N]`` (taken from ``data`` when it is a graph;
            default: one sequence).
        fill_value: value at padded positions.
        max_len: pad to this length ``T`` (default: the longest sequence).
    """
    if isinstance(data, (Data, Batch)):
        x = data.x
        batch = getattr(data, "batch", None) if batch is None else batch
    else:
        x = data
    if batch is None:
        batch = torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
    longest = int(torch.bincount(batch).max()) if batch.numel() else 0
    if max_len is not None and max_len < longest:
        raise ValueError(f"max_len = {max_len} is shorter than the longest sequence ({longest} tokens)")
    padded, valid = to_dense_batch(x, batch, fill_value=fill_value, max_num_nodes=max_len)
    return padded, ~valid
