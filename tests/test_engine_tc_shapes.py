"""The tile kernels at every tile shape the sweep may pick (``tile_config.SHAPES``) against the float64
oracle, and the ``tc`` backend taking its shape from the tuning table in force.

``test_engine_tc.py`` checks every tile class at 16 x 16 tiles (one mask word a row); here the
candidates' shapes run under Triton's interpreter: 128 query rows (or 64 queries x 2 grouped heads),
128 keys (four mask words a row, and four 32-key dk-dv programs a key block, each reading its own
words), and 64 x 128 tiles, which the sweep does not try but the kernels take. Each set holds the tile classes it is about (checked on the plan), with rows that mix tiles
and gathered edges, and rows without edges.
"""
import csv

import pytest
import torch

from tgattn import builders, engine
from tgattn.verify import random_edges

from engine_helpers import inputs, max_err, oracle
from test_engine_tc import DEVICE, DTYPE_TOL, _dev, _grads, _without_rows, pytestmark  # noqa: F401

pytest.importorskip("triton")
from tgattn.engine.triton import tile_config  # noqa: E402
from tgattn.engine.triton.tc import TileAttention, plan_for, plan_for_inputs, tc_attention  # noqa: E402
from tgattn.engine.triton.tile_plan import choose_blocks  # noqa: E402

NEW_SHAPES = [s for s in tile_config.SHAPES if s != (64, 64)] + [(64, 128)]  # 64 x 64: the aot and pipeline tests


def _case(name, n):
    """``(edge_index, n_q, n_k, min_fill)``: a causal set of ``n`` queries whose rows mix full and partial
    tiles with gathered edges (the diagonal's quarter-filled tiles), or a random one with rows without
    edges and every tile partial or gathered (the cut ones)."""
    if name == "causal_mixed":
        return builders.causal(n), n, n, 0.3
    return _without_rows(random_edges(n, n - 40, 0.08, seed=3)), n, n - 40, 0.05


