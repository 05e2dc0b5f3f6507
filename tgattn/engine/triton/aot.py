"""Every Triton kernel configuration of the backend, compiled ahead of time for GPUs that are not here.

Triton's interpreter runs the kernels' Python semantics on the CPU; it cannot tell whether a
GPU compiler takes them (tile shapes, dtype lowering) or what they cost on one (registers,
spills, shared memory). Triton compiles for an NVIDIA target without the GPU (its wheel ships
``ptxas``), so:

* :func:`configurations` lists every configuration the ``triton`` and ``tc`` backends launch
  (each dtype, head dimension and option), building each :class:`~.kernels.Launch` with the
  launchers the backends run (:func:`~.kernels.forward_launch`, :func:`~.tile_kernels.forward_launch`,
  ...) and the block sizes of :func:`~.attention.blocks_for` and :func:`~.tile_plan.choose_blocks`,
  so the list cannot drift from what runs;
* :func:`candidate_launch` builds the launch of each configuration the tuning sweep may pick
  (:func:`~.tile_config.candidates`: tile shapes x warps x stages);
* :func:`compile_launch` binds a launch's arguments as Triton's JIT binds them at a launch
  (same signature, specialisation and constants), compiles them for a :class:`Target` and
  reads registers, spills and shared memory from ``ptxas``'s own log.

It needs Triton's compiler, not its interpreter: run it in a process without
``TRITON_INTERPRET=1`` (``python -m tgattn.bench.gpu_compiled`` does).
"""
from __future__ import annotations

import contextlib
import functools
import io
import itertools
import re
from dataclasses import dataclass
from typing import Iterator, Optional, Tuple

import torch

from ..analysis import analyse
from .attention import DTYPES, blocks_for, kernels_module, walks
from .tc import tile_kernels_module
from .tile_config import Candidate
from .tile_plan import TILE_DTYPES, choose_blocks, plan_tiles

# Head dims at powers of two: any other head dim d runs the blocks of next_power_of_2(d) (d itself
# is a runtime argument).
HEAD_DIMS = (16, 32, 64, 128)
BIASES = ("none", "shared", "per-head")  # [E, 1] (a runtime stride 0) and [E, H] (stride 1: a constant)
# A representative call: 8 heads, and 37 rows, so that no row count is a multiple of 16 (Triton
# specialises integers divisible by 16; the general kernel is the one most calls get).
HEADS, ROWS = 8, 37
TILE_KERNELS = ("tile_forward_kernel", "tile_dq_kernel", "tile_dkdv_kernel", "tile_delta_kernel")
GROUPED = 4  # query heads per key/value head in the grouped-query configurations of the tiles
RESERVED_SMEM = 1024  # shared memory the CUDA runtime keeps per block on sm_80 and sm_90
REG_UNIT = 256  # registers are allocated per warp in units of 256
# The floor: 8 resident warps per SM (12.5 %). The kernels gather key / value rows, so what
# they need is bytes in flight: 3.35 TB/s x ~0.6 us of DRAM latency (an assumption until
# measured) / 132 SMs ~ 15 KB per SM on an H100 (Little's law), 60 bytes a thread at 8 warps,
# while one chunk gathers two tiles of 16 elements a thread (128 bytes of float32), issued
# together. Below two 4-warp blocks, the SM would also idle while its one block waits at a barrier.
OCCUPANCY_FLOOR_WARPS = 8
# The tile kernels' floor: one warpgroup. A tile program keeps its own copies in flight (the next
# two tiles' keys and values, 3 stages); at d = 128 those buffers (112-134 KB) leave room for one
# program per SM, as FlashAttention-3's and FlexAttention's d = 128 Hopper kernels run.
TILE_FLOOR_WARPS = 4


