"""The tile planner of the ``tc`` backend against a dense recount, and its cost model.

The recount forms the dense ``[n_q, n_k]`` count matrix of a small edge set (duplicates counted),
cuts it into tiles and classes each by hand: what :func:`plan_tiles` must find from the CSR form
without ever forming it.
"""
import pytest
import torch

from tgattn import builders
from tgattn.engine.analysis import analyse
from tgattn.engine.triton.tile_cost import break_even_fill, predict
from tgattn.engine.triton.tile_plan import MIN_FILL, WORD_BITS, choose_blocks, plan_tiles
from tgattn.verify import random_edges


def _csr(edge_index, n_q, n_k):
    s = analyse(edge_index, n_q, n_k)
    return s.rowptr.long(), s.src.long(), s


def _recount(edge_index, n_q, n_k, bm, bn, min_fill):
    """Per tile ``(qb, kb) -> (cells [bm, bn] of 0/1, count, duplicated)`` and the class of each."""
    nqb, nkb = -(-n_q // bm), -(-n_k // bn)
    counts = torch.zeros(nqb * bm, nkb * bn, dtype=torch.long)
    counts.index_put_((edge_index[1], edge_index[0]), torch.ones(edge_index.shape[1], dtype=torch.long), accumulate=True)
    tiles = {}
    for qb in range(nqb):
        for kb in range(nkb):
            c = counts[qb * bm:(qb + 1) * bm, kb * bn:(kb + 1) * bn]
            total = int(c.sum())
            if total == 0:
                continue
            dup = bool((c > 1).any())
            if dup or total < min_fill * bm * bn:
                kind = "scattered"
            else:
                kind = "full" if total == bm * bn else "partial"
            tiles[qb, kb] = (c > 0, total, kind)
    return tiles, counts


SETS = {
    "random": lambda: (random_edges(45, 38, 0.15, seed=3), 45, 38),
    "window": lambda: (builders.window(50, 6), 50, 50),
    "block_diagonal": lambda: (builders.full([16, 24, 9]), 49, 49),
    "causal": lambda: (builders.causal(37), 37, 37),
    "ragged_cross": lambda: (random_edges(19, 70, 0.4, seed=5), 19, 70),
    "duplicates": lambda: (torch.cat([builders.window(40, 3), builders.window(40, 3)[:, ::7]], 1), 40, 40),
}


@pytest.mark.parametrize("blocks", [(8, 8), (4, 32), (16, 64)])
@pytest.mark.parametrize("min_fill", [0.0, 0.3])
@pytest.mark.parametrize("case", list(SETS))
def test_plan_equals_a_dense_recount(case, min_fill, blocks):
    edge_index, n_q, n_k = SETS[case]()
    ptr, col, s = _csr(edge_index, n_q, n_k)
    bm, bn = blocks
    plan = plan_tiles(ptr, col, n_q, n_k, block_m=bm, block_n=bn, min_fill=min_fill)
    tiles, counts = _recount(edge_index, n_q, n_k, bm, bn, min_fill)
    kinds = [t[2] for t in tiles.values()]
    assert (plan.n_full, plan.n_partial) == (kinds.count("full"), kinds.count("partial"))
    assert plan.tc_edges == sum(t[1] for t in tiles.values() if t[2] != "scattered")
    assert plan.num_edges == edge_index.shape[1]
    assert plan.tc_share == pytest.approx(plan.tc_edges / plan.num_edges)

    # Query-major lists: per query block, its full tiles, then its partial ones, by key block.
    words = plan.masks
    assert words.shape[1:] == (bm, -(-bn // WORD_BITS))
    for qb in range(-(-n_q // bm)):
        lo, split, hi = int(plan.q_ptr[qb]), int(plan.q_split[qb]), int(plan.q_ptr[qb + 1])
        want_full = sorted(kb for (b, kb), t in tiles.items() if b == qb and t[2] == "full")
        want_part = sorted(kb for (b, kb), t in tiles.items() if b == qb and t[2] == "partial")
        assert plan.q_tile_kb[lo:split].tolist() == want_full
        assert plan.q_tile_kb[split:hi].tolist() == want_part
        assert (plan.q_tile_mask[lo:split] == -1).all() and (plan.q_tile_mask[split:hi] >= 0).all()
        for t in range(split, hi):  # the mask's bits are the tile's edges
            m = words[plan.q_tile_mask[t]].long() & 0xFFFFFFFF  # [bm, words]
            bits = (m[:, torch.arange(bn) // WORD_BITS] >> (torch.arange(bn) % WORD_BITS)) & 1
            assert torch.equal(bits.bool(), tiles[qb, int(plan.q_tile_kb[t])][0])
    # Key-major lists: the same tiles, grouped by key block, with the same mask rows.
    forward = {(qb, int(plan.q_tile_kb[t])): int(plan.q_tile_mask[t])
               for qb in range(-(-n_q // bm)) for t in range(int(plan.q_ptr[qb]), int(plan.q_ptr[qb + 1]))}
    backward = {}
    for kb in range(-(-n_k // bn)):
        lo, split, hi = int(plan.k_ptr[kb]), int(plan.k_split[kb]), int(plan.k_ptr[kb + 1])
        assert plan.k_tile_qb[lo:split].tolist() == sorted(plan.k_tile_qb[lo:split].tolist())
        assert (plan.k_tile_mask[lo:split] == -1).all() and (plan.k_tile_mask[split:hi] >= 0).all()
        backward.update({(int(plan.k_tile_qb[t]), kb): int(plan.k_tile_mask[t]) for t in range(lo, hi)})
    assert forward == backward
    # The remainder: exactly the scattered tiles' edges (with their copies), as sorted CSR.
    rest = torch.zeros_like(counts)
    for (qb, kb), (_, _, kind) in tiles.items():
        if kind == "scattered":
            rest[qb * bm:(qb + 1) * bm, kb * bn:(kb + 1) * bn] = counts[qb * bm:(qb + 1) * bm, kb * bn:(kb + 1) * bn]
    rows = torch.repeat_interleave(torch.arange(n_q), plan.rest_ptr[1:] - plan.rest_ptr[:-1])
    got = torch.zeros_like(counts).index_put_((rows, plan.rest_col), torch.ones_like(rows), accumulate=True)
    assert torch.equal(got, rest)
    key = rows * n_k + plan.rest_col
    assert bool((key[1:] >= key[:-1]).all())


def test_duplicated_edges_stay_scattered_and_full_tiles_need_every_cell():
    # Two copies of one edge weigh as log 2 on its score: a bitmask cannot say so.
    ei = builders.full(16)
    ptr, col, _ = _csr(torch.cat([ei, torch.tensor([[3], [5]])], 1), 16, 16)
    plan = plan_tiles(ptr, col, 16, 16, block_m=8, block_n=8, min_fill=0)
    assert (plan.n_full, plan.n_partial, plan.tc_edges) == (3, 0, 3 * 64)
    ptr, col, _ = _csr(builders.full(12), 12, 12)  # ragged tiles are never full: their padding is no edge
    plan = plan_tiles(ptr, col, 12, 12, block_m=8, block_n=8, min_fill=0)
    assert (plan.n_full, plan.n_partial, plan.tc_edges) == (1, 3, 144)


def test_no_edges_and_the_threshold():
    empty = plan_tiles(torch.zeros(6, dtype=torch.long), torch.zeros(0, dtype=torch.long), 5, 7, block_m=4, block_n=4)
    assert (empty.n_full, empty.n_partial, empty.tc_edges, empty.tc_share) == (0, 0, 0, 0.0)
    assert empty.rest_ptr.tolist() == [0] * 6 and empty.q_ptr.tolist() == [0, 0, 0]
    # 3 edges a row: diagonal 16 x 16 tiles hold 46 or 47 edges (fill 0.18), the tiles beside them 1
    ptr, col, _ = _csr(builders.window(64, 1), 64, 64)
    for min_fill, partial in ((0.1, 4), (0.2, 0), (None, 4), (1 / 256, 10)):  # None: MIN_FILL = 1 / 32
        plan = plan_tiles(ptr, col, 64, 64, block_m=16, block_n=16, min_fill=min_fill)
        assert (plan.n_full, plan.n_partial) == (0, partial)
        assert plan.tc_edges == {0: 0, 4: 184, 10: 190}[partial]
    assert MIN_FILL == pytest.approx(break_even_fill(64, 64, 64, torch.bfloat16), rel=0.15)


@pytest.mark.parametrize("bad, message", [
    (dict(block_m=12), "block_m must be a power of two"),
    (dict(num_queries=4), r"ptr must be \[num_queries \+ 1\]"),
    (dict(num_keys=3), "col holds key ids outside 0..2"),
])
def test_bad_input_is_named(bad, message):
    ptr, col, _ = _csr(builders.window(8, 1), 8, 8)
    args = dict(num_queries=8, num_keys=8, block_m=4, block_n=4) | bad
    with pytest.raises(ValueError, match=message):
        plan_tiles(ptr, col, args.pop("num_queries"), args.pop("num_keys"), **args)
    with pytest.raises(ValueError, match="dtype must be a float dtype"):
        choose_blocks(torch.int64, 64)
    with pytest.raises(ValueError, match=r"head_dim must be 1..128 .* \(got 256\)"):
        choose_blocks(torch.bfloat16, 256)


def test_the_cost_model_prints_its_prediction_beside_the_roofline(capsys):
    # A prediction, not a measurement (no GPU here): window 256 and random 1 % at n = 16k, bfloat16, d = 64.
    n = 1 << 14
    cases = {
        "window 256": builders.window(n, 256),
        "random 1 %": random_edges(n, n, 0.01, seed=0),
    }
    blocks = choose_blocks(torch.bfloat16, 64)
    for name, ei in cases.items():
        ptr, col, _ = _csr(ei, n, n)
        plan = plan_tiles(ptr, col, n, n, block_m=blocks[0], block_n=blocks[1])
        for backward in (False, True):
            p = predict(plan, heads=8, head_dim=64, dtype=torch.bfloat16, backward=backward)
            assert p["total_s"] == pytest.approx(p["tiles_s"] + p["gather_s"])
            assert p["total_s"] >= p["roofline_s"] > 0
            with capsys.disabled():
                print(f"\n{name} {'bwd' if backward else 'fwd'}: tc share {plan.tc_share:.3f}, predicted "
                      f"{p['total_s'] * 1e3:.3f} ms (tiles {p['tiles_s'] * 1e3:.3f}, gather {p['gather_s'] * 1e3:.3f}), "
                      f"roofline {p['roofline_s'] * 1e3:.3f} ms, H100")
        if name == "window 256":
            assert plan.tc_share == 1.0 and plan.n_full > 0
    with pytest.raises(ValueError, match="card must be one of"):
        predict(plan, heads=1, head_dim=64, dtype=torch.bfloat16, card="v100")


def test_float32_and_float64_are_predicted_wholly_gathered():
    """The tc backend runs them on the gather kernels (tile_plan.choose_blocks says why): a plan with every
    edge on tiles is predicted as one with no tile, at the edges' bytes worked out by hand."""
    ptr, col, _ = _csr(builders.window(256, 16), 256, 256)
    tiled = plan_tiles(ptr, col, 256, 256, block_m=64, block_n=64)
    untiled = plan_tiles(ptr, col, 256, 256, block_m=64, block_n=64, min_fill=2.0)  # no tile is 200 % full
    assert tiled.num_edges == tiled.tc_edges == 256 * 33 - 16 * 17 == 8176 and untiled.tc_edges == 0
    # 2 heads x 8176 edges x (a k and a v row of 64 values + an 8-byte index) at the H100's 3.35e12 B/s:
    # float32 2 x 8176 x 520 B = 8,503,040 B: 2.5382 us; float64 2 x 8176 x 1032 B = 16,875,264 B: 5.0374 us
    for dtype, seconds in ((torch.float32, 2.5382e-6), (torch.float64, 5.0374e-6)):
        got = predict(tiled, heads=2, head_dim=64, dtype=dtype)
        assert got == predict(untiled, heads=2, head_dim=64, dtype=dtype)
        assert got["tiles_s"] == 0.0 and got["gather_s"] == pytest.approx(seconds, rel=1e-4)
    bf16 = predict(tiled, heads=2, head_dim=64, dtype=torch.bfloat16)  # tc's tile dtype: on the tiles
    assert bf16["gather_s"] == 0.0 and bf16["tiles_s"] > 0
