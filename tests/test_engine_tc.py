"""The ``tc`` backend (tensor-core tiles plus gathered rows) against the float64 dense oracle.

Without CUDA the kernels run on CPU tensors through Triton's interpreter (``tests/conftest.py``
sets ``TRITON_INTERPRET=1`` before triton is imported), so sizes stay small: tiles of 16 x 16
(``tl.dot``'s least), a few blocks a launch. Each case checks that the plan holds the tile
classes it is about, so that no test passes on the gather kernels alone. The tiles' arithmetic
is checked in float32 (IEEE products) through :class:`TileAttention` directly, tightly; the
backend itself sends float32 calls to the gather kernels, and runs float16 / bfloat16 on the tiles.
"""
import pytest
import torch

from tgattn import builders, engine
from tgattn.engine.dispatch import plan as backend_plan
from tgattn.functional import graph_attention
from tgattn.verify import random_edges

from engine_helpers import inputs, max_err, oracle

pytest.importorskip("triton")
from tgattn.engine.triton.attention import interpreter_ready, triton_attention  # noqa: E402
from tgattn.engine.triton.tc import TileAttention, plan_for, tc_attention, tile_kernels_module  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(
    DEVICE.type == "cpu" and not interpreter_ready(),
    reason="TRITON_INTERPRET=1 must be set before triton is first imported (tests/conftest.py does it)",
)
BLOCKS = (16, 16)
# Float64 oracle vs. kernels in float32 (IEEE products) or half precision (inputs rounded, products on
# tensor cores, weights rounded to the inputs' dtype before P V): as the gather kernels' tests.
DTYPE_TOL = {torch.float32: 2e-6, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@pytest.fixture(autouse=True)
def _kernels(monkeypatch):
    monkeypatch.delenv("TGATTN_NO_TRITON", raising=False)
    assert tile_kernels_module().INTERPRETED == (DEVICE.type == "cpu")


def _without_rows(ei, every=5):
    """``ei`` without the edges of queries ``2, 2 + every, ...`` (rows without edges)."""
    return ei[:, ei[1] % every != 2]


# (edge set, n_q, n_k, min_fill, the tile classes it must hold: full, partial, gathered)
CASES = {
    "block_diagonal_ragged": (lambda: builders.full([32, 16, 9]), 57, 57, 0.0, (True, True, False)),
    "causal_mixed": (lambda: builders.causal(40), 40, 40, 0.5, (True, True, True)),
    "window_partial": (lambda: builders.window(40, 5), 40, 40, 0.0, (False, True, False)),
    "random_mixed_empty_rows": (lambda: _without_rows(random_edges(45, 38, 0.3, seed=2)), 45, 38, 0.25,
                                (False, True, True)),
    "gathered_only": (lambda: random_edges(20, 24, 0.2, seed=4), 20, 24, 2.0, (False, False, True)),
}


def _structure(case):
    make, n_q, n_k, min_fill, classes = CASES[case]
    ei = make()
    s = engine.analyse(ei.to(DEVICE), n_q, n_k)
    plan, _ = plan_for(s, BLOCKS, min_fill)
    assert (plan.n_full > 0, plan.n_partial > 0, plan.tc_edges < plan.num_edges) == classes
    return s, torch.stack([s.src, s.dst]).cpu(), n_q, n_k, min_fill


def _tiles(q, k, v, s, scale, min_fill, *, softcap=None, sinks=None):
    """The tiles plus gathered remainder at ``BLOCKS`` (tile rows: queries x grouped heads), any float dtype."""
    group = q.shape[1] // k.shape[1]
    plan, rest = plan_for(s, (BLOCKS[0] // group, BLOCKS[1]), min_fill)
    return TileAttention.apply(q, k, v, sinks, plan, rest, scale, softcap)


def _dev(*tensors):
    return [t.detach().to(DEVICE).requires_grad_() for t in tensors]


def _grads(out, leaves, grad_out):
    return [g.cpu() for g in torch.autograd.grad(out, leaves, grad_out.to(out.device))]


@pytest.mark.parametrize("case", list(CASES))
def test_forward_and_gradients_equal_the_oracle_for_every_tile_class(case):
    s, ei, n_q, n_k, min_fill = _structure(case)
    q, k, v, grad_out = inputs(n_q, n_k, heads=2, dk=16)
    exact = [t.detach().float().double().requires_grad_() for t in (q, k, v)]  # float32 inputs, in float64
    mine = _dev(*(t.float() for t in (q, k, v)))
    out = _tiles(*mine, s, 0.3, min_fill)
    ref = oracle(*exact, ei, scale=0.3)
    assert out.dtype == torch.float32
    assert max_err(out.cpu().double(), ref) <= 2e-6
    for a, b in zip(_grads(out, mine, grad_out.float()), torch.autograd.grad(ref, exact, grad_out)):
        assert max_err(a.double(), b) <= 1e-5 * max(1.0, b.abs().max().item())


@pytest.mark.parametrize("dtype", list(DTYPE_TOL), ids=["f32", "f16", "bf16"])
def test_dtypes_head_dims_and_the_same_results_as_the_gather_kernels(dtype):
    # dk = 12, dv = 20: padded to 16 and 32 in the tiles; rows mix tiles and gathered edges.
    s, ei, n_q, n_k, min_fill = _structure("causal_mixed")
    q, k, v, grad_out = (t.detach().to(dtype) for t in inputs(n_q, n_k, heads=2, dk=12, dv=20))
    exact = [t.double().requires_grad_() for t in (q, k, v)]
    mine = _dev(q, k, v)
    out = _tiles(*mine, s, 0.25, min_fill)
    if dtype != torch.float32:  # the backend's own entry runs the same tiles
        assert torch.equal(tc_attention(*mine, s, None, 0.25, blocks=BLOCKS, min_fill=min_fill)[0], out)
    gathered, _ = triton_attention(*mine, s, None, 0.25)
    ref = oracle(*exact, ei, scale=0.25)
    tol = DTYPE_TOL[dtype]
    assert out.dtype == dtype
    assert max_err(out.cpu().double(), ref) <= tol and max_err(out.cpu().double(), gathered.cpu().double()) <= tol
    for a, b in zip(_grads(out, mine, grad_out), torch.autograd.grad(ref, exact, grad_out.double())):
        assert a.dtype == dtype
        assert max_err(a.double(), b) <= 4 * tol * max(1.0, b.abs().max().item())


def test_softcap_and_sinks_with_rows_without_edges():
    from test_functional_softcap_sinks import oracle as capped_oracle

    s, ei, n_q, n_k, min_fill = _structure("random_mixed_empty_rows")
    q, k, v, grad_out = inputs(n_q, n_k, heads=2, dk=16)
    q, k = (t.detach().mul(2) for t in (q, k))  # scores of a few units: the cap bites
    sinks = torch.tensor([0.3, -1.2], dtype=torch.float64)
    exact = [t.detach().float().double().requires_grad_() for t in (q, k, v, sinks)]
    mine = _dev(*(t.float() for t in (q, k, v, sinks)))
    out = _tiles(*mine[:3], s, 0.4, min_fill, softcap=1.5, sinks=mine[3])
    ref, _ = capped_oracle(*exact[:3], ei, 0.4, softcap=1.5, sinks=exact[3])
    assert max_err(out.cpu().double(), ref) <= 2e-6
    for a, b in zip(_grads(out, mine, grad_out.float()), torch.autograd.grad(ref, exact, grad_out)):
        assert max_err(a.double(), b) <= 1e-5 * max(1.0, b.abs().max().item())


@pytest.mark.parametrize("group", [2, 4])
def test_grouped_query_heads_share_the_tiles_of_their_key_value_head(group):
    # Four query heads on 4 / group key-value heads: tile rows are (query, head of the group) pairs.
    s, ei, n_q, n_k, min_fill = _structure("causal_mixed")
    q, _, _, grad_out = inputs(n_q, n_k, heads=4, dk=16)
    _, k, v, _ = inputs(n_q, n_k, heads=4 // group, dk=16, seed=1)
    exact = [t.detach().float().double().requires_grad_() for t in (q, k, v)]
    mine = _dev(*(t.float() for t in (q, k, v)))
    out = _tiles(*mine, s, 0.3, min_fill)
    ref = oracle(exact[0], exact[1].repeat_interleave(group, 1), exact[2].repeat_interleave(group, 1), ei, scale=0.3)
    assert plan_for(s, (BLOCKS[0] // group, BLOCKS[1]), min_fill)[0].tc_edges > 0
    assert max_err(out.cpu().double(), ref) <= 2e-6
    for a, b in zip(_grads(out, mine, grad_out.float()), torch.autograd.grad(ref, exact, grad_out)):
        assert max_err(a.double(), b) <= 1e-5 * max(1.0, b.abs().max().item())


def test_duplicated_edges_weigh_as_their_copies():
    ei = builders.window(32, 3)
    ei = torch.cat([ei, ei[:, ::5]], 1)  # every fifth edge twice: its tiles stay on the gather kernels
    s = engine.analyse(ei.to(DEVICE), 32, 32)
    plan, _ = plan_for(s, BLOCKS, 0.0)
    assert s.duplicates and plan.tc_edges == 0
    s2 = engine.analyse(torch.cat([builders.full(32), builders.window(32, 1)[:, :3]], 1).to(DEVICE), 32, 32)
    assert plan_for(s2, BLOCKS, 0.0)[0].n_full == 3  # the tile holding the copies is gathered, not the others
    ei2 = torch.stack([s2.src, s2.dst]).cpu()
    q, k, v, grad_out = inputs(32, 32, heads=1, dk=16)
    exact = [t.detach().float().double().requires_grad_() for t in (q, k, v)]
    mine = _dev(*(t.float() for t in (q, k, v)))
    out = _tiles(*mine, s2, 0.3, 0.0)
    ref = oracle(*exact, ei2, scale=0.3)
    assert max_err(out.cpu().double(), ref) <= 2e-6
    for a, b in zip(_grads(out, mine, grad_out.float()), torch.autograd.grad(ref, exact, grad_out)):
        assert max_err(a.double(), b) <= 1e-5 * max(1.0, b.abs().max().item())


def test_calls_the_tiles_do_not_take_run_on_the_gather_kernels():
    n_q = n_k = 40
    s = engine.analyse(builders.window(40, 5).to(DEVICE), n_q, n_k)
    q, k, v, _ = inputs(n_q, n_k, heads=2, dk=8)
    bias = torch.randn(s.num_edges, 2, dtype=torch.float64)
    mine = _dev(q, k, v)
    out, w = tc_attention(*mine, s, bias.to(DEVICE), 0.3, return_weights=True)  # float64, bias, weights
    ref, ref_w = triton_attention(*mine, s, bias.to(DEVICE), 0.3, return_weights=True)
    assert torch.equal(out, ref) and torch.equal(w, ref_w)
    single = [t.float() for t in mine]  # float32: IEEE products would not run on tensor cores
    assert torch.equal(tc_attention(*single, s, None, 0.3)[0], triton_attention(*single, s, None, 0.3)[0])
    assert not any(isinstance(key, tuple) and key[0] == "tc" for key in s.extras)  # no plan was made
    with pytest.raises(ValueError, match=r"q's heads \(3\) must be a multiple"):
        tc_attention(q[:, :1].expand(-1, 3, -1), k, v, s, None, 0.3)


def test_the_engine_runs_tc_when_named_and_auto_takes_it_where_it_pays():
    s, ei, n_q, n_k, _ = _structure("block_diagonal_ragged")
    for tiles, want in ((True, "tc"), (False, "triton")):
        assert backend_plan(s, "tc", triton=True, tiles=tiles) == want
        assert backend_plan(s, "auto", triton=True, tiles=tiles, weights=True) == want
        assert backend_plan(s, "triton", triton=True, tiles=tiles) == "triton"
    assert backend_plan(s, "tc", triton=False, fusable=False) == "csr"
    q, k, v, grad_out = (t.detach().half() for t in inputs(n_q, n_k, heads=2, dk=16))
    exact = [t.double().requires_grad_() for t in (q, k, v)]
    mine = _dev(q, k, v)
    out = graph_attention(*mine, ei.to(DEVICE), backend="tc")
    assert any(isinstance(key, tuple) and key[0] == "tc" for key in s.extras)  # the tiles ran (plan cached)
    ref = oracle(*exact, ei)
    assert out.dtype == torch.float16 and max_err(out.cpu().double(), ref) <= DTYPE_TOL[torch.float16]
    empty = torch.zeros(2, 0, dtype=torch.long)
    assert graph_attention(*mine, empty.to(DEVICE), backend="tc").abs().max().item() == 0.0


@pytest.mark.slow  # ~17 s under the interpreter: 64 x 64 tiles
def test_every_launch_of_a_tc_call_is_among_the_compiled_configurations(monkeypatch):
    """Forward and backward of plain, capped-with-sinks and grouped-query calls launch no tile kernel
    that ``tgattn.engine.triton.aot`` does not compile for sm_80 / sm_90 (its configurations come
    from the same launchers)."""
    from test_gpu_aot_compile import _meta_key
    from tgattn.engine.triton import aot

    tk = tile_kernels_module()
    seen, run = [], tk.Launch.__call__

    def record(launch):
        if launch.kernel.__name__ in aot.TILE_KERNELS:
            seen.append(_meta_key(launch))
        run(launch)

    monkeypatch.setattr(tk.Launch, "__call__", record)
    n, heads, d, dtype = 10, aot.HEADS, 16, torch.bfloat16
    s = engine.analyse(builders.window(n, 1).to(DEVICE), n, n)
    q = torch.randn(n, heads, d, dtype=dtype, device=DEVICE, requires_grad=True)
    for group, options in ((1, {}), (1, dict(softcap=2.0, sinks=torch.zeros(heads, device=DEVICE))),
                           (aot.GROUPED, dict(softcap=2.0, sinks=torch.zeros(heads, device=DEVICE)))):
        k, v = (torch.randn(n, heads // group, d, dtype=dtype, device=DEVICE, requires_grad=True) for _ in range(2))
        out, _ = tc_attention(q, k, v, s, None, 0.25, min_fill=0.0, **options)
        out.sum().backward()
    compiled = {_meta_key(aot.launch_of(c)) for c in aot.configurations() if c.dtype == dtype and c.head_dim == d}
    # forward bare / with remainder and cap; dq, dk dv with / without cap; 3 grouped; the delta kernel
    assert len(set(seen)) == 10
    assert set(seen) <= compiled, set(seen) - compiled


def test_a_prepared_set_carries_the_plan_the_backend_runs():
    # EdgeSet.tile_plan is the plan backend="tc" takes for such inputs: planned once, kept in the set.
    import tgattn

    n, heads, d = 40, 2, 16
    es = tgattn.prepare(builders.window(n, 5).to(DEVICE), n, n)
    plan = es.tile_plan(torch.float16, d)
    assert plan.tc_edges == es.num_edges  # 64 x 64 tiles of a window this narrow are dense enough
    q, k, v, _ = inputs(n, n, heads, d)  # float64 leaves for the oracle
    out = graph_attention(*(t.detach().half().to(DEVICE) for t in (q, k, v)), es, backend="tc")
    assert es.tile_plan(torch.float16, d) is plan
    assert sum(1 for key in es.structure.extras if key[0] == "tc") == 1  # the call planned nothing more
    assert max_err(out.double().cpu(), oracle(q, k, v, builders.window(n, 5))) < DTYPE_TOL[torch.float16]


@pytest.mark.parametrize("prepared", [False, True], ids=["edge_index", "EdgeSet"])
@pytest.mark.parametrize("backend", ["tc", "triton"])
def test_graph_attention_takes_grouped_heads_and_tc_reads_them_in_place(backend, prepared, monkeypatch):
    # Eight query heads on two key/value heads (G = 4) against SDPA's enable_gqa in float64; on tc the
    # tiles get k and v as given (no repeated copy), on triton the repeated heads.
    import tgattn
    import torch.nn.functional as F

    n, group, d = 40, 4, 16
    ei = builders.window(n, 5)
    edges = tgattn.prepare(ei.to(DEVICE), n, n) if prepared else ei.to(DEVICE)
    q, _, _, grad_out = inputs(n, n, heads=8, dk=d)
    _, k, v, _ = inputs(n, n, heads=8 // group, dk=d, seed=1)
    q, k, v, grad_out = (t.detach().half() for t in (q, k, v, grad_out))
    exact = [t.double().requires_grad_() for t in (q, k, v)]
    mine = _dev(q, k, v)
    tk, seen = tile_kernels_module(), []
    launch = tk.forward_launch
    monkeypatch.setattr(tk, "forward_launch", lambda q, k, *rest: seen.append(k.shape[1]) or launch(q, k, *rest))
    out = graph_attention(*mine, edges, backend=backend)
    assert seen == ([8 // group] if backend == "tc" else [])
    if prepared and backend == "tc":  # the set's plan of G heads per tile is the one the call ran
        assert edges.tile_plan(torch.float16, d, group=group).tc_edges == edges.num_edges
    mask = builders.to_mask(ei, n, n)
    ref = F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in exact), attn_mask=mask,
                                         enable_gqa=True).transpose(0, 1)
    tol = DTYPE_TOL[torch.float16]
    assert out.dtype == torch.float16 and max_err(out.cpu().double(), ref) <= tol
    for a, b, t in zip(_grads(out, mine, grad_out), torch.autograd.grad(ref, exact, grad_out.double()), mine):
        assert a.shape == t.shape  # dk, dv [N, H / G, d]: summed over each group
        assert max_err(a.double(), b) <= 4 * tol * max(1.0, b.abs().max().item())


def test_auto_plans_grouped_calls_with_the_tiles_they_run_on():
    # tiles_pay (auto's test) plans a grouped call at G query heads per tile row, the plan tc_attention takes;
    # a group that is not a power of two stays off the tiles.
    from tgattn.engine.triton.tc import tiles_pay

    s = engine.analyse(builders.window(40, 5).to(DEVICE), 40, 40)
    q = torch.zeros(40, 8, 16, dtype=torch.float16, device=DEVICE)
    assert tiles_pay(q, q[:, :2], s, None, 0.0, False)
    assert [key[1] for key in s.extras if isinstance(key, tuple) and key[0] == "tc"] == [(64 // 4, 64)]
    assert not tiles_pay(q[:, :6], q[:, :2], s, None, 0.0, False, named=True)


def test_sm80_launch_options_split_the_key_blocks_and_keep_the_gradients(monkeypatch):
    # sm_80's defaults run two dk-dv programs of half a key block each (tile_config.default_config);
    # under the interpreter the launch options are sm_90's unless set so.
    from tgattn.engine.triton.tile_config import default_config

    tk = tile_kernels_module()
    monkeypatch.setattr(tk, "tile_config", lambda dtype, head_dim, *shape, **where: default_config(80, head_dim))
    s, ei, n_q, n_k, min_fill = _structure("causal_mixed")
    q, k, v, grad_out = inputs(n_q, n_k, heads=2, dk=16)
    exact = [t.detach().float().double().requires_grad_() for t in (q, k, v)]
    mine = _dev(*(t.float() for t in (q, k, v)))
    plan, rest = plan_for(s, (32, 32), min_fill)  # 16 keys a program: tl.dot's least
    out = TileAttention.apply(*mine, None, plan, rest, 0.3, None)
    ref = oracle(*exact, ei, scale=0.3)
    assert tk.backward_launches(*mine, grad_out.float(), *[torch.zeros(2, n_q)] * 2, plan, 0.3)[0][1].grid[0] == 2 * 2
    for a, b in zip(_grads(out, mine, grad_out.float()), torch.autograd.grad(ref, exact, grad_out)):
        assert max_err(a.double(), b) <= 1e-5 * max(1.0, b.abs().max().item())