def triton_version() -> Optional[str]:
    """The installed Triton's version (``None`` without one)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("triton")
    except PackageNotFoundError:
        return None


@dataclass(frozen=True)
class Target:
    """A GPU to compile for, with its published per-SM limits (CUDA C++ Programming Guide, table
    "Technical Specifications per Compute Capability"; A100 and H100 SXM whitepapers)."""

    name: str
    arch: int
    gpu: str
    smem_per_sm: int  # bytes the SM's blocks share
    smem_per_block: int  # the most one block may ask for (opt-in)
    regs_per_sm: int = 65536
    max_warps: int = 64
    max_blocks: int = 32

    def triton_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", self.arch, 32)


TARGETS = (
    Target("sm_80", 80, "A100", smem_per_sm=164 * 1024, smem_per_block=163 * 1024),
    Target("sm_90", 90, "H100", smem_per_sm=228 * 1024, smem_per_block=227 * 1024),
)


@dataclass(frozen=True)
class Config:
    """One kernel configuration: the kernel, the inputs' dtype and head dim, and the options."""

    kernel: str
    dtype: torch.dtype
    head_dim: int
    bias: str = "none"
    dropout: bool = False
    weights: bool = False  # forward: returns the weights; backward: they have a gradient
    bias_grad: bool = False
    softcap: bool = False
    sinks: bool = False  # forward only: the backward kernels need nothing of the sinks
    remainder: bool = False  # tiles: merge in the gathered remainder's output and log-sum-exp (or gradients)
    group: int = 1  # tiles: query heads per key / value head, packed into the tile's rows
    features: bool = False  # gather kernels: edge features inside (see FEATURES below)

    @property
    def every_option(self) -> bool:
        """Whether every option this kernel has is on (its heaviest code)."""
        if self.kernel == "keep_kernel":
            return True
        if self.kernel == "tile_delta_kernel":
            return True
        if self.kernel in TILE_KERNELS:  # the grouped ones differ in index arithmetic only
            return self.softcap and self.group == 1 and (self.remainder or self.kernel == "tile_dkdv_kernel")
        return (self.bias == "per-head" and self.dropout and self.weights and (self.softcap or self.features)
                and (self.bias_grad or self.kernel != "dq_kernel") and (self.sinks or self.kernel != "forward_kernel"))

    @property
    def options(self) -> str:
        names = [f"bias {self.bias}"] if self.bias != "none" else []
        names += ["dropout"] * self.dropout
        names += (["weights"] if self.kernel == "forward_kernel" else ["weights' grad"]) * self.weights
        names += ["bias grad"] * self.bias_grad
        names += ["softcap"] * self.softcap + ["sinks"] * self.sinks
        names += ["remainder"] * self.remainder + [f"group {self.group}"] * (self.group > 1)
        names += ["edge features"] * self.features
        return ", ".join(names) or "-"

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).replace("torch.", "")


