"""The tile backend's cheap fill bound: an upper bound on the real fill on every pattern, exact
for band layouts, and tight enough that a scattered set whose rows all have k keys (top-k, a
learned selection) goes to the fused kernel without laying out tiles (issue 32: a never-seen
lightning-indexer selection at n = 16,384 spent 798 ms of 1,190 in tile_layout, fill 0.043)."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from tgattn import builders, engine
from tgattn.bench.patterns import patterns
from tgattn.engine import dispatch, fused, tiles
from tgattn.engine.analysis import analyse, row_spans
from tgattn.verify import random_edges


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _indexer(n, k, seed=0):
    g = _gen(seed)
    q_index, k_index = torch.randn(n, 2, 8, generator=g), torch.randn(n, 8, generator=g)
    return builders.indexer_topk(q_index, k_index, torch.rand(n, 2, generator=g), k)


SCATTERED = {  # every row has the same number of keys (the causal indexer: its first k rows fewer)
    "random": lambda: builders.random(2048, 32, generator=_gen()),
    "topk": lambda: patterns()["topk0.01"].make(4096),
    "indexer_topk": lambda: _indexer(2048, 64),
    "indexer_topk_packed": lambda: builders.indexer_topk(*(torch.randn(2048, 2, 8, generator=_gen(1)),
                                                           torch.randn(2048, 8, generator=_gen(2)),
                                                           torch.rand(2048, 2, generator=_gen(3))), 48,
                                                         causal=False, lengths=[1024, 512, 512]),
}


def _no_tiles(*args, **kwargs):
    raise AssertionError("tile_layout was called")


@pytest.mark.parametrize("name", sorted(SCATTERED))
def test_scattered_sets_of_equal_degree_skip_the_tile_layout(name, monkeypatch):
    edge_index = SCATTERED[name]()
    n = int(edge_index.max()) + 1
    s = analyse(edge_index, n, n)
    degrees = (s.rowptr[1:] - s.rowptr[:-1])
    assert s.kind == "general" and int(degrees.max()) * s.n_q < 1.1 * s.num_edges  # the O(1) bound reads ~1
    monkeypatch.setattr(tiles, "tile_layout", _no_tiles)
    monkeypatch.setattr(dispatch, "tile_layout", _no_tiles)
    assert engine.plan(s) == ("fused" if fused.available() else "csr")
    assert "tiles" not in s.extras
    assert tiles.fill_bound(s) < dispatch.TILE_FILL_VS_CSR  # the bound leaves no threshold in reach
    monkeypatch.undo()
    assert tiles.fill_bound(s) >= tiles.tile_layout(s).fill


def _named_sets():
    n = 1024
    p = patterns()
    sets = {name: p[name].make(n) for name in ("window64", "bigbird", "random0.01", "random0.05", "topk0.01", "topk0.05")}
    if "dilated32x2" in p:
        sets["dilated32x2"] = p["dilated32x2"].make(n)
    sets.update({
        "window512_w16": builders.window(512, 16),
        "window2048_w256": builders.window(2048, 256),
        "causal": builders.causal(300),
        "full": builders.full(130),
        "packed_causal": builders.causal([100, 37, 250]),
        "block_local": builders.block_local(n, 64),
        "block_local_causal": builders.block_local(n, 48, causal=True),
        "bigbird_builder": builders.bigbird(n, 3, 2, 3, generator=_gen()),
        "random_keys": builders.random(n, 16, generator=_gen()),
        "random_dense": random_edges(200, 200, 0.5, seed=3),
        "random_sparse": random_edges(500, 500, 0.004, seed=4),
        "indexer_topk": _indexer(700, 40),
        "indexer_topk_wide": _indexer(300, 250),
    })
    return sets


NAMED = _named_sets()


@pytest.mark.parametrize("name", sorted(NAMED))
def test_bound_is_at_least_the_fill_and_plan_keeps_its_choices(name, monkeypatch):
    edge_index = NAMED[name]
    n = int(edge_index.max()) + 1
    lay = tiles.tile_layout(analyse(edge_index, n, n))
    for threshold in (0.0, 0.3, 0.82, 1.0):
        bound = tiles.fill_bound(analyse(edge_index, n, n), threshold)
        assert lay is None or bound >= lay.fill - 1e-12, (threshold, bound, lay.fill)
    # every option set plans as it did when every structure laid out its tiles (an exact "bound")
    for options in ({}, {"fusable": False}):
        chosen = engine.plan(analyse(edge_index, n, n), **options)
        monkeypatch.setattr(tiles, "fill_bound", lambda s, threshold=0.0: 1.0)
        monkeypatch.setattr(dispatch, "fill_bound", lambda s, threshold=0.0: 1.0)
        assert chosen == engine.plan(analyse(edge_index, n, n), **options)
        monkeypatch.undo()


def test_bound_is_exact_for_band_layouts():
    for edge_index, n in ((builders.window(512, 16), 512), (builders.window(2048, 256), 2048),
                          (builders.window(4096, 64), 4096)):
        s = analyse(edge_index, n, n)
        assert tiles.fill_bound(s) == tiles.tile_layout(s).fill and tiles.tile_layout(s).offset is not None


@st.composite
def _sets(draw):
    """Edge sets without repeated edges (tiles never run others): random masks of any density,
    rows of equal degree, windows, with empty rows and rectangular shapes."""
    n_q, n_k = draw(st.integers(1, 200)), draw(st.integers(1, 200))
    g = _gen(draw(st.integers(0, 2**16)))
    family = draw(st.sampled_from(["mask", "degree", "band"]))
    if family == "mask":
        mask = torch.rand(n_q, n_k, generator=g) < draw(st.sampled_from([0.01, 0.1, 0.5, 0.9, 1.0]))
    elif family == "degree":
        r = draw(st.integers(1, n_k))
        keys = torch.rand(n_q, n_k, generator=g).topk(r, dim=1).indices
        mask = torch.zeros(n_q, n_k, dtype=torch.bool).scatter_(1, keys, True)
    else:
        i, j = torch.arange(n_q).unsqueeze(1), torch.arange(n_k)
        lo, hi = sorted((draw(st.integers(-n_k, n_k)), draw(st.integers(-n_k, n_k))))
        mask = (j - i >= lo) & (j - i <= hi)
    if draw(st.booleans()):
        mask[torch.rand(n_q, generator=g) < 0.3] = False  # empty rows
    return builders.from_mask(mask), n_q, n_k


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(_sets())
def test_bound_is_at_least_the_fill_on_drawn_sets(case):
    edge_index, n_q, n_k = case
    if edge_index.shape[1] == 0:
        return
    s = analyse(edge_index, n_q, n_k)
    lay = tiles.tile_layout(s)
    if lay is not None:
        assert tiles.fill_bound(analyse(edge_index, n_q, n_k)) >= lay.fill - 1e-12
    # the row spans against their definition
    src, dst = edge_index
    rows = dst.unique()
    first = torch.stack([src[dst == i].min() for i in rows])
    last = torch.stack([src[dst == i].max() for i in rows])
    deg = torch.stack([(dst == i).sum() for i in rows])
    lo, hi, deg_max, whole = row_spans(s)
    assert (lo, hi, deg_max) == (int((first - rows).min()), int((last - rows).max()), int(deg.max()))
    assert whole == bool((last - first + 1 == deg).all()) and s.intervals == whole
