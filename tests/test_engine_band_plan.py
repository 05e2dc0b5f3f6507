"""Sets known by their shape (:mod:`tgattn.engine.bands`): recognised from the analysis, prepared
without an edge list, and planned for tensor cores from the rows' key ranges
(:mod:`tgattn.engine.triton.band_plan`) with no tensor of E entries.

Oracles: the analysis of the builders' edge lists, :func:`plan_tiles` on those edges (itself
checked against a dense recount in ``test_engine_tc_plan.py``), and the float64 dense attention.
"""
import dataclasses
import random

import pytest
import torch

from tgattn import builders
from tgattn.edgeset import prepare_band
from tgattn.engine.analysis import analyse
from tgattn.engine.bands import Band, band_of, band_structure
from tgattn.engine.dispatch import plan as backend_plan
from tgattn.engine.triton.band_plan import plan_band
from tgattn.engine.triton.tile_plan import plan_tiles
from tgattn.functional import graph_attention

from engine_helpers import LargestTensor, inputs, max_err, oracle


def _causal_window(n, w):
    ei = builders.window(n, w)
    return ei[:, ei[0] <= ei[1]]


# name -> (edge list, n_q, n_k, the band it states)
SETS = {
    "full": (lambda: builders.full(37), 37, 37, Band()),
    "full_rectangle": (lambda: builders.cross(9, 70), 9, 70, Band()),
    "causal": (lambda: builders.causal(45), 45, 45, Band(hi=0)),
    "window": (lambda: builders.window(70, 6), 70, 70, Band(-6, 6)),
    "window_wide": (lambda: builders.window(50, 20), 50, 50, Band(-20, 20)),
    "causal_window": (lambda: _causal_window(66, 17), 66, 66, Band(-17, 0)),
    "documents": (lambda: builders.causal([16, 24, 9, 1]), 50, 50, Band(hi=0, lengths=(16, 24, 9, 1))),
    "block_diagonal": (lambda: builders.full([16, 24, 9]), 49, 49, Band(lengths=(16, 24, 9))),
    "block_local": (lambda: builders.block_local(64, 16), 64, 64, Band(lengths=(16,) * 4)),
}


@pytest.mark.parametrize("name", list(SETS))
def test_the_analysis_recognises_the_band_and_the_band_makes_the_same_analysis(name):
    make, n_q, n_k, band = SETS[name]
    s = analyse(make(), n_q, n_k)
    found = band_of(s)
    made = band_structure(band, n_q, n_k)
    assert made.kind == s.kind and made.lengths == s.lengths and made.num_edges == s.num_edges
    assert torch.equal(made.rowptr, s.rowptr) and made.intervals == s.intervals and not made.duplicates
    assert "edges" not in made.extras  # nothing read the edges yet
    assert torch.equal(made.src, s.src) and torch.equal(made.dst, s.dst)  # made on first read, equal
    # The band found may state a bound that cuts no row differently; it must make the same edges.
    assert torch.equal(band_structure(found, n_q, n_k).src, s.src)


def test_sets_that_are_not_one_band_are_not_taken_for_one():
    window = builders.window(40, 3)
    holed = window[:, torch.arange(window.shape[1]) != 50]  # one edge missing inside a row
    duplicated = torch.cat([window, window[:, :1]], 1)
    dilated = window[:, (window[0] - window[1]) % 2 == 0]  # rows are not ranges
    for ei in (holed, duplicated, dilated, builders.random(40, 3, generator=torch.Generator().manual_seed(0))):
        assert band_of(analyse(ei, 40, 40)) is None


@pytest.mark.parametrize("min_fill", [0.0, 0.3, None])
@pytest.mark.parametrize("blocks", [(8, 8), (4, 32), (16, 64), (64, 64)])
@pytest.mark.parametrize("name", list(SETS))
def test_the_plan_from_the_band_is_the_plan_from_the_edges(name, blocks, min_fill):
    make, n_q, n_k, band = SETS[name]
    s = analyse(make(), n_q, n_k)
    want = plan_tiles(s.rowptr, s.src, n_q, n_k, block_m=blocks[0], block_n=blocks[1], min_fill=min_fill)
    got = plan_band(band, n_q, n_k, block_m=blocks[0], block_n=blocks[1], min_fill=min_fill)
    for f in dataclasses.fields(want):
        a, b = getattr(want, f.name), getattr(got, f.name)
        assert (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b), f.name


def test_planning_a_band_holds_no_tensor_of_its_edges():
    n, E = 4096, 4096 * 4097 // 2  # causal: 8.4 million edges, 2,080 tiles of 64 x 64
    with LargestTensor() as made:  # the tc backend's own way: a prepared band, its plan for bfloat16 at d = 64
        es = prepare_band(n, hi=0)
        plan = es.tile_plan(torch.bfloat16, 64)
    tiles = plan.n_full + plan.n_partial
    assert plan.tc_edges == E and tiles == 2080 and (plan.block_m, plan.block_n) == (64, 64)
    # The largest: the [tiles, block_m] overlap counts (133,120), three orders below E.
    assert made.largest <= tiles * 64 and made.largest < E / 50
    assert "edges" not in es.structure.extras
    small = analyse(builders.causal(512), 512, 512)  # the edge planner at a set 64x smaller holds its E
    with LargestTensor() as from_edges:
        plan_tiles(small.rowptr, small.src, 512, 512, block_m=64, block_n=64)
    assert from_edges.largest >= small.num_edges


