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

from typing import Optional, Tuple

import numpy
import torch
from torch import Tensor

from .analysis import Structure, row_pointer
from .validate import check_ranges

def analyse_on_device(edge_index: Tensor, n_q: int, n_k: int, *, loops_among: Optional[int] = None) -> Structure:
    """:func:`~tgattn.engine.analysis.analyse` of a ``LongTensor[2, E]`` (type and shape checked) that
    also checks the node ids, with one host read (two for a set whose keys form one range per row,
    every row with edges: the packed kinds' test).

    ``loops_among``: also count, in the same read, the self-loops ``(i, i)`` among the first
    ``loops_among`` edges as given (``extras["loops_among"]``): a set given with loops appended tells
    whether its first part had loops of its own.

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
        s = Structure(n_q, n_k, 0, None, src.clone(), dst.clone(), row_pointer(dst, n_q), False)
        s.extras.update({} if loops_among is None else {"loops_among": 0})
        return s
    if n_q == 0 or n_k == 0:
        check_ranges(edge_index, n_k, n_q)  # raises: edges among no nodes
    key = torch.add(src, dst, alpha=max(n_k, 1))  # [E] i * n_k + j: the (target, source) order
    perm = torch.sort(key, stable=True).indices
    pairs = edge_index[:, perm]  # [2, E] the sorted keys j and queries i, one gather for both
    s_src, s_dst = pairs[0], pairs[1]
    # searchsorted, not a count: ids out of range are reported after the read, and must not fault before it
    bounds = torch.arange(n_q + 1, device=src.device)
    rowptr = torch.searchsorted(s_dst, bounds, out_int32=E < 2**31)  # [n_q + 1] as row_pointer makes it
    ids = torch.aminmax(edge_index, dim=1)  # [2] each: the least and largest key and query
    offsets = torch.aminmax(s_src - s_dst)  # j - i; a row's first edge has its least, its last its largest
    degrees = torch.aminmax(rowptr.diff())  # no row without edges when the least is > 0
    stats = [*ids.min, *ids.max, *offsets, *degrees, (pairs != edge_index).any()]  # out of order as given
    if E > 1:
        # From an edge to the next inside a row, the key's step (1 where the next edge starts a row): sorted keys
        # have steps >= 0; a 0 repeats an edge, and the rows' keys are all ranges when every step is 1.
        step = pairs.diff(dim=1)  # [2, E - 1] (key step, query step)
        stats.extend(torch.aminmax(step[0].masked_fill(step[1] != 0, 1)))
    if loops_among is not None:
        stats.append((src[:loops_among] == dst[:loops_among]).sum())
    values = torch.stack(stats).tolist()  # the read
    src_lo, dst_lo, src_max, dst_max, span_lo, span_hi, deg_min, deg_max, unsorted = values[:9]
    step_lo, step_hi = values[9:11] if E > 1 else (1, 1)
    if min(src_lo, dst_lo) < 0 or src_max >= n_k or dst_max >= n_q:
        check_ranges(edge_index, n_k, n_q)  # raises, naming the node
    duplicates = step_lo == 0
    s = Structure(n_q, n_k, E, perm if unsorted else None, s_src, s_dst, rowptr, duplicates)
    if loops_among is not None:
        s.extras["loops_among"] = values[-1]
    whole = not duplicates and step_hi == 1
    s.extras["row_spans"] = (span_lo, span_hi, deg_max, whole)
    if duplicates:
        return s
    s.intervals = whole
    if E == n_q * n_k:
        s.kind, s.intervals = "full", True
    elif whole and n_q == n_k and deg_min > 0:  # every row with edges
        if E == n_q * (n_q + 1) // 2 and span_hi <= 0:  # no key after its query
            s.kind = "causal"
        else:
            s.kind, s.lengths = _packed(s_src, rowptr, n_q)
    return s


def _packed(s_src: Tensor, rowptr: Tensor, n: int) -> Tuple[str, Optional[Tuple[int, ...]]]:
    """``(kind, lengths)`` of a set of ``n`` queries over ``n`` keys, every row with edges and its keys one
    range: ``packed_full`` or ``packed_causal`` with the sequence lengths, else ``("general", None)``. A
    sequence starts at a row whose first key is itself; the set is packed when row 0 starts one, every
    row's first key is its sequence's first row and every row's last key its sequence's last row (full)
    or the row itself (causal). One read: the three tests and the starts."""
    rows = torch.arange(n, device=s_src.device)
    first, last = s_src[rowptr[:-1].long()], s_src[rowptr[1:].long() - 1]  # [n] each row's first and last key
    starts = first == rows  # [n]
    own = torch.cummax(torch.where(starts, rows, -1), 0).values  # [n] the first row of each row's sequence
    ends = torch.where(starts, rows, n).flip(0).cummin(0).values.flip(0).roll(-1)  # [n] the next start after a row
    ends[-1:].fill_(n)  # (a fill, not a copy of a host value)
    broken = torch.stack([(first != own).sum(), (last != ends - 1).sum(), (last != rows).sum()])
    read = torch.cat([broken, starts.long()]).cpu().numpy()  # the second read
    if read[0] or not read[3] or (read[1] and read[2]):
        return "general", None
    lengths = numpy.diff(numpy.append(numpy.flatnonzero(read[3:]), n))
    return ("packed_full" if not read[1] else "packed_causal"), tuple(lengths.tolist())
