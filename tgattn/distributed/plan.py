"""The halo plan of one rank: its local edge set and the routes of the key / value rows it needs.

Rank r owns the queries ``nodes`` (a :class:`~tgattn.distributed.partition.Partition`) and
their incoming edges. Its *key table* holds every key row those edges read, ordered by owner
rank and then by global id: the rows received from lower ranks, its own rows, the rows
received from higher ranks. For contiguous ranges this is increasing global order, so a
band (window) stays a band in local numbers. The local ``edge_index`` points into that table
(row 0) and into the owned queries (row 1); :func:`~tgattn.distributed.exchange.halo_exchange`
fills the table with one ``all_to_all_single``.

Building a plan is itself distributed (:func:`make_plan`): each rank lists the remote rows its
edges read, grouped by owner; the counts go out first (``all_to_all_single`` of one integer
per rank pair), then the requested global ids, which the owners turn into local row indices to
send. :func:`make_plans` builds every rank's plan in one process (same code, the exchange done
by hand) for analysis and tests.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from ..edgeset import EdgeSet, edge_tensor, prepare
from .partition import Partition


@dataclass
class ExchangeStats:
    """Counters of the exchanges of one plan (forward and backward both count).

    ``seconds`` is the wall time inside ``all_to_all_single`` and the copies around it, which
    includes waiting for the slowest rank to arrive.
    """

    calls: int = 0
    rows_sent: int = 0
    rows_received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0

    def add(self, sent: Tensor, received: Tensor, seconds: float) -> None:
        self.calls += 1
        self.rows_sent += sent.shape[0]
        self.rows_received += received.shape[0]
        self.bytes_sent += sent.numel() * sent.element_size()
        self.bytes_received += received.numel() * received.element_size()
        self.seconds += seconds


@dataclass
class HaloPlan:
    """What one rank needs to run attention over its queries' incoming edges.

    Attributes:
        rank, world_size: this rank and the number of ranks.
        nodes: global ids of the owned queries ``[N_r]`` (local query i is ``nodes[i]``).
        keys: global ids of the key table ``[K_r]`` (local key j is ``keys[j]``).
        own_offset: ``keys[own_offset : own_offset + N_r] == nodes``.
        edge_index: local edges ``[2, E_r]`` (row 0 into ``keys``, row 1 into ``nodes``), in
            the order of the edges the plan was made from (so an edge bias keeps its order).
        send_index: local rows sent to other ranks ``[S_r]``, grouped by destination rank.
        send_counts, recv_counts: rows sent to / received from each rank (``world_size`` ints).
        group: the ``torch.distributed`` process group of the exchange (``None``: the default).
        stats: :class:`ExchangeStats` that every exchange along this plan adds to; ``None``
            (default) keeps no counts. Set it to measure: ``plan.stats = ExchangeStats()``.
    """

    rank: int
    world_size: int
    nodes: Tensor
    keys: Tensor
    own_offset: int
    edge_index: Tensor
    send_index: Tensor
    send_counts: List[int]
    recv_counts: List[int]
    group: Optional[object] = None
    stats: Optional[ExchangeStats] = None

    @property
    def num_queries(self) -> int:
        return self.nodes.numel()

    @property
    def num_keys(self) -> int:
        return self.keys.numel()

    @cached_property
    def edge_set(self) -> EdgeSet:
        """``edge_index`` prepared (:func:`tgattn.prepare`) for the attention of every layer and step
        along this plan: validated and analysed on first use, once (``edge_index`` is not to be
        replaced afterwards)."""
        return prepare(self.edge_index, self.num_queries, self.num_keys)

    @property
    def halo_rows(self) -> int:
        """Key rows received from other ranks per exchange (= rows of this rank's halo)."""
        return sum(self.recv_counts)

    def global_edges(self) -> Tensor:
        """The local edges in global ids ``[2, E_r]``."""
        return torch.stack([self.keys[self.edge_index[0]], self.nodes[self.edge_index[1]]])

    def __repr__(self) -> str:
        return (f"HaloPlan(rank={self.rank}/{self.world_size}, queries={self.num_queries}, "
                f"halo={self.halo_rows}, edges={self.edge_index.shape[1]})")


def _requests(edge_index: Tensor, partition: Partition, rank: int) -> Tuple[Tensor, Tensor]:
    """The remote key rows read by ``edge_index`` ``[R]``, sorted by (owner, id), and how many
    come from each rank ``[world_size]``."""
    owner, n = partition.owner, max(partition.num_nodes, 1)
    src = edge_index[0]
    remote = src[owner[src] != rank]
    key = torch.unique(owner[remote] * n + remote)  # sorted by (owner, global id)
    return key % n, torch.bincount(key // n, minlength=partition.world_size)


def _assemble(edge_index: Tensor, partition: Partition, rank: int, halo: Tensor, recv_counts: Tensor,
              requested: Tensor, send_counts: Tensor, group) -> HaloPlan:
    nodes = partition.nodes(rank).to(edge_index.device)
    lower = int(recv_counts[:rank].sum())
    keys = torch.cat([halo[:lower], nodes, halo[lower:]])  # [K_r]
    order = torch.argsort(keys)
    src = order[torch.searchsorted(keys[order], edge_index[0])]  # every source is in the table
    dst = torch.searchsorted(nodes, edge_index[1])
    send_index = torch.searchsorted(nodes, requested)
    return HaloPlan(rank, partition.world_size, nodes, keys, lower, torch.stack([src, dst]), send_index,
                    send_counts.tolist(), recv_counts.tolist(), group)


def _check_local(edge_index, partition: Partition, rank: int) -> Tensor:
    edge_index = edge_tensor(edge_index)
    if edge_index.dim() != 2 or edge_index.shape[0] != 2:
        raise ValueError(f"edge_index must have shape [2, E] (got {list(edge_index.shape)})")
    edge_index = edge_index.long()
    if edge_index.numel():
        lo, hi = int(edge_index.min()), int(edge_index.max())
        if lo < 0 or hi >= partition.num_nodes:
            raise ValueError(f"edge_index refers to node {lo if lo < 0 else hi}, but the partition has "
                             f"{partition.num_nodes} nodes")
        foreign = partition.owner.to(edge_index.device)[edge_index[1]] != rank
        if bool(foreign.any()):
            i = int(edge_index[1][foreign][0])
            raise ValueError(f"rank {rank} was given an edge into query {i}, which rank "
                             f"{int(partition.owner[i])} owns (pass partition.local_edges(edge_index, rank))")
    return edge_index


def make_plan(edge_index, partition: Partition, *, group=None) -> HaloPlan:
    """This rank's plan, built collectively: every rank of ``group`` calls it at the same time.

    Args:
        edge_index: the edges into this rank's queries, global ids ``[2, E_r]`` (e.g.
            ``partition.local_edges(edge_index, rank)``), or an :class:`~tgattn.EdgeSet` of them,
            on the device the backend serves (CPU for gloo, this rank's GPU for NCCL).
        partition: the same :class:`Partition` on every rank.
        group: the process group (default: the default group). Not needed for one rank.

    Raises:
        ValueError: when the group size and ``partition.world_size`` differ, or when an edge
            leads into a query this rank does not own.

    Example:
        >>> from tgattn import builders
        >>> from tgattn.distributed.partition import contiguous
        >>> make_plan(builders.window(6, 1), contiguous(6, 1))  # one rank: no process group needed
        HaloPlan(rank=0/1, queries=6, halo=0, edges=16)
    """
    import torch.distributed as dist

    world = partition.world_size
    if world == 1 and not dist.is_initialized():
        rank = 0
    else:
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        if size != world:
            raise ValueError(f"the process group has {size} ranks, but the partition has {world} parts")
    edge_index = _check_local(edge_index, partition, rank)
    owner = partition.owner.to(edge_index.device)
    local = Partition(owner, world, partition.method) if owner is not partition.owner else partition
    halo, recv_counts = _requests(edge_index, local, rank)
    if world == 1:
        return _assemble(edge_index, local, rank, halo, recv_counts, halo, recv_counts, group)
    send_counts = torch.empty_like(recv_counts)
    dist.all_to_all_single(send_counts, recv_counts, group=group)  # sizes first
    requested = halo.new_empty(int(send_counts.sum()))
    dist.all_to_all_single(requested, halo, send_counts.tolist(), recv_counts.tolist(), group=group)
    return _assemble(edge_index, local, rank, halo, recv_counts, requested, send_counts, group)


def make_plans(edge_index, partition: Partition) -> List[HaloPlan]:
    """Every rank's plan, in one process (the request exchange done by hand, no process group).

    For analysis (halo sizes of a partition) and tests; equal to what :func:`make_plan`
    builds on each rank.

    Example:
        >>> from tgattn import builders
        >>> from tgattn.distributed.partition import contiguous
        >>> [p.halo_rows for p in make_plans(builders.window(12, 2), contiguous(12, 3))]
        [2, 4, 2]
    """
    world, edge_index = partition.world_size, edge_tensor(edge_index)  # ``edge_index``: a tensor or an EdgeSet
    local = [_check_local(partition.local_edges(edge_index, r), partition, r) for r in range(world)]
    asked = [_requests(e, partition, r) for r, e in enumerate(local)]
    # pieces[w][r]: the global ids rank w asks rank r for
    pieces = [halo.split(counts.tolist()) for halo, counts in asked]
    plans = []
    for r in range(world):
        requested = torch.cat([pieces[w][r] for w in range(world)])
        send_counts = torch.tensor([pieces[w][r].numel() for w in range(world)], dtype=torch.long)
        plans.append(_assemble(local[r], partition, r, asked[r][0], asked[r][1], requested, send_counts, None))
    return plans