def configurations() -> Iterator[Config]:
    """Every configuration the backend launches: each kernel, dtype, head dim and option set.

    Soft-capping and sinks (Gemma 2, gpt-oss) are compiled with each bias in the calls of those
    models (no dropout, no returned weights) and once with every other option on (the heaviest
    code), not in every product of options: that would be 1,793 configurations, 2.5x the compile.
    Edge features (:mod:`.edge_features`) likewise: plain and with every other option (no softcap), per
    kernel, dtype and head dim (:func:`_feature_configurations`).

    The tile kernels of ``tc`` (``TILE_DTYPES``: float16, bfloat16) come with and without a softcap
    and a gathered remainder's merge (forward, dq), and grouped (``GROUPED`` query heads per key /
    value head) with a softcap and the merge (dq also without); the backward's ``delta`` kernel once
    per dtype and head dim. Their launch options
    are the target's (:func:`launch_of`).

    Example:
        >>> configs = list(configurations())
        >>> len(configs), sum(c.every_option for c in configs)
        (1209, 129)
    """
    for dtype, d in itertools.product(DTYPES, HEAD_DIMS):
        for bias, dropout, weights in itertools.product(BIASES, (False, True), (False, True)):
            yield Config("forward_kernel", dtype, d, bias, dropout, weights)
            for bias_grad in (False, True) if bias != "none" else (False,):
                yield Config("dq_kernel", dtype, d, bias, dropout, weights, bias_grad)
            yield Config("dkdv_kernel", dtype, d, bias, dropout, weights)
        for bias in BIASES:
            for softcap, sinks in ((True, False), (False, True), (True, True)):
                yield Config("forward_kernel", dtype, d, bias, softcap=softcap, sinks=sinks)
            yield Config("dq_kernel", dtype, d, bias, softcap=True)
            yield Config("dkdv_kernel", dtype, d, bias, softcap=True)
        every = dict(bias="per-head", dropout=True, weights=True, softcap=True)
        yield Config("forward_kernel", dtype, d, **every, sinks=True)
        yield Config("dq_kernel", dtype, d, **every, bias_grad=True)
        yield Config("dkdv_kernel", dtype, d, **every)
        yield from _feature_configurations(dtype, d)
    for dtype, d in itertools.product(TILE_DTYPES, HEAD_DIMS):
        for kernel in TILE_KERNELS[:3]:
            merges = (False, True) if kernel != "tile_dkdv_kernel" else (False,)  # dk-dv: the caller adds the remainder
            for softcap, remainder in itertools.product((False, True), merges):
                yield Config(kernel, dtype, d, softcap=softcap, remainder=remainder)
            for remainder in {"tile_forward_kernel": (True,), "tile_dq_kernel": (True, False)}.get(kernel, (False,)):
                yield Config(kernel, dtype, d, softcap=True, remainder=remainder, group=GROUPED)
        yield Config("tile_delta_kernel", dtype, d)
    yield Config("keep_kernel", torch.int8, 0)


def blocks_of(config: Config) -> Tuple[int, int]:
    """The blocks the backend launches ``config`` with: ``(BLOCK_M, BLOCK_N)`` of the gather kernels,
    ``(tile rows, keys)`` of the tiles; ``(0, 0)`` for the dropout mask's kernel."""
    if config.kernel == "tile_delta_kernel":
        return 0, 0
    if config.kernel in TILE_KERNELS:
        return choose_blocks(config.dtype, config.head_dim)
    if not config.head_dim:
        return 0, 0
    if config.features:  # F = d features beside the keys' and values' d (edge_features.triton_edge_features)
        return blocks_for(2 * config.head_dim, 2 * config.head_dim, config.dtype)
    return blocks_for(config.head_dim, config.head_dim, config.dtype, config.softcap)


@functools.lru_cache(maxsize=1)
def _structure():
    """A small window set (each query sees itself and 3 keys either side)."""
    i = torch.arange(ROWS)
    keys = (i[:, None] + torch.arange(-3, 4)).clamp(0, ROWS - 1).unique(dim=1)
    edge_index = torch.stack([keys.flatten(), i.repeat_interleave(keys.shape[1])])
    return analyse(edge_index, ROWS, ROWS)


def _pattern():
    """The CSR walks of :func:`_structure`."""
    return walks(_structure())


