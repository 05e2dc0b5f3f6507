"""The fused kernel's float16 / bfloat16 part is a library of its own, built when a float16 / bfloat16 call
first needs it: a float32 user's first build leaves out the half of its compile time those kernels were.

Each test runs in a fresh process (the library, once loaded, stays for the process). The outputs are
compared with the float64 dense attention on the same rounded inputs (tests/engine_helpers.py), at the
half-precision tolerances of tests/test_engine_half.py.
"""
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO
from tgattn.engine import fused

pytestmark = pytest.mark.skipif(
    not fused.available() and not os.environ.get("CI"), reason="no C++ toolchain here (CI requires one)"
)


def run(code: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=1800)  # the half library's first build: minutes on a busy machine
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_float32_calls_never_load_the_half_library_and_a_half_call_loads_it_once():
    out = run("""
        import torch
        from engine_helpers import inputs, max_err, oracle
        from tgattn import builders
        from tgattn.engine import build, fused, native
        from tgattn.engine.analysis import analyse

        ei = builders.window(40, 3)
        q, k, v, _ = inputs(40, 40, heads=2, dk=8, dtype=torch.float32)
        s = analyse(ei, 40, 40)
        out, _ = fused.fused_attention(q, k, v, s, None, 8 ** -0.5)
        out.sum().backward()
        loaded = lambda: any("tgattn_fused_half" in p for p in torch.ops.loaded_libraries)
        print("float32", native._state["half"], loaded(), max_err(out, oracle(q.double(), k.double(), v.double(), ei)) < 1e-5)

        q16, k16, v16 = (t.detach().half() for t in (q, k, v))
        try:  # the main library's own float16 entry, before the half library is there
            torch.ops.tgattn_fused.forward(q16, k16, v16, s.rowptr, s.src, None, 8 ** -0.5, 0.0, 0, False, 0.0, None, None,
                                           None, False, None)
        except RuntimeError as err:
            print("direct", str(err).splitlines()[0])
        q16.requires_grad_()
        out16, _ = fused.fused_attention(q16, k16, v16, s, None, 8 ** -0.5)
        out16.float().sum().backward()
        ref = oracle(q16.detach().double(), k16.double(), v16.double(), ei)
        print("float16", native._state["half"], loaded(), out16.dtype, max_err(out16.double(), ref) < 2e-3,
              q16.grad.dtype, bool(torch.isfinite(q16.grad).all()))
        print("library", build.FUSED_HALF.library().is_file(), build.FUSED.library().is_file())
        """).splitlines()
    assert out[0] == "float32 None False True"  # float32 (forward and backward): the half library untouched
    assert out[1] == ("direct tgattn fused: the Half kernels are not loaded (tgattn.engine.native.half_available() "
                      "builds and loads them)")
    assert out[2] == "float16 True True torch.float16 True torch.float16 True"
    assert out[3] == "library True True"


def test_a_half_call_runs_on_csr_where_the_half_library_did_not_build(monkeypatch):
    """A failed build of the half library falls back as a failed build of the main one does: same
    results on the CSR backend, not an error (the oracle: float64 dense attention on the same inputs)."""
    import torch

    from engine_helpers import inputs, max_err, oracle
    from tgattn import builders
    from tgattn.engine import native
    from tgattn.functional import graph_attention

    monkeypatch.setitem(native._state, "half", False)  # as after a build that failed
    ei = builders.window(40, 3)
    q, k, v, _ = inputs(40, 40, heads=2, dk=8, dtype=torch.float32)
    q16, k16, v16 = (t.detach().to(torch.bfloat16).requires_grad_() for t in (q, k, v))
    out = graph_attention(q16, k16, v16, ei)
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16 and torch.isfinite(q16.grad).all()
    assert max_err(out.double(), oracle(q16.detach().double(), k16.detach().double(), v16.detach().double(), ei)) < 2e-2