def test_a_band_set_pickles_as_its_band():
    import pickle

    es = prepare_band(4096, hi=0)
    data = pickle.dumps(es)
    back = pickle.loads(data)
    assert len(data) < 2000 and "edges" not in es.structure.extras  # 8.4 million edges, never made
    assert (back.kind, back.num_edges, back.structure.band) == ("causal", es.num_edges, es.structure.band)


def test_prepare_band_names_bad_input():
    with pytest.raises(ValueError, match=r"n_q == n_k == sum\(lengths\).*lengths summing to 7"):
        prepare_band(8, hi=0, lengths=[3, 4])
    with pytest.raises(ValueError, match=r"n_q must be a node count.*-1"):
        prepare_band(-1)


def test_auto_keeps_full_and_causal_bands_on_sdpa_without_their_edges():
    for es in (prepare_band(96, hi=0), prepare_band(96), prepare_band(96, lengths=[48, 48])):
        s = es.structure
        assert backend_plan(s, "auto", triton=True, tiles=True) == "dense"
        q, k, v, _ = inputs(96, 96, heads=2, dk=8)
        got = graph_attention(q, k, v, es)  # float64 on the CPU: SDPA
        assert "edges" not in s.extras  # the dense path reads the kind, not the edges
        assert max_err(got, oracle(q, k, v, es.edge_index)) <= 1e-10
        moved = es.to("meta")
        assert moved.kind == es.kind and "edges" not in moved.structure.extras


BLOCKS = (16, 16)


@pytest.mark.parametrize("band, n, min_fill", [
    (Band(hi=0), 40, 0.0),                                # full and partial tiles
    (Band(-5, 5), 40, 0.0),                               # partial tiles only
    (Band(hi=0, lengths=(16, 20, 4)), 40, 0.5),           # tiles and a gathered remainder in the same rows
], ids=["causal", "window", "documents_mixed"])
def test_tc_over_a_band_set_equals_the_oracle_and_never_makes_its_edges(band, n, min_fill):
    pytest.importorskip("triton")
    from tgattn.engine.triton.attention import interpreter_ready
    from tgattn.engine.triton.tc import TileAttention, plan_for

    if not (torch.cuda.is_available() or interpreter_ready()):
        pytest.skip("TRITON_INTERPRET=1 must be set before triton is first imported (tests/conftest.py does it)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    s = band_structure(band, n, n, device)
    plan, rest = plan_for(s, BLOCKS, min_fill)
    assert plan.tc_edges > 0 and (rest.num_edges > 0) == (min_fill > 0)
    q, k, v, grad_out = inputs(n, n, heads=2, dk=16)
    mine = [t.detach().float().to(device).requires_grad_() for t in (q, k, v)]
    out = TileAttention.apply(*mine, None, plan, rest, 0.3, None)
    grads = torch.autograd.grad(out, mine, grad_out.float().to(device))
    assert "edges" not in s.extras  # neither the plan nor the kernels read the edge list
    edge_index = torch.stack([s.src, s.dst]).cpu()
    exact = [t.detach().float().double().requires_grad_() for t in (q, k, v)]
    ref = oracle(*exact, edge_index, scale=0.3)
    assert max_err(out.detach().cpu().double(), ref) <= 2e-6
    for a, b in zip(grads, torch.autograd.grad(ref, exact, grad_out)):
        assert max_err(a.cpu().double(), b) <= 1e-5 * max(1.0, b.abs().max().item())


def test_random_bands_give_the_analysis_and_the_plan_of_their_edges():
    """Bands of every shape (empty, diagonal, one-sided, wider than the keys, rectangles, documents
    of one token) at block shapes 1 x 1 to 64 x 128: the analysis of their edges (kind, lengths,
    rows) and the plan from those edges, field for field."""
    rng = random.Random(1)
    for _ in range(150):
        lengths = tuple(rng.randint(1, 40) for _ in range(rng.randint(1, 5))) if rng.random() < 0.4 else None
        n_q = sum(lengths) if lengths else rng.randint(1, 90)
        n_k = n_q if lengths or rng.random() < 0.5 else rng.randint(1, 90)
        band = Band(rng.choice([None, rng.randint(-60, 20)]), rng.choice([None, rng.randint(-20, 60)]), lengths)
        s = band_structure(band, n_q, n_k)
        a = analyse(torch.stack([s.src, s.dst]), n_q, n_k)
        assert (a.kind, a.lengths, a.intervals) == (s.kind, s.lengths, s.intervals) and torch.equal(a.rowptr, s.rowptr)
        blocks = dict(block_m=rng.choice([1, 4, 16, 64]), block_n=rng.choice([1, 8, 32, 128]))
        min_fill = rng.choice([0.0, 0.1, 0.5, None])
        want = plan_tiles(a.rowptr, a.src, n_q, n_k, **blocks, min_fill=min_fill)
        got = plan_band(band, n_q, n_k, **blocks, min_fill=min_fill)
        for f in dataclasses.fields(want):
            x, y = getattr(want, f.name), getattr(got, f.name)
            assert (torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y), (band, n_q, n_k, blocks, f.name)
