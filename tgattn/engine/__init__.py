"""The attention engine behind :func:`tgattn.functional.graph_attention`.

Backends (all exact, none holds an ``[E, H, d]`` tensor in forward or backward):

* ``dense``: SDPA, for edge sets proven full / causal (also packed block-diagonal);
* ``tile``: row-blocked dense tiles with ``-inf`` masking, for banded / block-structured sets;
* ``fused``: a C++ kernel compiled on first use that walks each query's edges once per
  pass (scores + softmax, aggregation, and the backward's gradient products), for scattered
  sets when the call has no dropout;
* ``csr``: per-head sparse kernels (sampled dot products, segment softmax, CSR x dense),
  for scattered sets and for every option (dropout, returned weights, duplicated edges).
* ``triton``: Triton kernels over the CSR rows (online softmax forward, FlashAttention-2
  style backward), for CUDA tensors; every option (:mod:`tgattn.engine.triton`).

Edge sets are validated and analysed once: prepared (:func:`tgattn.prepare`, an
:class:`~tgattn.EdgeSet`, :mod:`tgattn.engine.edgeset`), or a plain ``edge_index`` on the fly,
cached per tensor (:func:`structure_of`, :func:`edge_set_of`); :func:`plan` names the
backend ``auto`` picks. The fused kernels keep freed output buffers for the next call
(:func:`cache_info`, :func:`empty_cache`).

The lowest layer of the package: it imports nothing of tgattn above it. The custom op that
``torch.compile`` traces (:mod:`tgattn.engine.custom_op`) and the eager call
(:mod:`tgattn.engine.eager`) share the checks of :func:`tgattn.functional.graph_attention`.
"""
from .analysis import CACHE, Structure, analyse
from .edgeset import edge_set_of, structure_of
from .dispatch import ENGINE_BACKENDS, plan, run
from .fused import cache_info, empty_cache

__all__ = ["CACHE", "ENGINE_BACKENDS", "Structure", "analyse", "cache_info", "edge_set_of", "empty_cache", "plan", "run",
           "structure_of"]
