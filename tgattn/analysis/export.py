"""What the influence page shows, as data: the kept edges of every layer and head, the rollout and
the flow into one token, pruned and quantised, in a documented JSON file (``docs/influence.md``).

Per token (query) and per view (a layer's mean over heads, or one head) only the ``top_k``
strongest keys whose weight is at least ``threshold`` are kept, so the data grows with
``N * top_k``, not with the edges (``N^2`` for causal attention). What was dropped is counted
and weighed per view (``pruned``). Weights are quantised per query to 16 bits of the query's
largest kept weight (error below 8e-6 of it), and every array is little-endian binary in
base64, which a browser decodes view by view.

A NaN or infinite weight is kept (ranked first: its size is unknown) and marked in the view's
``flags``; a total it enters is written as ``null`` beside a count of such weights
(``nonfinite``), so the file stays JSON that a browser parses and the page can say what it holds.
"""
from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import Tensor
from tqdm import tqdm

from ..builders._common import check_count
from .budget import FLOW_EDGES, THRESHOLD, TOP_K
from .flow import check_finite_cone, flow_cone, top_flow
from .influence_file import LEVELS, check_influence  # a weight is stored as round(LEVELS * weight / its row's scale)
from .rollout import rollout_tiles
from .weights import Layer, as_layers, count_nodes, layer_csr

FORMAT, VERSION = "tgattn.influence", 1


def influence_data(
    tokens: Sequence[str],
    attention: Union[Layer, Sequence[Layer]],
    *,
    query: int = -1,
    title: str = "",
    top_k: int = TOP_K,
    threshold: float = THRESHOLD,
    flow: bool = True,
    progress: bool = False,
) -> dict:
    """The data of the influence page (and of ``python -m tgattn show --json``), ready for ``json.dump``.

    Args:
        tokens: one label per token.
        attention: ``(edge_index, alpha [E, H])`` per layer, first layer first.
        query: the token the page opens on, and whose top flow is computed (negative counts from the end).
        title: the page's title.
        top_k: keys kept per token and view (and rollout entries per token).
        threshold: weights below it are dropped.
        flow: compute the top ``top_k`` attention flow into ``query`` when its cone has at most
            :data:`FLOW_EDGES` edges (otherwise ``data["flow"]["skipped"]`` says why not), and
            into every token (``data["flows"]``, for the page's selected token) when all their
            cones hold at most :data:`FLOW_EDGES` edges together.
        progress: tqdm bars.

    Read it back with :func:`kept_edges` and :func:`kept_rollout`.

    Example:
        >>> from tgattn import builders
        >>> ei = builders.causal(3)  # edges (j, i): (0,0) (0,1) (1,1) (0,2) (1,2) (2,2)
        >>> data = influence_data(["a", "b", "c"], [(ei, torch.tensor([1.0, 0.5, 0.5, 0.6, 0.3, 0.1], dtype=torch.float64))], top_k=2)
        >>> kept_edges(data, 0)  # query 2 keeps keys 0 and 1; its key 2 (0.1) is pruned
        (tensor([[0, 0, 1, 0, 1],
                [0, 1, 1, 2, 2]]), tensor([1.0000, 0.5000, 0.5000, 0.6000, 0.3000], dtype=torch.float64))
        >>> data["pruned"][0][0]
        {'edges': 1, 'weight': 0.1, 'total': 3.0}
    """
    top_k = check_count("top_k", top_k)
    if not 1 <= top_k <= LEVELS:
        raise ValueError(f"top_k must be in [1, {LEVELS}] (got {top_k})")
    if not isinstance(threshold, (int, float)) or isinstance(threshold, bool) or not 0 <= threshold < 1:
        raise ValueError(f"threshold must be a number in [0, 1) (got {threshold!r})")
    layers = as_layers(attention)
    n = count_nodes(layers, len(tokens))
    if len(tokens) != n:
        raise ValueError(f"tokens has {len(tokens)} labels but there are {n} nodes")
    if isinstance(query, bool) or not isinstance(query, int) or not -n <= query < n:
        raise ValueError(f"query must be a token index in [0, {n}) (got {query!r})")
    query %= n
    kept, pruned = [], []
    for edge_index, alpha in tqdm(layers, disable=not progress, desc="pruning the layers"):
        views, weights = _prune_layer(edge_index, alpha, n, top_k, threshold)
        kept.append(views)
        pruned.append([Tally().add(weights[:, v], view[2]).lost() for v, view in enumerate(views)])
    matrices = [layer_csr(ei, alpha, n) for ei, alpha in layers]  # rownorm(0.5 A + 0.5 I), mean over heads
    rollout, rollout_lost = _rollout_top(layers, matrices, top_k, threshold, progress)
    flows = _flows(layers, matrices, top_k, progress) if flow else None
    if flows is not None:
        flow_data = {"token": query, **flows[query]}
    else:
        flow_data = _flow(layers, matrices, query, top_k) if flow else {"token": query, "skipped": "not asked for"}
    return document(tokens, title=title, query=query, top_k=top_k, threshold=threshold, layers=kept, pruned=pruned,
                    rollout=rollout, rollout_pruned=rollout_lost, flow=flow_data, flows=flows)


