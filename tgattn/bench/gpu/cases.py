"""The cases of the GPU suite (``python -m tgattn.bench.gpu --suite``): issue 50's targets as edge
sets, each with the FlexAttention ``mask_mod`` that states it where one is simple, and the target
family it is judged by.

* ``structured`` (sliding windows of radius 64 and 256, causal, packed causal documents of 256-2,048
  tokens, block-local attention in blocks of 256, BigBird): dense blocks; judged against compiled
  FlexAttention;
* ``scattered`` (random and top-k at 1 %): judged against the faster of the gather path and dense
  SDPA without a mask;
* ``indexer`` (DeepSeek's lightning-indexer top-k, 2,048 keys a query, causal, eight query heads on
  two key / value heads): judged against the gather path;
* ``gnn`` (a random graph of 16 in-neighbours a node, and a batch of 4,096 molecule-sized ring
  graphs): sets below the tensor-core threshold, judged against the gather path.

Every edge set is drawn on the device it runs on where its builder can (random and top-k sets,
the indexer's scores), so that the suite's minutes go to the measurements.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch
from torch import Tensor

from ... import builders
from ...engine.bands import Band, band_structure
from .packed import document_lengths
from ..patterns import _random, _topk, patterns

FAMILIES = ("structured", "scattered", "indexer", "gnn")
DOCUMENTS = (256, 2048)  # document lengths of the packed causal set (uniform, inclusive)
BLOCK = 256  # block-local attention's block
INDEXER_TOP = 2048  # keys an indexer query keeps (DeepSeek-V3.2's k)
INDEXER_HEADS = (4, 32)  # the indexer's own heads and head dim (its scores pick the keys)
GRAPH_DEGREE = 16  # in-neighbours a node of the random graph
MOLECULES = 4096  # ring graphs of 18-30 nodes in the molecule batch
K128 = 1 << 17
# Sizes on a GPU, the smallest of each case first: the suite runs every case at its first size,
# then at its second, ... so that a budget that runs out leaves every case measured once. Causal
# past 16k runs without an edge list (prepare_band: 2.1 billion edges at 64k, 34 GB of ids).
SIZES = {
    "window64": (16384, 65536, K128), "window256": (16384, 65536, K128), "causal": (16384, 32768, 65536),
    "documents": (16384, 65536, K128), "block_local": (16384, 65536, K128), "bigbird": (16384, 65536, K128),
    "random1%": (16384, 65536), "topk1%": (16384, 65536), "indexer_gqa": (16384, 65536),
    "graph16": (K128,), "molecules": (0,),  # the molecule batch's size is its node count
}
DRY_RUN_N = 64  # Triton's interpreter runs the tgattn paths of a dry run: about a second a call at 64 tokens
EDGE_LIST_MAX = 1 << 28  # edges past which a case with a band makes no edge list (the peers that need one skip)


@dataclass(frozen=True)
class Case:
    """One edge set of the suite at one size.

    ``make(device)`` returns ``LongTensor[2, E]`` on ``device``; ``mask_mod(device)`` the
    FlexAttention predicate ``(b, h, q_idx, kv_idx) -> bool`` of the same set (``None``: none is
    simple, Flex runs only on the BlockMask built from the edges); ``causal``: the set is exactly
    ``j <= i``, so dense SDPA runs ``is_causal``; ``band``: the set's :class:`~tgattn.engine.bands.Band`
    where it is one (the ``tc`` path then runs it through ``prepare_band``, without an edge list);
    queries have ``heads`` heads, keys and values ``kv_heads`` (fewer: grouped-query attention,
    ``heads // kv_heads`` query heads a key head).
    """

    name: str
    family: str
    n: int
    make: Callable[[torch.device], Tensor]
    mask_mod: Optional[Callable[[torch.device], Callable]] = None
    causal: bool = False
    band: Optional[Band] = None
    heads: int = 8
    kv_heads: int = 8
    dim: int = 64

    @property
    def groups(self) -> int:
        return self.heads // self.kv_heads

    @property
    def listed(self) -> bool:
        """Whether the suite makes the case's edge list (a band past :data:`EDGE_LIST_MAX` edges: no)."""
        if self.band is None:
            return True
        return band_structure(self.band, self.n, self.n).num_edges <= EDGE_LIST_MAX


def _within(w: int):
    return lambda device: (lambda b, h, q, kv: (q - kv).abs() <= w)


def _documents(n: int):
    lengths = document_lengths(n, *DOCUMENTS)

    def mask_mod(device):
        doc = torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device))
        return lambda b, h, q, kv: (doc[q] == doc[kv]) & (q >= kv)

    return (lambda device: builders.causal(lengths, device=device)), mask_mod, Band(hi=0, lengths=tuple(lengths))


