"""The influence page's data made while the weights are made, one block of queries at a time.

:func:`tgattn.analysis.export.influence_data` takes every layer's weights at once: for a causal
text of N tokens that is ``N^2 / 2`` edges per layer and head (10,000 tokens, 2 layers x 2 heads:
>= 9.5 GB at the peak). :func:`streamed_influence_data` takes them as :class:`Block`\\ s of
:data:`~tgattn.analysis.rollout.TILE` queries, layer after layer, and keeps of each block only

* per view (the mean over heads and each head), each query's top ``top_k`` keys and what was pruned;
* its rows of the rollout's dense tiles (:func:`~tgattn.analysis.rollout.next_tile`), for the next
  layer; the last layer's rollout rows are pruned as they are made;
* what the flow into ``query`` needs: with one or two layers, the query's row of the last layer
  (the first layer's rows are the rollout tiles); deeper, the rows of the query's cone when it has
  at most :data:`~tgattn.analysis.export.FLOW_EDGES` edges.

So the peak follows the rollout's tiles (8 bytes per entry of one layer's band, two layers' while
a third is made) and one block, not the edges (:func:`tgattn.analysis.budget.estimate_memory`).
The result equals :func:`~tgattn.analysis.export.influence_data` of the whole layers (tested), for
edge sets whose queries each read one run of keys holding themselves (``budget.key_ranges``).
A NaN weight spreads to its whole block of the rollout here (a dense tile multiplies it by 0).
"""
from __future__ import annotations

from typing import Iterable, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch
from scipy.sparse import csr_matrix, vstack
from torch import Tensor
from tqdm import tqdm

from .export import FLOW_EDGES, Tally, concat, document, tile_top, top_per_row, views_of
from .flow import check_finite_cone, flow_cone, ranked, top_flow_of
from .rollout import TILE, Tiles, first_tile, next_tile
from .weights import layer_csr


class Block(NamedTuple):
    """The weights of queries ``start .. start + TILE - 1`` (fewer at the end) in one layer."""

    layer: int  # from 0, in order
    start: int  # a multiple of TILE: blocks come in order of their queries and cover them all
    edge_index: Tensor  # [2, E_b]: row 0 = key j, row 1 = query i, sorted by (i, j), no duplicates
    alpha: Tensor  # [E_b, H]