Kept = Tuple[Tensor, Tensor, Tensor]  # the kept entries of a view, as CSR rows: (ptr [N + 1], keys [K], weights [K])


def document(tokens: Sequence[str], *, title: str, query: int, top_k: int, threshold: float, layers: List[List[Kept]],
             pruned: List[List[dict]], rollout: Kept, rollout_pruned: dict, flow: dict,
             flows: Optional[List[dict]] = None) -> dict:
    """The influence data, from what was kept per layer and view (the mean, then each head) and of the rollout;
    ``flows``, the flow into every token, when it was computed."""
    wide = len(tokens) > 65536
    data = {
        "format": FORMAT,
        "version": VERSION,
        "title": title,
        "tokens": [str(token) for token in tokens],
        "query": query,
        "heads": [len(views) - 1 for views in layers],
        "keep": {"top_k": top_k, "threshold": threshold},
        "index_bytes": 4 if wide else 2,
        "layers": [[_encode(*view, wide) for view in views] for views in layers],
        "pruned": pruned,
        "rollout": _encode(*rollout, wide),
        "rollout_pruned": rollout_pruned,
        "flow": flow,
    }
    if flows is not None:
        data["flows"] = flows
    return data


def views_of(alpha: Tensor) -> Tensor:
    """The weights of every view of a layer, ``float64 [E, 1 + H]``: the mean over heads, head 0, head 1, ..."""
    alpha = alpha.detach().to("cpu", torch.float64)
    alpha = alpha[:, None] if alpha.dim() == 1 else alpha  # [E, H]
    return torch.cat([alpha.mean(1, keepdim=True), alpha], 1)


