"""Choosing and running a backend for one call of :func:`tgattn.functional.graph_attention`.

``auto`` decides from the cached :class:`~tgattn.engine.analysis.Structure` and the options
of the call, never from the values of ``q``, ``k``, ``v``:

1. ``dense`` (SDPA) when the set is provably full / causal / packed full or causal and the
   call does not ask for weights (bias and dropout included);
2. ``tile`` when the row-blocked tiles are well filled (banded, block structured and
   dense-ish sets: at least ``TILE_FILL_VS_FUSED``, or ``TILE_FILL_VS_CSR`` when the fused
   kernel cannot run) and the call has no dropout, no returned weights and no duplicated edges;
3. ``fused`` (the C++ kernel of :mod:`tgattn.engine.fused`, dropout included) for CPU calls,
   when the kernel could be compiled;
4. ``csr`` otherwise; it honours every option (and is the only one that takes an ``edge_scale``).

A ``softcap`` or ``sinks`` (Gemma 2, gpt-oss) runs on the fused kernel on the CPU from every
backend name but ``csr`` (SDPA and the tiles take neither), on ``triton`` where it runs, else on ``csr``.

Grouped-query heads (``k``, ``v`` with ``H / G`` heads) run in place on ``tc``'s tiles; every other
backend takes them repeated to ``H`` heads (:func:`query_heads`).

On CUDA, ``triton`` (:mod:`tgattn.engine.triton`) takes every call that ``dense`` does not,
when Triton is installed; it honours every option but ``edge_scale`` (softcap and sinks
included), runs float16 / bfloat16 natively and needs no NaN check (no host sync). Where the
call's tile plan puts edges on tensor cores and the tiles take its options
(:func:`tgattn.engine.triton.tc.tiles_pay`), ``auto`` runs ``tc`` instead: the same kernels for
the scattered edges, ``tl.dot`` tiles for the rest. ``tc`` named falls back to ``triton`` for
the calls its tiles do not take (bias, dropout, returned weights, float64). A NaN key or value
in a partial tile reaches the tile's other queries on ``tc`` (``0 * nan`` in ``P V``), as on SDPA.

Inputs holding NaN or infinity (and biases or sinks holding NaN) always run on ``csr`` on the CPU, which
touches nothing but the edges, so that a bad key, value or bias reaches exactly the queries that
attend to it. (The check is one sum per tensor; sums that overflow to infinity also send the
call to ``csr``: slower, still exact.) On a GPU that check would make the host wait for the
device, so it guards only the tile path (which syncs per chunk anyway): the Triton kernels
need none, and SDPA runs unchecked (a NaN key or value of a causal or packed set may then
also reach the other queries of its SDPA tile; ``backend="triton"`` keeps NaN local).
float16 / bfloat16 run in float32 on the CPU backends: the fused kernel reads them as they are and
computes in float32 (:mod:`tgattn.engine.fused`), the others take float32 copies.

Per-edge key / value terms given as ``(features, weight)`` pairs over one features tensor run inside
the fused kernel on the CPU (:func:`edge_terms_on_fused`, :func:`run_edge_terms`) from every backend
name but ``csr`` and ``gather``, without an ``edge_scale``; on the Triton kernels where they run
(:func:`edge_terms_on_triton`, :func:`run_triton_edge_terms`), without a ``softcap`` either; other calls
with edge terms compose them around the backend :func:`plan` picks
(:func:`tgattn.functional.attention_with_edge_terms`).

A named backend that cannot honour a call falls back along dense -> tile -> fused -> csr, so
that every backend name is always exact (``triton`` falls back like ``fused``); :func:`plan`
tells which one will run.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from .analysis import DENSE_KINDS, Structure, on_host
from .csr import csr_attention
from . import fused
from . import triton as triton_backend
from .dense import dense_attention
from .edge_terms import MappedAttention
from .triton.edge_features import triton_edge_features
from .precision import compute_dtype
from .tiles import fill_bound, tile_attention, tile_layout

ENGINE_BACKENDS = ("dense", "tile", "fused", "csr", "triton", "tc")
# Fraction of edge cells per tile below which the sparse kernels beat the tiles. Measured at
# n = 4096, H = 8, d = 64: CSR wins below 0.3 (one thread). Tile time / fused time on windows
# (1 and 2 threads, forward and forward+backward): w = 32, fill 0.67: 1.55-1.75x; w = 64,
# fill 0.80: 1.11-1.79x; w = 96, fill 0.75: 1.16-1.38x; w = 128, fill 0.79: 0.99-1.34x;
# w = 256, fill 0.86: 0.69-1.21x (forward+backward 0.69); w = 512, fill 0.83: 0.54-0.90x.
# Re-measured with the FlashAttention-2-style fused backward (one thread, thread CPU time, n =
# 1k, 4k, 16k, 64k; tile time / fused time, forward and forward+backward): w = 64, fill 0.78-0.81:
# 1.27-1.49x; w = 128, fill 0.79-0.80: 1.01-1.45x; w = 256, fill 0.78-0.89: 0.89-1.16x. The
# crossover moves with the fill, not with n (the old kernel's growth with n, fresh [H, E]
# buffers and head-major copies, is gone), so the threshold does not depend on n.
TILE_FILL_VS_CSR = 0.3
TILE_FILL_VS_FUSED = 0.82
# SDPA runs one batched call per distinct sequence length of a packed set, so many short
# sequences of unequal lengths (molecule batches under GPS) pay per call. Measured (fwd+bwd,
# one thread, H = 4, d = 16; dense / fused time): 128 graphs of 5-47 nodes 2.1x (full) and
# 3.5x (causal); 64 of 40-60 nodes 1.2x / 2.0x; 16 of 100-300 nodes 0.40x / 0.87x; equal
# lengths 8 x 256 0.33x / 0.65x. Below this mean length, unequal packed sets skip SDPA.
DENSE_MIN_MEAN_LENGTH = 128


def dense_pays(s: Structure) -> bool:
    """Whether ``auto`` should run a full / causal set on SDPA: one sequence, equal lengths,
    or sequences long enough (mean ``DENSE_MIN_MEAN_LENGTH``) for a call per length to pay."""
    if s.lengths is None:
        return True
    if "dense_pays" not in s.extras:
        equal = len(set(s.lengths)) == 1
        s.extras["dense_pays"] = equal or s.n_q >= DENSE_MIN_MEAN_LENGTH * len(s.lengths)
    return s.extras["dense_pays"]


def plan(
    s: Structure,
    backend: str = "auto",
    *,
    dropout: bool = False,
    weights: bool = False,
    fusable: bool = True,
    edge_scale: bool = False,
    triton: bool = False,
    softcap: bool = False,
    sinks: bool = False,
    tiles: bool = False,
) -> str:
    """The backend that runs a call with these options on structure ``s``.

    Every backend honours an edge bias, so a bias never changes the choice. ``fusable`` is
    false for inputs the fused kernel does not take (not on the CPU); the kernel must also be
    available (:func:`tgattn.engine.fused.available`). ``triton`` is true when the Triton
    kernels can run the inputs (:func:`tgattn.engine.triton.usable`). Only ``csr`` takes an
    ``edge_scale``; a ``softcap`` or ``sinks`` run on ``triton`` where it runs, else on ``fused``
    (``csr`` when named, or without the kernel). ``tiles`` is true when the tensor-core tiles take
    the call and pay (:func:`tgattn.engine.triton.tc.tiles_pay`): ``triton`` then runs as ``tc``.

    Example:
        >>> from tgattn import builders
        >>> from tgattn.engine.analysis import analyse
        >>> s = analyse(builders.causal(64), 64, 64)
        >>> plan(s), plan(s, dropout=True), plan(s, weights=True, fusable=False)
        ('dense', 'dense', 'csr')
    """
    if backend not in ("auto",) + ENGINE_BACKENDS:
        raise ValueError(f"unknown engine backend {backend!r}")
    if edge_scale:
        return "csr"
    kernels = "tc" if tiles and backend in ("auto", "tc") else "triton"
    if softcap or sinks:  # csr, fused and Triton's kernels take them; SDPA and the row-blocked tiles do not
        if triton and backend in ("auto", "triton", "tc"):
            return kernels
        return "fused" if backend != "csr" and fusable and fused.available() else "csr"
    dense_ok = s.kind in DENSE_KINDS and not weights
    if triton and (backend in ("triton", "tc") or (backend == "auto" and not (dense_ok and dense_pays(s)))):
        return kernels
    if backend == "auto" and dense_ok and dense_pays(s):
        return "dense"
    if backend == "dense" and dense_ok:
        return "dense"
    fused_ok = backend != "csr" and fusable and fused.available()
    threshold = TILE_FILL_VS_FUSED if fused_ok else TILE_FILL_VS_CSR
    # Tiles are laid out (and cached) only when they may be used: for the backends that fall
    # back to them, and under auto only when the cheap bound on their fill reaches the threshold.
    tile_ok = (
        backend in ("auto", "dense", "tile")
        and s.num_edges > 0
        and not (dropout or weights or s.duplicates)
        and (backend != "auto" or fill_bound(s, threshold) >= threshold)
        and tile_layout(s) is not None
    )
    if tile_ok and (backend != "auto" or tile_layout(s).fill >= threshold):
        return "tile"
    return "fused" if fused_ok else "csr"


def _fusable(q: Tensor) -> bool:
    """Whether the fused kernel can take ``q``'s call: a CPU tensor, and for float16 / bfloat16 its half
    library built (the first such call builds it; where that build fails the call runs on ``csr``, as a
    failed build of the main library does)."""
    return q.device.type == "cpu" and (q.dtype not in (torch.float16, torch.bfloat16) or fused.half_available())


def all_finite(*tensors: Tensor) -> bool:
    """Whether the tensors hold only finite numbers (a sum each, which overflows to inf where a
    value is not finite; an overflow of finite values reads as not finite, which only costs speed).

    Views that share a base no more than twice their size are summed through that base, once:
    a conv's q, k and v are column slices of one projection, whose strided sums took three
    times as long as the base's one contiguous sum (molecule batches).

    Example:
        >>> proj = torch.randn(5, 12)
        >>> all_finite(*proj.split(4, 1)), all_finite(torch.tensor([1.0, float("nan")]))
        (True, False)
    """
    groups: dict = {}
    for t in {id(t): t for t in tensors}.values():
        base = t if t._base is None else t._base
        groups.setdefault(id(base), (base, []))[1].append(t)
    for base, views in groups.values():
        whole = base is not views[0] and base.numel() <= 2 * sum(t.numel() for t in views)
        if not all(math.isfinite(t.sum().item()) for t in ([base] if whole else views)):  # no isfinite op: 5 us
            return False
    return True


def run(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    s: Structure,
    bias: Optional[Tensor],
    scale: float,
    dropout_p: float,
    return_weights: bool,
    backend: str = "auto",
    *,
    edge_scale: Optional[Tensor] = None,
    generator: Optional[torch.Generator] = None,
    softcap: Optional[float] = None,
    sinks: Optional[Tensor] = None,
) -> Tuple[Tensor, Optional[Tensor]]:
    """Attention on structure ``s``; ``k``, ``v`` have ``H`` heads or ``H / G`` (grouped-query heads,
    :func:`query_heads`); ``bias`` and ``edge_scale`` are ``[E, 1 or H]`` in the caller's edge order,
    ``sinks`` is ``[H]``; ``softcap`` and ``sinks`` run on ``triton`` where it runs, else on ``fused`` or ``csr``.

    float16 / bfloat16 inputs run in float32 (outputs in the input dtype), and autocast is off
    inside, so that scores and sums accumulate in float32 on every backend; ``fused`` and
    ``triton`` read them as they are, the others take float32 copies.
    ``generator`` draws the dropout mask of ``csr`` and the dropout seed of ``fused``.

    Returns ``(out, weights)`` with weights ``[E, H]`` in the caller's edge order, or ``None``.
    """
    dtype = q.dtype
    fusable = _fusable(q)
    named = backend in ("triton", "tc")
    tritonable = backend in ("auto", "triton", "tc") and triton_backend.usable(q, named=named)
    tiles = tritonable and backend in ("auto", "tc") and edge_scale is None and triton_backend.tiles_pay(
        q, v, s, bias, dropout_p, return_weights, named=backend == "tc")
    chosen = plan(
        s, backend, dropout=dropout_p > 0, weights=return_weights, fusable=fusable,
        edge_scale=edge_scale is not None, triton=tritonable, softcap=softcap is not None, sinks=sinks is not None,
        tiles=tiles,
    )
    if chosen not in ("csr", "triton", "tc") and (on_host(q) or chosen == "tile") and not _finite(
        bias, q, k, v, sinks=sinks
    ):
        # Dense tiles multiply masked cells by 0; 0 * nan would leak NaN into queries that never
        # touch the bad key, and the fused kernel skips -inf-biased edges whose NaN score the
        # oracle keeps (and its max drops a NaN bias or sink). The CSR kernels touch every edge and nothing else.
        chosen = "csr"
    if chosen != "tc":  # the tiles read grouped heads in place; every other backend takes one key head per query head
        k, v = query_heads(k, v, q.shape[1])
    bias, edge_scale = _sorted(bias, s), _sorted(edge_scale, s)
    # Triton and the fused kernel read half precision as it is and accumulate in float32 themselves.
    work = dtype if chosen in ("triton", "tc", "fused") else compute_dtype(dtype)
    # q's dtype or float32 (a float32 bias with float64 q); the fused kernel's bias is float32 with half q.
    bias = None if bias is None else bias.to(compute_dtype(dtype) if chosen == "fused" else work)
    if work != dtype:
        q, k, v = q.to(work), k.to(work), v.to(work)
        edge_scale = None if edge_scale is None else edge_scale.to(work)
    sinks = None if sinks is None else sinks.to(compute_dtype(dtype))
    csr_only = (edge_scale, generator, softcap, sinks)  # generator: also fused's dropout seed
    if torch.is_autocast_enabled(q.device.type):
        with torch.autocast(q.device.type, enabled=False):
            out, weights = _attend(chosen, q, k, v, s, bias, scale, dropout_p, return_weights, csr_only)
    else:
        out, weights = _attend(chosen, q, k, v, s, bias, scale, dropout_p, return_weights, csr_only)
    out = out.to(dtype)
    if not return_weights or weights is None:
        return out, None
    return out, _callers_order(weights, s).to(dtype)


def query_heads(k: Tensor, v: Tensor, heads: int) -> Tuple[Tensor, Tensor]:
    """``k``, ``v`` with ``heads`` heads: grouped-query heads ``[N, H / G, d]`` repeated ``G`` times each
    (query head ``h`` reads key head ``h // G``, SDPA's ``enable_gqa``), else as given.

    Example:
        >>> k = torch.arange(2.0).view(1, 2, 1)
        >>> query_heads(k, k, 4)[0].flatten().tolist()
        [0.0, 0.0, 1.0, 1.0]
    """
    group = heads // k.shape[1]
    return (k, v) if group == 1 else (k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))


def _finite(bias: Optional[Tensor], *tensors: Tensor, sinks: Optional[Tensor] = None) -> bool:
    """Whether the tensors are finite and ``bias`` and ``sinks`` hold no NaN (``-inf`` is a valid bias
    and sink): what the fused kernel and the tiles need to equal the oracle (see :func:`run`)."""
    return all_finite(*tensors) and not any(t is not None and bool(torch.isnan(t).any()) for t in (bias, sinks))


def _sorted(t: Optional[Tensor], s: Structure) -> Optional[Tensor]:
    """A per-edge tensor in the caller's order, in the structure's sorted order."""
    return t if t is None or s.perm is None else t[s.perm]


def _callers_order(weights: Tensor, s: Structure) -> Tensor:
    """Per-edge weights in the structure's sorted order, back in the caller's order."""
    return weights if s.perm is None else torch.empty_like(weights).index_copy(0, s.perm, weights)


def edge_terms_on_fused(
    s: Structure, backend: str, q: Tensor, k: Tensor, v: Tensor, features: Tensor, maps: Tuple[Tensor, ...],
    bias: Optional[Tensor], *, edge_scale: bool, softcap: bool, sinks: Optional[Tensor],
) -> bool:
    """Whether a call with per-edge terms in factored form runs them inside the fused kernel: where
    :func:`plan` sends it to ``fused`` once weights are asked for (the value term needs them on every
    other backend, which keeps it off SDPA and the tiles), and with finite inputs and no NaN sink (as
    :func:`run` checks; the composition then runs on ``csr``)."""
    if not on_host(q) or not _fusable(q) or s.num_edges == 0:  # the kernel runs on the host, and its finite check reads q
        return False
    chosen = plan(s, backend, weights=True, fusable=True, edge_scale=edge_scale, softcap=softcap,
                  sinks=sinks is not None)
    return chosen == "fused" and _finite(bias, q, k, v, features, *maps, sinks=sinks)


def edge_terms_on_triton(s: Structure, backend: str, q: Tensor, *, edge_scale: bool, softcap: bool) -> bool:
    """Whether a call with per-edge terms in factored form runs them inside the Triton kernels
    (:mod:`tgattn.engine.triton.edge_features`): where the kernels take ``q`` (CUDA tensors; CPU tensors under
    Triton's interpreter when named) and the call has edges, no ``edge_scale`` and no ``softcap`` (the key
    term joins the scores after the cap, which :func:`tgattn.functional.graph_attention` refuses). Reads nothing
    back: the Triton kernels need no finite check.

    Example:
        >>> from tgattn import builders
        >>> from tgattn.engine.analysis import analyse
        >>> s, q = analyse(builders.window(8, 1), 8, 8), torch.zeros(8, 2, 4)
        >>> edge_terms_on_triton(s, "auto", q, edge_scale=False, softcap=False)  # a CPU tensor: the fused kernel's
        False
    """
    if s.num_edges == 0 or edge_scale or softcap or backend not in ("auto", "triton", "tc"):
        return False
    return triton_backend.usable(q, named=backend != "auto")


def run_triton_edge_terms(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    s: Structure,
    bias: Optional[Tensor],
    scale: float,
    dropout_p: float,
    return_weights: bool,
    features: Tensor,
    key_maps: Optional[Tensor],
    value_maps: Optional[Tensor],
    *,
    sinks: Optional[Tensor] = None,
) -> Tuple[Tensor, Optional[Tensor]]:
    """:func:`run_mapped_edge_terms` on the Triton kernels (where :func:`edge_terms_on_triton` says so): ``k``, ``v``
    with ``H`` heads, ``bias`` ``[E, 1 or H]`` in the caller's order, maps ``[H, d, F]`` of q's dtype. Returns
    ``(out, weights or None)``, weights in the caller's order."""
    bias = _sorted(bias, s)  # the kernels read the features through s.perm, in the caller's order
    bias = None if bias is None else bias.to(q.dtype)
    sinks = None if sinks is None else sinks.to(compute_dtype(q.dtype))
    with torch.autocast(q.device.type, enabled=False):
        out, weights = triton_edge_features(q, k, v, s, bias, scale, dropout_p, return_weights, features, key_maps,
                                            value_maps, sinks=sinks)
    return out, None if weights is None else _callers_order(weights, s)


def run_edge_terms(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    s: Structure,
    bias: Optional[Tensor],
    scale: float,
    dropout_p: float,
    return_weights: bool,
    edge_q: Optional[Tensor],
    features: Tensor,
    sums: bool,
    *,
    generator: Optional[torch.Generator] = None,
    softcap: Optional[float] = None,
    sinks: Optional[Tensor] = None,
) -> Tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    """:func:`run` on the fused kernel with per-edge terms (where :func:`edge_terms_on_fused` says so):
    ``features [E, F]`` (caller's order), ``edge_q [Nq, H, F]`` for the key term or None, ``sums`` for
    the value term. Returns ``(out, weights or None, sums [Nq, H, F] or None)``, weights in the
    caller's order, sums in the compute dtype (see :func:`tgattn.engine.fused.fused_attention`).
    """
    bias = _sorted(bias, s)  # the kernel reads the features through s.perm, in the caller's order
    with torch.autocast("cpu", enabled=False):  # fused_attention casts bias and sinks to the compute dtype
        out, weights, summed = fused.fused_attention(
            q, k, v, s, bias, scale, dropout_p, generator, return_weights, softcap, sinks, edge_q=edge_q,
            edge_features=features, edge_sums=sums,
        )
    return out, None if weights is None else _callers_order(weights, s), summed


def run_mapped_edge_terms(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    s: Structure,
    bias: Optional[Tensor],
    scale: float,
    dropout_p: float,
    return_weights: bool,
    features: Tensor,
    key_maps: Optional[Tensor],
    value_maps: Optional[Tensor],
    *,
    generator: Optional[torch.Generator] = None,
    softcap: Optional[float] = None,
    sinks: Optional[Tensor] = None,
) -> Tuple[Tensor, Optional[Tensor]]:
    """:func:`run_edge_terms` with the terms' per-head maps ``[H, d, F]`` (``W_h``; None for a missing term)
    applied with the kernel in one autograd node (:class:`tgattn.engine.edge_terms.MappedAttention`): the
    output already holds the value term ``W_h sum_j a_ij e_ij``. For float32 / float64 CPU inputs of one
    dtype (:func:`tgattn.engine.edge_terms._native`). Returns ``(out, weights or None)``, weights in the
    caller's order.
    """
    seed = int(torch.randint(0, 2**62, (), generator=generator)) if dropout_p > 0 else 0
    bias = _sorted(bias, s)  # the kernel reads the features through s.perm, in the caller's order
    bias = None if bias is None else bias.to(q.dtype)  # the compute dtype (a no-op where it is q's)
    sinks = None if sinks is None else sinks.to(q.dtype)
    # The kernels read rows through any row and head strides, but a row's features must be contiguous.
    q, k, v = (t if t.shape[2] <= 1 or t.stride(2) == 1 else t.contiguous() for t in (q, k, v))
    out, weights = MappedAttention.apply(q, k, v, bias, sinks, features.contiguous(), key_maps, value_maps, s, scale,
                                         dropout_p, seed, return_weights, softcap)
    return out, _callers_order(weights.T, s) if return_weights else None


def _attend(chosen, q, k, v, s, bias, scale, dropout_p, return_weights, csr_only):
    edge_scale, generator, softcap, sinks = csr_only
    if chosen == "dense":
        return dense_attention(q, k, v, s, scale, bias, dropout_p), None
    if chosen == "tile":
        return tile_attention(q, k, v, s, bias, scale), None
    if chosen == "tc":
        return triton_backend.tc_attention(q, k, v, s, bias, scale, dropout_p, return_weights, softcap=softcap,
                                           sinks=sinks)
    if chosen == "triton":
        return triton_backend.triton_attention(q, k, v, s, bias, scale, dropout_p, return_weights, softcap=softcap,
                                               sinks=sinks)
    if chosen == "fused":
        return fused.fused_attention(q, k, v, s, bias, scale, dropout_p, generator, return_weights, softcap, sinks)
    return csr_attention(q, k, v, s, bias, scale, dropout_p, edge_scale, generator, softcap, sinks)