def _check(shape, name, *, n=300, group=1, softcap=None, dtype=torch.float32):
    """At ``n = 300``: three blocks of 128 (the last cut), full, partial and out-of-bounds cells."""
    ei, n_q, n_k, min_fill = _case(name, n)
    s = engine.analyse(ei.to(DEVICE), n_q, n_k)
    plan, rest = plan_for(s, (shape[0] // group, shape[1]), min_fill)
    assert plan.n_partial > 0 and 0 < plan.tc_edges < plan.num_edges
    assert (plan.n_full > 0) == (name == "causal_mixed")
    q, _, _, grad_out = inputs(n_q, n_k, heads=2 * group, dk=16)
    _, k, v, _ = inputs(n_q, n_k, heads=2, dk=16, dv=32, seed=1)
    grad_out = torch.randn(n_q, 2 * group, 32, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    q, k = q.detach() * 2, k.detach() * 2  # scores of a few units: a cap bites
    exact = [t.detach().to(dtype).double().requires_grad_() for t in (q, k, v)]
    mine = _dev(*(t.to(dtype) for t in (q, k, v)))
    out = TileAttention.apply(*mine, None, plan, rest, 0.3, softcap)
    kr, vr = (t.repeat_interleave(group, 1) for t in exact[1:])
    if softcap is None:
        ref = oracle(exact[0], kr, vr, ei, scale=0.3)
    else:
        from test_functional_softcap_sinks import oracle as capped_oracle

        ref, _ = capped_oracle(exact[0], kr, vr, ei, 0.3, softcap=softcap)
    # float32: rows of up to 300 keys with scores of a few units (test_engine_tc's 2e-6 is for rows of 40)
    tol = 5e-6 if dtype == torch.float32 else DTYPE_TOL[dtype]
    assert out.dtype == dtype and max_err(out.cpu().double(), ref) <= tol
    for a, b in zip(_grads(out, mine, grad_out.to(dtype)), torch.autograd.grad(ref, exact, grad_out)):
        assert max_err(a.double(), b) <= (1e-5 if dtype == torch.float32 else 4 * tol) * max(1.0, b.abs().max().item())


@pytest.mark.slow  # 2-6 s each under the interpreter
@pytest.mark.parametrize("shape", NEW_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("name", ["causal_mixed", "random_empty_rows"])
def test_every_candidate_shape_equals_the_oracle_forward_and_backward(shape, name):
    _check(shape, name)


@pytest.mark.slow  # 10-20 s each under the interpreter
@pytest.mark.parametrize("shape", NEW_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_every_candidate_shape_takes_grouped_heads_and_a_softcap(shape):
    # 2 query heads a key head: the tile's rows are (query, head) pairs, shape[0] / 2 queries
    _check(shape, "causal_mixed", n=200, group=2, softcap=1.5)


@pytest.mark.slow  # 4 s
def test_the_largest_tiles_in_bfloat16_with_a_softcap():
    _check((128, 128), "random_empty_rows", n=200, softcap=2.0, dtype=torch.bfloat16)


def _table(path, card, shape, dtype="bfloat16", d=64, options=((8, 3), (8, 4), (8, 2))):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=tile_config.TABLE_FIELDS)
        writer.writeheader()
        for kernel, (warps, stages) in zip(tile_config.KERNELS, options):
            writer.writerow(dict(card=card, dtype=dtype, head_dim=d, block_m=shape[0], block_n=shape[1], kernel=kernel,
                                 num_warps=warps, num_stages=stages))


def test_the_backend_plans_at_the_shape_its_card_s_table_row_names(tmp_path, monkeypatch):
    path = tmp_path / "tile_configs.csv"
    _table(path, "NVIDIA H200", (128, 64))
    monkeypatch.setitem(tile_config.TABLE_IN_FORCE, "path", str(path))
    monkeypatch.setattr(tile_config, "current_device", lambda: ("NVIDIA H200", 90))
    assert choose_blocks(torch.bfloat16, 64) == choose_blocks(torch.bfloat16, 50) == (128, 64)
    # no row: the default, for another dtype, head dim or card
    assert choose_blocks(torch.float16, 64) == choose_blocks(torch.bfloat16, 128) == (64, 64)
    assert choose_blocks(torch.bfloat16, 64, card="NVIDIA A100") == (64, 64)
    s = engine.analyse(builders.window(200, 20).to(DEVICE), 200, 200)
    assert (plan_for_inputs(s, torch.bfloat16, 64)[0].block_m, plan_for_inputs(s, torch.bfloat16, 64, 2)[0].block_m) \
        == (128, 64)  # 2 grouped heads: 64 queries a tile
    # a call runs that plan at the row's launch options
    from tgattn.engine.triton import tc

    seen = []
    monkeypatch.setattr(tc.TileAttention, "apply", lambda *a: seen.append((a[4].block_m, a[4].block_n)) or a[0])
    q = torch.zeros(200, 2, 64, dtype=torch.bfloat16, device=DEVICE)
    tc_attention(q, q, q, s, None, 0.125, min_fill=0.0)
    assert seen == [(128, 64)]
    options = tile_config.tile_config(torch.bfloat16, 64, 128, 64)
    assert (options.forward, options.dq, options.dkdv, options.dkdv_split) == ((8, 3), (8, 4), (8, 2), 2)


def test_a_table_row_outside_the_compiled_candidates_is_refused(tmp_path):
    path = tmp_path / "bad.csv"
    _table(path, "NVIDIA H200", (256, 64))
    with pytest.raises(ValueError, match=r"NVIDIA H200 forward bfloat16 d=64 256 x 64 tiles, 8 warps, 3 stages "
                                         r"is not a compiled candidate"):
        tile_config.read_table(str(path))
    _table(path, "NVIDIA H200", (128, 128), options=((8, 3), (8, 4), (4, 2)))  # 4 warps: not on 128-row tiles
    with pytest.raises(ValueError, match="dkdv bfloat16 d=64 128 x 128 tiles, 4 warps, 2 stages is not"):
        tile_config.read_table(str(path))
    _table(path, "NVIDIA H200", (64, 64), d=32)  # head dims the sweep does not tune
    with pytest.raises(ValueError, match="d=32"):
        tile_config.read_table(str(path))
    _table(path, "NVIDIA H200", (64, 64))
    with open(path, "a", newline="") as f:  # a second shape for the same card, dtype and head dim
        f.write("NVIDIA H200,bfloat16,64,128,128,forward,8,3\nNVIDIA H200,bfloat16,64,128,128,dq,8,3\n"
                "NVIDIA H200,bfloat16,64,128,128,dkdv,8,3\n")
    with pytest.raises(ValueError, match=r"names tile shapes \[\(64, 64\), \(128, 128\)\], not one"):
        tile_config.read_table(str(path))