def _prune_layer(edge_index: Tensor, alpha: Tensor, n: int, top_k: int, threshold: float):
    """Per view (the mean over heads, then each head): the kept ``(ptr, keys, weights)``; and the weights ``[E', V]``
    (duplicate edges added up)."""
    weights = views_of(alpha).numpy()  # [E, V]: mean, head 0, ...
    key = edge_index[1].cpu().numpy() * n + edge_index[0].cpu().numpy()  # sorted by (query, key) as builders emit
    if len(key) and not (np.diff(key) > 0).all():  # unsorted or duplicates: sort, add duplicates up
        order = np.argsort(key, kind="stable")
        key, weights = key[order], weights[order]
        starts = np.flatnonzero(np.r_[True, np.diff(key) != 0])
        key, weights = key[starts], np.add.reduceat(weights, starts, axis=0)
    ptr = torch.from_numpy(np.searchsorted(key // max(n, 1), np.arange(n + 1)).astype(np.int64))
    weights = torch.from_numpy(weights)
    return top_per_row(ptr, torch.from_numpy(key % max(n, 1)), weights, top_k, threshold), weights


def top_per_row(ptr: Tensor, cols: Tensor, values: Tensor, top_k: int, threshold: float) -> List[Kept]:
    """Top ``top_k`` entries >= ``threshold`` of every row of a CSR matrix with ``V`` value columns, per column."""
    n, views = len(ptr) - 1, values.shape[1]
    degree = ptr[1:] - ptr[:-1]
    width = max(int(degree.max()) if n else 0, 1)
    kept = [[] for _ in range(views)]
    chunk = max(1, 4_000_000 // (width * views))  # rows per padded block: at most 4M weights at a time
    for start in range(0, n, chunk):
        stop = min(start + chunk, n)
        first, last = int(ptr[start]), int(ptr[stop])
        local = torch.repeat_interleave(torch.arange(stop - start), degree[start:stop])
        position = torch.arange(first, last) - ptr[start:stop][local]
        pad = torch.full((views, stop - start, width), -1.0, dtype=torch.float64)
        pad[:, local, position] = values[first:last].T
        top, where = pad.topk(min(top_k, width), dim=2)  # [V, rows, k]
        keys = cols[(ptr[start:stop][None, :, None] + where).clamp(max=max(len(cols) - 1, 0))] if len(cols) else where
        for view in range(views):
            kept[view].append((top[view], keys[view]))
    out = []
    for view in range(views):
        top = torch.cat([t for t, _ in kept[view]]) if n else torch.zeros(0, 1, dtype=torch.float64)
        keys = torch.cat([k for _, k in kept[view]]) if n else torch.zeros(0, 1, dtype=torch.long)
        out.append(_packed(top, keys, threshold))
    return out


def concat(pieces: Sequence[Kept]) -> Kept:
    """CSR pieces of consecutive rows as one."""
    ptr = [torch.zeros(1, dtype=torch.long)]
    for piece in pieces:
        ptr.append(piece[0][1:] + ptr[-1][-1])
    return torch.cat(ptr), torch.cat([p[1] for p in pieces]), torch.cat([p[2] for p in pieces])


class Tally:
    """What pruning dropped from one view, added up piece by piece: ``lost()`` is ``{"edges", "weight", "total"}``.

    A non-finite weight makes the totals unknown: they are written as ``None`` (JSON ``null``) and
    ``nonfinite`` counts such weights (JSON has no NaN: a bare ``NaN`` left the page blank).
    """

    def __init__(self):
        self.edges, self.nonfinite, self.total, self.held = 0, 0, 0.0, 0.0

    def add(self, values: Tensor, held: Tensor) -> "Tally":
        """``values`` of a piece (every edge or entry), of which ``held`` were kept."""
        self.edges += len(values) - len(held)
        self.nonfinite += int((~values.isfinite()).sum())
        self.total += float(values.sum())
        self.held += float(held.sum())
        return self

    def lost(self) -> dict:
        if self.nonfinite:
            return {"edges": self.edges, "weight": None, "total": None, "nonfinite": self.nonfinite}
        return {"edges": self.edges, "weight": round(self.total - self.held, 12), "total": round(self.total, 12)}


def tile_top(first: int, tile: np.ndarray, top_k: int, threshold: float) -> Kept:
    """The kept entries of the rows of a rollout tile (:func:`~tgattn.analysis.rollout.rollout_tiles`)."""
    block = torch.from_numpy(tile)
    top, where = block.topk(min(top_k, block.shape[1]), dim=1)
    return _packed(top, where + first, threshold)


def _packed(top: Tensor, keys: Tensor, threshold: float) -> Tuple[Tensor, Tensor, Tensor]:
    """``[rows, k]`` candidates (largest first, padding < 0) -> CSR ``(ptr, keys, weights)`` of the kept ones."""
    keep = ((top >= threshold) & (top > 0)) | top.isnan()  # NaN kept (padding is -1): the page shows it
    ptr = torch.zeros(top.shape[0] + 1, dtype=torch.long)
    ptr[1:] = torch.cumsum(keep.sum(1), 0)
    return ptr, keys[keep], top[keep]


def _rollout_top(layers: List[Layer], matrices: list, top_k: int, threshold: float, progress: bool):
    """The kept entries of every row of the rollout (mean over heads), and what was dropped."""
    n = matrices[0].shape[0]
    tiles = rollout_tiles(matrices, progress=progress)
    if tiles is None:  # a scattered pattern: the sparse product
        from .rollout import attention_rollout

        rollout = attention_rollout(layers, num_nodes=n).coalesce()
        (rows, cols), values = rollout.indices(), rollout.values()[:, None]
        ptr = torch.zeros(n + 1, dtype=torch.long)
        ptr[1:] = torch.cumsum(torch.bincount(rows, minlength=n), 0)
        kept = top_per_row(ptr, cols, values, top_k, threshold)[0]
        return kept, Tally().add(values[:, 0], kept[2]).lost()
    pieces, tally = [], Tally()
    for first, tile in tiles:
        pieces.append(tile_top(first, tile, top_k, threshold))
        tally.add(torch.from_numpy(tile[tile != 0]), pieces[-1][2])  # the rollout's nonzeros
    return concat(pieces), tally.lost()


def _flow(layers: List[Layer], matrices: list, query: int, top_k: int) -> dict:
    n = matrices[0].shape[0]
    cone = flow_cone(matrices, query)
    if len(layers) > 2 and cone.num_edges > FLOW_EDGES:
        return {"token": query, "skipped": f"its cone has {cone.num_edges:,} edges, more than {FLOW_EDGES:,}"}
    try:
        check_finite_cone(cone, query)
    except ValueError as unknown:
        return {"token": query, "skipped": str(unknown)}
    index, value = top_flow(layers, query, top_k, num_nodes=n)
    return {"token": query, "index": index.tolist(), "value": [round(v, 12) for v in value.tolist()]}


FLAGS = (np.nan, np.inf)  # a kept weight's flag 1 + f means FLAGS[f]: NaN, or +inf (negative weights are refused)


def _flows(layers: List[Layer], matrices: list, top_k: int, progress: bool) -> Optional[List[dict]]:
    """The top ``top_k`` flow into every token, ``[{"index", "value"}]`` (``{"skipped"}`` for a token whose cone
    holds a non-finite weight); ``None`` when the cones hold more than :data:`FLOW_EDGES` edges together (the page
    then has the flow into its query alone)."""
    n, edges, cones = matrices[0].shape[0], 0, []
    for token in range(n):
        cones.append(flow_cone(matrices, token))
        edges += cones[-1].num_edges
        if edges > FLOW_EDGES:
            return None
    flows = []
    for token in tqdm(range(n), disable=not progress, desc="flow into every token"):
        try:
            check_finite_cone(cones[token], token)
        except ValueError as unknown:
            flows.append({"skipped": str(unknown)})
            continue
        index, value = top_flow(layers, token, top_k, num_nodes=n)
        flows.append({"index": index.tolist(), "value": [round(v, 12) for v in value.tolist()]})
    return flows


def _encode(ptr: Tensor, keys: Tensor, weights: Tensor, wide: bool) -> Dict[str, str]:
    """CSR rows as base64: ``counts`` (uint16 per query), ``keys`` (uint16, uint32 past 65,536 tokens),
    ``scale`` (float32: the query's largest kept finite weight) and ``weights`` (uint16 fractions of it);
    where a kept weight is not finite, ``flags`` (uint8 per kept weight: 0 finite, 1 NaN, 2 +inf)."""
    counts = (ptr[1:] - ptr[:-1]).numpy()
    rows = np.repeat(np.arange(len(counts)), counts)
    value = weights.numpy()
    finite = np.isfinite(value)
    scale = np.zeros(len(counts), dtype=np.float32)
    if finite.any():
        np.maximum.at(scale, rows[finite], value[finite].astype(np.float32))
    fraction = np.where(finite, value, 0) / np.maximum(scale[rows].astype(np.float64), np.finfo(np.float32).tiny)
    view = {
        "counts": _b64(counts.astype("<u2")),
        "keys": _b64(keys.numpy().astype("<u4" if wide else "<u2")),
        "scale": _b64(scale.astype("<f4")),
        "weights": _b64(np.rint(np.clip(fraction, 0, 1) * LEVELS).astype("<u2")),
    }
    if not finite.all():
        view["flags"] = _b64(np.where(finite, 0, np.where(np.isnan(value), 1, 2)).astype("u1"))
    return view


def _decode(view: Dict[str, str], wide: bool) -> Tuple[Tensor, Tensor, Tensor]:
    counts = np.frombuffer(base64.b64decode(view["counts"]), dtype="<u2").astype(np.int64)
    keys = np.frombuffer(base64.b64decode(view["keys"]), dtype="<u4" if wide else "<u2").astype(np.int64)
    scale = np.frombuffer(base64.b64decode(view["scale"]), dtype="<f4").astype(np.float64)
    fraction = np.frombuffer(base64.b64decode(view["weights"]), dtype="<u2") / LEVELS
    rows = np.repeat(np.arange(len(counts)), counts)
    weight = fraction * scale[rows]
    if "flags" in view:
        flags = np.frombuffer(base64.b64decode(view["flags"]), dtype="u1")
        weight[flags > 0] = np.array(FLAGS)[flags[flags > 0] - 1]
    return torch.from_numpy(rows), torch.from_numpy(keys), torch.from_numpy(weight)


def _b64(array: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(array).tobytes()).decode("ascii")


def kept_edges(data: dict, layer: int, head: Union[int, str] = "mean") -> Tuple[Tensor, Tensor]:
    """The kept edges of one layer and view of :func:`influence_data`: ``(edge_index [2, K], weight [K])``.

    ``edge_index`` follows the package's convention (row 0 = key j, row 1 = query i); weights
    are the quantised ones (within 8e-6 of each query's largest weight).
    """
    heads = data["heads"][layer]
    if head != "mean" and (isinstance(head, bool) or not isinstance(head, int) or not 0 <= head < heads):
        raise ValueError(f"head must be 'mean' or in [0, {heads}) (got {head!r})")
    rows, keys, weight = _decode(data["layers"][layer][0 if head == "mean" else head + 1], data["index_bytes"] == 4)
    return torch.stack([keys, rows]), weight


def kept_rollout(data: dict) -> Tuple[Tensor, Tensor]:
    """The kept rollout entries of :func:`influence_data`: ``(index [2, K], share [K])``, row 0 = input j,
    row 1 = token i (as :func:`kept_edges`)."""
    rows, keys, weight = _decode(data["rollout"], data["index_bytes"] == 4)
    return torch.stack([keys, rows]), weight


def save_influence(data: dict, path: Union[str, Path]) -> None:
    """Write :func:`influence_data` to ``path`` as JSON (UTF-8)."""
    Path(path).write_text(json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False), encoding="utf-8")


def load_influence(path: Union[str, Path], *, max_bytes: Optional[int] = None) -> dict:
    """Read a file written by :func:`save_influence` (or ``show --json``), checking its format and version,
    then every field (:func:`tgattn.analysis.influence_file.check_influence`): a file is refused with one
    line naming the field that is wrong. A file over ``max_bytes`` is refused before it is read."""
    size = Path(path).stat().st_size
    if max_bytes is not None and size > max_bytes:
        raise ValueError(f"{path} takes {size / 1e6:.2f} MB, more than the page's budget of {max_bytes / 1e6:.2f} MB "
                         "(its page would be larger still)")
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not a JSON file ({err})") from None
    except RecursionError:  # e.g. 100,000 nested [: Python's parser recurses once per level
        raise ValueError(f"{path} nests its values too deeply for an influence file") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path} is not a tgattn influence file (no \"format\": \"{FORMAT}\")")
    if data.get("version") != VERSION:
        raise ValueError(f"{path} has version {data.get('version')!r}; this tgattn reads version {VERSION}")
    try:
        check_influence(data)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    return data
