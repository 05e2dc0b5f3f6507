"""The analysis of a never-seen edge set on a device (CUDA), with one read back to the host.

:func:`tgattn.engine.analysis.analyse` reads values back as it goes: the node ids' range, the
order, the repeats, the row spans, the kind (5-8 reads for a set without repeated edges). On the
host a read costs nothing; on a GPU each one makes the host wait for the device (a sync), and a
mini-batch GNN meets a new set every step. Here every pass runs on the device with sizes known on
the host (a stable argsort always: sorting a sorted set is cheaper than waiting to learn that it
is), the scalars the host needs are stacked, and they come back in one copy. The structure equals
the host analysis's (tested); only a set found to be packed (block-diagonal full or causal) reads
a second time, for its sequence lengths.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .analysis import Structure, row_pointer
from .validate import check_ranges

_FAR = 2**62  # beyond any j - i: the neutral value of the min / max over the rows' ends


def analyse_on_device(edge_index: Tensor, n_q: int, n_k: int) -> Structure:
    """:func:`~tgattn.engine.analysis.analyse` of a ``LongTensor[2, E]`` (type and shape checked) that
    also checks the node ids, with one host read (two for a packed set).

    Raises:
        ValueError: naming a node id outside ``[0, n_k) x [0, n_q)``.

    Example:
        >>> from tgattn import builders
        >>> s = analyse_on_device(builders.window(6, 1), 6, 6)
        >>> s.kind, s.intervals, s.extras["row_spans"], s.perm is None
        ('general', True, (-1, 1, 3, True), True)
    """
    E = edge_index.shape[1]
    src, dst = edge_index[0], edge_index[1]  # [E] keys j, queries i
    if E == 0:
        return Structure(n_q, n_k, 0, None, src.clone(), dst.clone(), row_pointer(dst, n_q), False)
    key = dst * max(n_k, 1) + src  # [E] the (target, source) order
    perm = torch.argsort(key, stable=True)  # [E]
    s_src, s_dst, s_key = src[perm], dst[perm], key[perm]
    # clamped: out-of-range ids are reported after the read, and must not fault before it
    rowptr = row_pointer(s_dst.clamp(0, max(n_q - 1, 0)), n_q)
    first = torch.ones(E, dtype=torch.bool, device=src.device)  # [E] the first edge of its row
    first[1:] = s_dst[1:] != s_dst[:-1]
    last = torch.ones_like(first)  # [E] the last edge of its row
    last[:-1] = first[1:]
    offset = s_src - s_dst  # [E] j - i
    stats = [
        edge_index.min(), src.max(), dst.max(),
        (key[1:] < key[:-1]).any(), (s_key[1:] == s_key[:-1]).any(),
        first.sum(),  # rows with edges
        torch.where(first, offset, _FAR).min(), torch.where(last, offset, -_FAR).max(), rowptr.diff().max(),
        (s_src * last).sum() - (s_src * first).sum(),  # sum of the rows' spans (last - first key)
        (s_src <= s_dst).all(),
    ]
    packed = _packed_flags(s_src, rowptr, n_q) if n_q == n_k and E >= n_q else None
    if packed is not None:
        stats += packed[:3]
    values = torch.stack([t.long() for t in stats]).tolist()  # the one read
    lo, src_max, dst_max, unsorted, duplicates, rows, span_lo, span_hi, deg_max, spans, causal_ok = values[:11]
    if lo < 0 or src_max >= n_k or dst_max >= n_q:
        check_ranges(edge_index, n_k, n_q)  # raises, naming the node
    if not unsorted:  # copies of the caller's edges already, in their order
        perm = None
    s = Structure(n_q, n_k, E, perm, s_src, s_dst, rowptr, bool(duplicates))
    whole = not duplicates and spans + rows == E
    s.extras["row_spans"] = (span_lo, span_hi, deg_max, whole)
    if duplicates:
        return s
    s.intervals = whole
    if E == n_q * n_k:
        s.kind, s.intervals = "full", True
    elif whole and n_q == n_k and rows == n_q:
        if E == n_q * (n_q + 1) // 2 and causal_ok:
            s.kind = "causal"
        elif packed is not None and values[11] and (values[12] or values[13]):
            starts = packed[3].nonzero().flatten()  # [B] the second read: the sequences' first rows
            s.kind = "packed_full" if values[12] else "packed_causal"
            s.lengths = tuple(torch.diff(starts, append=starts.new_tensor([n_q])).tolist())
    return s


def _packed_flags(s_src: Tensor, rowptr: Tensor, n: int) -> Optional[list]:
    """``[segments, full, causal, starts]`` of a set of ``n`` queries over ``n`` keys read as
    sequences: a sequence starts at a row whose first key is itself; ``segments`` (0-dim) holds when
    row 0 starts one and every row's first key is its sequence's first row, ``full`` when every row's
    last key is its sequence's last row, ``causal`` when it is the row itself; ``starts [n]`` marks the
    first rows. Meaningful where every row has edges and keys form one range (the caller checks)."""
    E = s_src.numel()
    rows = torch.arange(n, device=s_src.device)
    first = s_src[rowptr[:-1].long().clamp(max=E - 1)]  # [n] each row's first key
    last = s_src[(rowptr[1:].long() - 1).clamp(min=0)]  # [n] each row's last key
    starts = first == rows  # [n]
    own = torch.cummax(torch.where(starts, rows, -1), 0).values  # [n] the first row of each row's sequence
    after = torch.where(starts, rows, n).flip(0).cummin(0).values.flip(0)  # [n] the next start at or after a row
    ends = torch.cat([after[1:], after.new_tensor([n])])  # [n] exclusive end of each row's sequence
    return [starts[0] & (first == own).all(), (last == ends - 1).all(), (last == rows).all(), starts]