def _tile_launch(config: Config, arch: int, blocks: Optional[Tuple[int, int]] = None):
    """The tile kernels' launch for ``config`` on compute capability ``arch``: the plan of
    :func:`_structure` at ``blocks`` (tile rows, keys; default: the backend's)."""
    tk, s, d = tile_kernels_module(), _structure(), config.head_dim
    block_m, block_n = blocks or choose_blocks(config.dtype, d)
    plan = plan_tiles(s.rowptr, s.src, ROWS, ROWS, block_m=block_m // config.group, block_n=block_n, min_fill=0)
    q = torch.zeros(ROWS, HEADS, d, dtype=config.dtype)
    k, v = (torch.zeros(ROWS, HEADS // config.group, d, dtype=config.dtype) for _ in range(2))
    lse, delta = torch.zeros(HEADS, ROWS), torch.zeros(HEADS, ROWS)
    softcap = 2.0 if config.softcap else None
    if config.kernel == "tile_delta_kernel":
        return tk.delta_launch(q, torch.zeros_like(q))[0]
    if config.kernel == "tile_forward_kernel":
        init = (torch.zeros_like(q), lse) if config.remainder else None
        return tk.forward_launch(q, k, v, plan, 0.125, softcap, init, arch)[0]
    init = torch.zeros_like(q) if config.remainder else None  # the remainder's dq
    launches, _ = tk.backward_launches(q, k, v, torch.zeros_like(q), lse, delta, plan, 0.125, softcap, init, arch)
    return launches[0] if config.kernel == "tile_dq_kernel" else launches[1]


def candidate_launch(candidate: Candidate, target: Target):
    """The launch of one of the sweep's candidates (:func:`~.tile_config.candidates`) on ``target``:
    its kernel at its tile shape and options, with the heaviest code the backend launches there (a
    softcap, and the gathered remainder's merge in the forward and dq)."""
    kernel = f"tile_{candidate.kernel}_kernel"
    config = Config(kernel, getattr(torch, candidate.dtype), candidate.head_dim, softcap=True,
                    remainder=kernel != "tile_dkdv_kernel")
    launch = _tile_launch(config, target.arch, (candidate.block_m, candidate.block_n))
    return launch._replace(meta={**launch.meta, "num_warps": candidate.num_warps, "num_stages": candidate.num_stages})


def launch_of(config: Config, target: Optional[Target] = None):
    """The :class:`~.kernels.Launch` the backend makes for ``config`` (CPU tensors of a small call) on
    ``target`` (the tile kernels' launch options are per target; default sm_90)."""
    if config.kernel in TILE_KERNELS:
        return _tile_launch(config, 90 if target is None else target.arch)
    kern = kernels_module()
    rows, cols = _pattern()
    edges, seed, p = rows[1].numel(), 12345, 0.1 if config.dropout else 0.0
    if config.kernel == "keep_kernel":
        return kern.keep_launch(edges, HEADS, 0.1, seed, "cpu")[0]
    d = config.head_dim
    q, k, v = (torch.zeros(ROWS, HEADS, d, dtype=config.dtype) for _ in range(3))
    bias = None if config.bias == "none" else torch.zeros(edges, 1 if config.bias == "shared" else HEADS, dtype=config.dtype)
    blocks = blocks_of(config)
    softcap = 2.0 if config.softcap else None
    edge = _edge_features(config, edges)
    if config.kernel == "forward_kernel":
        sinks = torch.zeros(HEADS, dtype=torch.float64 if config.dtype == torch.float64 else torch.float32) \
            if config.sinks else None
        return kern.forward_launch(q, k, v, bias, *rows, 0.125, p, seed, config.weights, blocks, softcap, sinks,
                                   edge)[0]
    acc = torch.float64 if config.dtype == torch.float64 else torch.float32
    lse, delta = torch.zeros(HEADS, ROWS, dtype=acc), torch.zeros(HEADS, ROWS, dtype=acc)
    grad_w = torch.zeros(edges, HEADS, dtype=config.dtype) if config.weights else None
    launches, _ = kern.backward_launches(
        q, k, v, bias, torch.zeros_like(q), lse, delta, grad_w, rows, cols, 0.125, p, seed, config.bias_grad, blocks,
        softcap, edge,
    )
    return launches[0] if config.kernel == "dq_kernel" else launches[1]


# --- Edge features inside the gather kernels (tgattn.engine.triton.edge_features) -----------------------------
# Compiled at F = d features a head dim: the most the blocks of head dim d take (blocks_for of max(d, F)); a call
# with fewer features runs a narrower BLOCK_F at the same blocks. The permuted read (a new, unsorted edge_index)
# and both terms (TransformerConv's one pair for keys and values), plain and with every other option (no softcap:
# graph_attention refuses it with a key term).


def _feature_configurations(dtype: torch.dtype, d: int) -> Iterator[Config]:
    every = dict(bias="per-head", dropout=True, weights=True, features=True)
    for kernel in ("forward_kernel", "dq_kernel", "dkdv_kernel"):
        yield Config(kernel, dtype, d, features=True)
        yield Config(kernel, dtype, d, **every, bias_grad=kernel == "dq_kernel", sinks=kernel == "forward_kernel")


def _edge_features(config: Config, edges: int):
    """The :class:`~.kernels.EdgeFeatures` of ``config`` (``F = d``, permuted, both terms), or None."""
    if not config.features:
        return None
    d = config.head_dim
    per_query = torch.zeros(ROWS, HEADS, d, dtype=config.dtype)
    return kernels_module().EdgeFeatures(torch.zeros(edges, d, dtype=config.dtype), torch.arange(edges), per_query,
                                         True, per_query if config.kernel != "forward_kernel" else None)


@dataclass(frozen=True)
class Resources:
    """What ``ptxas`` reports for one compiled kernel, and what follows for one target."""

    num_warps: int
    registers: int  # per thread
    spill_stores: int  # bytes
    spill_loads: int
    stack: int  # bytes of stack frame per thread
    shared: int  # bytes per block (Triton's dynamic shared memory + static)

    def resident_warps(self, target: Target) -> int:
        """Warps one SM holds at once (the CUDA occupancy calculator's rule)."""
        per_warp = -(-self.registers * 32 // REG_UNIT) * REG_UNIT
        by_regs = target.regs_per_sm // per_warp // self.num_warps
        by_smem = target.smem_per_sm // (self.shared + RESERVED_SMEM)
        blocks = min(by_regs, by_smem, target.max_warps // self.num_warps, target.max_blocks)
        return blocks * self.num_warps


_PTXAS = {
    "registers": r"Used (\d+) registers",
    "stack": r"(\d+) bytes stack frame",
    "spill_stores": r"(\d+) bytes spill stores",
    "spill_loads": r"(\d+) bytes spill loads",
}


def bind(launch, target: Target):
    """``(options, signature, constexprs, attrs)``: what Triton's JIT makes of ``launch``'s arguments for
    ``target`` (its binder: integers equal to 1 become constants, pointers and integers divisible by
    16 carry that hint), the inputs of its compile and of its cache key."""
    import triton
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    kernel = launch.kernel
    if not isinstance(kernel, triton.runtime.jit.JITFunction):
        raise RuntimeError("Triton's interpreter is on (TRITON_INTERPRET=1): compiling needs a process without it")
    backend = make_backend(target.triton_target())
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.meta)
    return kernel._pack_args(backend, launch.meta, bound, specialization, options)


def compile_launch(launch, target: Target, cache_dir: Optional[str] = None) -> Tuple[Resources, dict]:
    """Compile ``launch`` for ``target``: ``(resources, asm)`` (``asm``: ``ptx``, ``cubin``, ...).

    The arguments go through the binder Triton's JIT builds for the kernel (:func:`bind`), as at a
    launch, so the compiled kernel lands in ``cache_dir`` under the key the launch looks up.
    Raises what Triton raises on a compile error.
    """
    import triton
    from triton import knobs
    from triton.compiler import ASTSource

    kernel = launch.kernel
    options, signature, constexprs, attrs = bind(launch, target)
    log = io.StringIO()
    # The log of ptxas -v is printed only on a real compile: compile always, into ``cache_dir``.
    with knobs.compilation.scope(), knobs.nvidia.scope(), knobs.cache.scope(), contextlib.redirect_stdout(log):
        knobs.compilation.always_compile = True
        knobs.nvidia.dump_ptxas_log = True
        if cache_dir is not None:
            knobs.cache.dir = cache_dir
        compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target.triton_target(),
                                  options=options.__dict__)
    text = log.getvalue()
    found = {key: int(m.group(1)) if (m := re.search(rx, text)) else 0 for key, rx in _PTXAS.items()}
    static = re.search(r"(\d+) bytes smem", text)
    shared = compiled.metadata.shared + (int(static.group(1)) if static else 0)
    return Resources(compiled.metadata.num_warps, shared=shared, **found), compiled.asm