def streamed_influence_data(tokens: Sequence[str], blocks: Iterable[Block], *, heads: Sequence[int],
                            key_ranges: Sequence[np.ndarray], query: int = -1, title: str = "", top_k: int = 10,
                            threshold: float = 1e-3, progress: bool = False) -> dict:
    """:func:`~tgattn.analysis.export.influence_data` of weights that come as :class:`Block`\\ s.

    Args:
        tokens: one label per token.
        blocks: every layer's blocks, layer 0 first (e.g. :func:`tgattn.analysis.random_layers.random_attention_blocks`).
        heads: the heads of each layer (one entry per layer).
        key_ranges: ``(lo, hi)``: query i reads keys ``lo[i] .. hi[i] - 1``, a run holding i, neither end
            decreasing with i (:func:`tgattn.analysis.budget.key_ranges`); the flow's cone is read from it.
        query, title, top_k, threshold, progress: as for :func:`~tgattn.analysis.export.influence_data`.
    """
    n, layers = len(tokens), len(heads)
    query %= n
    lo, hi = (np.asarray(r) for r in key_ranges)
    cone = _cone(lo, hi, query, layers)  # per layer l = 0 .. L: the tokens (a run) of its nodes in the cone
    cone_edges = sum(int((hi[a:b] - lo[a:b]).sum()) for a, b in cone[1:])
    deep_flow = layers > 2 and cone_edges <= FLOW_EDGES
    kept = [[[] for _ in range(h + 1)] for h in heads]
    tallies = [[Tally() for _ in range(h + 1)] for h in heads]
    rollout, rollout_tally = [], Tally()
    current: Optional[Tiles] = None  # the rollout so far, through the layers before the block's
    following: Tiles = []
    into_output: Optional[np.ndarray] = None  # the query's row of the last layer, for one or two layers
    cone_rows: List[List[Tuple[int, csr_matrix]]] = [[] for _ in range(layers)]
    expected = (0, 0)
    for block in tqdm(blocks, total=layers * -(-n // TILE), disable=not progress, desc="weights, block by block"):
        if (block.layer, block.start) != expected:
            raise ValueError(f"blocks must come layer by layer, {TILE} queries each, in order: expected layer "
                             f"{expected[0]} from query {expected[1]} (got layer {block.layer} from {block.start})")
        start, stop, last = block.start, min(block.start + TILE, n), block.layer == layers - 1
        rows = block.edge_index[1].cpu() - start
        ptr = torch.searchsorted(rows, torch.arange(stop - start + 1))
        values = views_of(block.alpha)  # [E_b, V]
        for view, piece in enumerate(top_per_row(ptr, block.edge_index[0].cpu(), values, top_k, threshold)):
            kept[block.layer][view].append(piece)
            tallies[block.layer][view].add(values[:, view], piece[2])
        matrix = layer_csr(block.edge_index, block.alpha, n)[start:stop]  # [B, N]: rownorm(0.5 A + 0.5 I) of its rows
        first, tile = first_tile(matrix) if current is None else next_tile(current, matrix)
        if last:
            rollout.append(tile_top(first, tile, top_k, threshold))
            rollout_tally.add(torch.from_numpy(tile[tile != 0]), rollout[-1][2])
        else:
            following.append((first, tile))
        if last and layers <= 2 and start <= query < stop:
            into_output = matrix[query - start].toarray().ravel()  # [N]
        a, b = cone[block.layer + 1]
        if deep_flow and a < stop and start < b:  # the block's rows in the cone
            cone_rows[block.layer].append((max(a, start), matrix[max(a, start) - start:min(b, stop) - start]))
        expected = (block.layer, stop) if stop < n else (block.layer + 1, 0)
        if stop == n and not last:
            current, following = following, []
    if expected != (layers, 0):
        raise ValueError(f"the blocks ended at layer {expected[0]}, query {expected[1]} (of {layers} layers, {n} queries)")
    if layers <= 2:
        flow = _shallow_flow(into_output, current, query, top_k)
    elif deep_flow:
        flow = _deep_flow(cone_rows, n, query, top_k)
    else:
        flow = {"token": query, "skipped": f"its cone has {cone_edges:,} edges, more than {FLOW_EDGES:,}"}
    return document(tokens, title=title, query=query, top_k=top_k, threshold=threshold,
                    layers=[[concat(pieces) for pieces in views] for views in kept],
                    pruned=[[tally.lost() for tally in views] for views in tallies],
                    rollout=concat(rollout), rollout_pruned=rollout_tally.lost(), flow=flow)


def _cone(lo: np.ndarray, hi: np.ndarray, output: int, layers: int) -> List[tuple]:
    """The runs of tokens ``[a, b)`` whose node reaches ``(L, output)``, per layer 0 .. L."""
    runs = [(output, output + 1)]
    for _ in range(layers):
        a, b = runs[0]
        runs.insert(0, (int(lo[a]), int(hi[b - 1])))
    return runs


def _shallow_flow(into_output: np.ndarray, first_layer: Optional[Tiles], query: int, top_k: int) -> dict:
    """The top flow of one or two layers: ``A1[o, j]``, or ``sum_m min(A1[m, j], A2[o, m])`` with the first
    layer's rows read from the rollout's tiles (the paths through different m share no edge)."""
    if first_layer is None:  # one layer
        values = into_output
    else:
        values = np.zeros(len(into_output))
        for t, (column, tile) in enumerate(first_layer):
            share = into_output[t * TILE:t * TILE + tile.shape[0], None]  # [B, 1]: A2[o, m] for the tile's rows m
            if share.any() or np.isnan(share).any():
                values[column:column + tile.shape[1]] += np.minimum(tile, share).sum(0)
    if not np.isfinite(values).all():
        return {"token": query, "skipped": f"a weight on a path into token {query} is not finite: the flows through "
                                           "it are unknown and cannot be ranked"}
    index, value = ranked(zip(values.tolist(), range(len(values))), top_k)
    return {"token": query, "index": index.tolist(), "value": [round(v, 12) for v in value.tolist()]}


def _deep_flow(cone_rows: List[List[Tuple[int, csr_matrix]]], n: int, query: int, top_k: int) -> dict:
    """The top flow of three or more layers from the cone's rows of each layer (the other rows left empty)."""
    matrices = []
    for pieces in cone_rows:  # (first row, rows [b, N]) in order, one run of rows per layer
        first = pieces[0][0]
        rows = vstack([part for _, part in pieces])
        matrices.append(vstack([csr_matrix((first, n)), rows, csr_matrix((n - first - rows.shape[0], n))]).tocsr())
    try:
        check_finite_cone(flow_cone(matrices, query), query)
    except ValueError as unknown:
        return {"token": query, "skipped": str(unknown)}
    index, value = top_flow_of(matrices, query, top_k)
    return {"token": query, "index": index.tolist(), "value": [round(v, 12) for v in value.tolist()]}
