"""What a call makes the host wait for, and how much it dispatches, recorded without a GPU.

The engine reads values back only from host tensors (:func:`tgattn.engine.analysis.on_host`).
:func:`cpu_as_cuda` tells it that the CPU is a device (``HOST_DEVICES`` empty) and lets ``auto``
pick the Triton kernels for CPU tensors (Triton's interpreter stands in for the GPU), and turns
the fused extension's CPU-only ops off (a GPU runs their torch fallbacks); then
:func:`recording` records, under a ``TorchDispatchMode``, every aten op that makes the host wait
for a CUDA device: reading a value (``_local_scalar_dense``, ``is_nonzero``, ``equal``), ops
whose output size depends on values (``nonzero``, ``unique``, boolean indexing, ``bincount``
...), tensors made from Python data (``lift_fresh``: a blocking host-to-device copy on CUDA),
and ``Tensor.tolist`` / ``numpy``. It also counts the kernels a call would launch on a GPU: the
aten ops that are not views (``kernels``) and the Triton launches (``launches``). What the
interpreter itself does while it runs a kernel is the GPU's work and is not counted.
"""
import sys
from contextlib import contextmanager

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from tgattn import engine
from tgattn.engine import analysis, native

aten = torch.ops.aten
SYNCING = {
    aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default, aten.item.default,
    aten.nonzero.default, aten._unique2.default, aten.unique_consecutive.default, aten.unique_dim.default,
    aten.masked_select.default, aten.repeat_interleave.Tensor, aten.bincount.default, aten.lift_fresh.default,
}
BOOL_INDEXED = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default}
# Allocations launch nothing (an ``empty`` is a pointer from the caching allocator).
NOT_LAUNCHED = {aten.empty.memory_format, aten.empty_strided.default, aten.new_empty.default,
                aten.new_empty_strided.default, aten.empty_like.default}


def _in_kernel() -> bool:
    """Whether the interpreter is running a kernel (its work is the GPU's)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith("triton."):
            return True
        frame = frame.f_back
    return False


class SyncRecorder(TorchDispatchMode):
    """Names of the host-syncing ops run inside ``with recorder:`` (outside Triton kernels), and the
    number of aten ops that would launch a kernel on a GPU (``kernels``)."""

    def __init__(self):
        super().__init__()
        self.syncs = []
        self.kernels = 0
        self.launches = 0

    def note(self, name):
        if not _in_kernel():
            self.syncs.append(name)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in SYNCING:
            if not (func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is not None):
                self.note(str(func))  # (given its output's size, repeat_interleave reads nothing back)
        elif func in BOOL_INDEXED:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices):
                self.note(f"{func} with a boolean mask")
        if not (func.is_view or func in NOT_LAUNCHED or _in_kernel()):
            self.kernels += 1
        return func(*args, **kwargs)


@contextmanager
def recording():
    """A :class:`SyncRecorder` that also sees ``Tensor.tolist`` and ``Tensor.numpy``, and counts the
    Triton launches (:class:`tgattn.engine.triton.kernels.Launch`, the tiles' included)."""
    recorder = SyncRecorder()
    patched = {(torch.Tensor, name): getattr(torch.Tensor, name) for name in ("tolist", "numpy")}
    for launch in _launch_classes():
        patched[(launch, "__call__")] = launch.__call__

    def spy(name, original):
        def call(self, *args, **kwargs):
            if name == "__call__":
                recorder.launches += 1
            else:
                recorder.note(f"Tensor.{name}")
            return original(self, *args, **kwargs)

        return call

    try:
        for (owner, name), original in patched.items():
            setattr(owner, name, spy(name, original))
        with recorder:
            yield recorder
    finally:
        for (owner, name), original in patched.items():
            setattr(owner, name, original)


def _launch_classes():
    try:
        from tgattn.engine.triton import attention, tile_kernels
    except ImportError:  # no triton
        return set()
    return {attention.kernels_module().Launch, tile_kernels.Launch}


def _unrecorded(fn):
    with _disable_current_modes():
        return fn()


@pytest.fixture
def cpu_as_cuda(monkeypatch):
    """The engine treats CPU tensors as device tensors and ``auto`` picks Triton for them."""
    pytest.importorskip("triton")
    from tgattn.engine import triton as backend
    from tgattn.engine.triton import attention

    if torch.cuda.is_available() or not attention.interpreter_ready():
        pytest.skip("runs the CUDA route on CPU tensors through Triton's interpreter (TRITON_INTERPRET=1, no GPU)")
    monkeypatch.delenv("TGATTN_NO_TRITON", raising=False)
    monkeypatch.setattr(analysis, "HOST_DEVICES", frozenset())
    monkeypatch.setattr(backend, "usable", lambda q, named=False: True)
    # Nor does it take the fused extension's CPU ops (the per-head maps, the transpose's counting sort):
    # a GPU has none of them, and counting them would count one op where a GPU launches several.
    monkeypatch.setattr(native, "available", lambda: False)
    # The dropout seed is drawn from torch's CPU generator: a host read, no device sync on CUDA.
    draw = attention.draw_seed
    monkeypatch.setattr(attention, "draw_seed", lambda: _unrecorded(draw))
    engine.CACHE.clear()
    yield
    engine.CACHE.clear()
