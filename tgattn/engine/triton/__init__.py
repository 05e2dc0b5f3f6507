"""The ``triton`` backend: exact graph attention on the GPU with kernels of tgattn's own.

Triton kernels (:mod:`.kernels`, imported on first use) walk the CSR rows of the analysed edge
set: a forward pass with online softmax that saves each row's log-sum-exp, and a
FlashAttention-2 style backward (``dq`` over query rows, ``dk`` / ``dv`` over key rows of the
transposed pattern). They take float16, bfloat16, float32 and float64, an edge bias
(``-inf`` removes an edge), dropout (a counter-based mask regenerated in backward), returned
weights and duplicated edges; a row without edges outputs 0. Edge features given as
``(features, weight)`` key and value terms run inside them (:mod:`.edge_features`).

The engine picks this backend for CUDA tensors. With ``TRITON_INTERPRET=1`` in the
environment, ``backend="triton"`` also runs on CPU tensors through Triton's interpreter
(slowly: that is how the tests check the kernels without a GPU).

The ``tc`` backend (:mod:`.tc`) runs the tiles of an edge set that a cost model
(:mod:`.tile_cost`) finds cheaper as dense products on tensor cores (:mod:`.tile_plan`,
:mod:`.tile_kernels`) and the scattered rest on the same gather kernels, in one exact softmax. :mod:`.aot` compiles every
kernel configuration the backend launches for sm_80 / sm_90 without a GPU and reads what each
costs there (registers, spills, shared memory): ``python -m tgattn.bench.gpu_compiled``.
"""
from .attention import available, dropout_keep, draw_seed, triton_attention, usable
from .tc import tc_attention, tiles_pay

__all__ = ["available", "dropout_keep", "draw_seed", "tc_attention", "tiles_pay", "triton_attention", "usable"]