def _indexer(n: int, top: int, heads: int, dim: int):
    def make(device):
        g = torch.Generator(device).manual_seed(0)
        q_index = torch.randn(n, heads, dim, generator=g, device=device)
        k_index = torch.randn(n, dim, generator=g, device=device)
        weights = torch.rand(n, heads, generator=g, device=device)
        return builders.indexer_topk(q_index, k_index, weights, top, causal=True)

    return make


def _molecules(graphs: int):
    from ..models import molecule_batches

    x, edge_index, _ = next(iter(molecule_batches(1, graphs=graphs, features=1)))
    edge_index = builders.union(edge_index)  # a chord may double a ring edge: once, as a mask has it
    return x.shape[0], (lambda device: edge_index.to(device))


def case(name: str, n: int, *, heads: int = 8, dim: int = 64, dry_run: bool = False) -> Case:
    """The case ``name`` (a key of :data:`SIZES`) at ``n`` tokens / nodes (the molecule batch: its
    own node count), ``heads`` query heads of ``dim`` channels (the indexer case: ``heads / 4`` key
    heads). ``dry_run`` shrinks what does not scale with ``n`` (the indexer's 2,048 keys, the
    4,096 molecules).

    Example:
        >>> c = case("window64", 256)
        >>> c.family, c.make(torch.device("cpu")).shape[1] == 256 * 129 - 64 * 65
        ('structured', True)
        >>> case("indexer_gqa", 64, heads=2, dry_run=True).groups
        2
    """
    base = dict(name=name, n=n, heads=heads, kv_heads=heads, dim=dim)
    if name in ("window64", "window256"):
        w = int(name[6:])
        return Case(family="structured", make=lambda device: builders.window(n, w, device=device), mask_mod=_within(w),
                    band=Band(-w, w), **base)
    if name == "causal":
        return Case(family="structured", make=lambda device: builders.causal(n, device=device), causal=True,
                    mask_mod=lambda device: (lambda b, h, q, kv: q >= kv), band=Band(hi=0), **base)
    if name == "documents":
        make, mask_mod, band = _documents(n)
        return Case(family="structured", make=make, mask_mod=mask_mod, band=band, **base)
    if name == "block_local":
        return Case(family="structured", make=lambda device: builders.block_local(n, BLOCK, device=device),
                    mask_mod=lambda device: (lambda b, h, q, kv: q // BLOCK == kv // BLOCK),
                    band=Band(lengths=(BLOCK,) * (n // BLOCK) + ((n % BLOCK,) if n % BLOCK else ())), **base)
    if name == "bigbird":
        return Case(family="structured", make=lambda device: patterns()["bigbird"].make(n).to(device), **base)
    if name == "random1%":
        return Case(family="scattered", make=lambda device: _random(n, 0.01, device=device), **base)
    if name == "topk1%":
        return Case(family="scattered", make=lambda device: _topk(n, max(1, n // 100), device=device), **base)
    if name == "indexer_gqa":
        top = 16 if dry_run else INDEXER_TOP
        return Case(family="indexer", make=_indexer(n, top, *INDEXER_HEADS), **dict(base, kv_heads=max(1, heads // 4)))
    if name == "graph16":
        return Case(family="gnn", make=lambda device: builders.random(
            n, GRAPH_DEGREE, generator=torch.Generator().manual_seed(0), device=device), **base)
    if name == "molecules":
        nodes, make = _molecules(4 if dry_run else MOLECULES)
        return Case(family="gnn", make=make, **dict(base, n=nodes))
    raise ValueError(f"unknown case {name!r}; choose from {', '.join(SIZES)}")


def suite_cases(names: Sequence[str] = tuple(SIZES), *, dry_run: bool = False) -> List[Case]:
    """The suite's cases in the order it runs them: every case at its first size, then every case
    at its second, ... (a dry run: each once at ``DRY_RUN_N`` with 2 heads of 16 channels).

    Example:
        >>> [(c.name, c.n) for c in suite_cases(["window64", "causal"])]  # doctest: +NORMALIZE_WHITESPACE
        [('window64', 16384), ('causal', 16384), ('window64', 65536), ('causal', 32768), ('window64', 131072),
         ('causal', 65536)]
    """
    if dry_run:
        return [case(name, DRY_RUN_N, heads=2, dim=16, dry_run=True) for name in names]
    rounds: Dict[int, List[Case]] = {}
    for name in names:
        for r, n in enumerate(SIZES[name]):
            rounds.setdefault(r, []).append(case(name, n))
    return [c for r in sorted(rounds) for c in rounds[r]]
