"""Attention over an edge set, as a function of per-node queries, keys and values.

Edge convention (the same everywhere in tgattn): ``edge_index[0]`` = source = key/value
node j, ``edge_index[1]`` = target = query node i. The dense twin of an edge set is
``mask[i, j] = True`` (rows = queries i, columns = keys j).

Layer "functional": above the engine, below the builders and the layers (docs/conventions.md).
"""
from __future__ import annotations

import math
from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from . import engine
from ._cli import BACKENDS  # noqa: F401  (public here; kept there so that command lines list it without torch)
from .engine import edge_terms
from .engine.edge_terms import EdgeTerm
from .engine.eager import check_bias, check_edge_tensor, check_qkv, check_sinks, check_softcap, eager_graph_attention
from .engine.dispatch import all_finite  # noqa: F401  (public: the conv's one-edge-row shortcut checks its inputs)
from .engine.analysis import on_host  # noqa: F401  (the conv splits its rows on the host only)
from .engine.edgeset import EdgeSet
from .engine.gate import beta_mix  # noqa: F401  (public: GraphAttentionConv's beta gate)
from .engine.softmax import edge_softmax  # noqa: F401  (public: the layer's message path uses it)
from .engine.touched import on_touched_keys
from .engine.validate import check_device
from .engine.validate import check_edge_index, check_ranges  # noqa: F401  (check_edge_index: public, builders use it)



def graph_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    edge_index: Union[Tensor, EdgeSet],
    *,
    bias: Optional[Tensor] = None,
    scale: Optional[float] = None,
    dropout_p: float = 0.0,
    return_weights: bool = False,
    backend: str = "auto",
    edge_scale: Optional[Tensor] = None,
    edge_key: Optional[EdgeTerm] = None,
    edge_value: Optional[EdgeTerm] = None,
    softcap: Optional[float] = None,
    sinks: Optional[Tensor] = None,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    r"""Scaled-dot-product attention restricted to an edge set.

    For query i with in-neighbourhood :math:`N(i) = \{j : (j, i) \in E\}` and each head:

    .. math::
        s_{ij} = \text{scale}\,\langle q_i, k_j + k^e_{ij}\rangle + b_{ij}, \quad
        a_{ij} = \operatorname{softmax}_{j \in N(i)}(s_{ij}), \quad
        o_i = \sum_{j \in N(i)} a_{ij} (v_j + v^e_{ij})

    (:math:`k^e`, :math:`v^e`: the optional per-edge terms ``edge_key`` / ``edge_value``, 0 without them.)
    With ``softcap = c`` the scaled dot product is capped before the bias is added (Gemma 2),
    :math:`s_{ij} = c \tanh(\text{scale}\,\langle q_i, k_j\rangle / c) + b_{ij}`; with ``sinks = t``
    each head's softmax has one more logit :math:`t_h` without a value (gpt-oss's ``s_aux``),
    :math:`a_{ij} = e^{s_{ij}} / (e^{t_h} + \sum_{l \in N(i)} e^{s_{il}})`.

    Equal to :func:`tgattn.reference.dense_attention` with ``mask = builders.to_mask(edge_index)``.

    * A query without incoming edges (or whose edges all have bias ``-inf``) outputs 0.
    * Edges may come in any order. A duplicated edge counts once per copy: m copies of
      ``(j, i)`` weigh like one edge with ``log(m)`` added to its score (PyG's convention).
    * NaN in ``q``, ``k``, ``v`` or ``bias`` propagates to the outputs of the queries it
      touches (and, in backward, to the keys and values of their edges only), with two
      exceptions (docs/engine.md): on ``"tc"`` a NaN key or value in a partial tile reaches
      that tile's other queries (``0 * nan`` in ``P V``); on a GPU, where no check runs (it
      would make the host wait for the device), SDPA, which ``"auto"`` takes for full, causal
      and packed sets, may spread it to every query of its head. (On the CPU, inputs holding
      NaN or inf leave the dense, tile and fused backends for ``"csr"``.) A NaN sink is in
      every softmax of its head and makes all of that head's outputs and weights NaN; ``-inf`` in
      ``bias`` removes an edge; ``+inf`` in ``bias`` is an error (on a GPU, where the check
      would make the host wait for the device, it makes its query's output NaN). A ``+inf``
      score from the inputs (an infinite key or ``edge_key`` feature) is NaN, the softmax's
      answer, in its query's output of that head.
    * float16 / bfloat16 inputs are computed in float32 and returned in their own dtype;
      autocast is off inside. Works under ``torch.no_grad``, ``torch.inference_mode`` and
      ``torch.compile`` (as one custom op, ``torch.ops.tgattn.graph_attention``).
    * float32 gradients whose terms cancel (keys sharing a large common part, duplicated
      edges, returned weights) stay within a few ``eps32`` of the sum of the terms'
      magnitudes on every backend (the fused backward recomputes each weight with the
      forward's roundings); what remains is the float32 rounding of the scores themselves,
      about ``eps32 * |s|`` on each weight (1e-3 at scores near 1e4).
    * Double backward (``create_graph=True``) is exact on every backend: the gradients are
      recomputed on the textbook edge-wise path.
    * ``edge_index`` may be prepared once (:func:`tgattn.prepare`, an :class:`~tgattn.EdgeSet`):
      then the call neither checks nor analyses it, and on a GPU reads nothing back from it. A
      plain tensor is validated and analysed on its first call and the analysis cached per
      tensor, checked against its contents on every call, so an edge set modified in place is
      never served a stale result (on a GPU against its version counter instead, which sees
      every in-place write made through PyTorch: :func:`tgattn.engine.analysis.device_stamp`).

    * Grouped-query attention: ``k`` and ``v`` may have ``Hkv`` heads, ``H`` a multiple of ``Hkv``;
      query head ``h`` then attends with key / value head ``h // (H / Hkv)``, the convention of
      ``scaled_dot_product_attention(..., enable_gqa=True)``, and the gradients of ``k`` and ``v``
      sum over each head's group. ``backend="tc"`` (and ``"auto"`` where it runs ``tc``) reads the
      grouped heads in place, several query heads on each tile; every other backend runs on ``k`` and
      ``v`` repeated to ``H`` heads. Per-head options (``bias``, ``edge_scale``, ``sinks``, the
      returned weights, edge terms) stay per query head.

    Args:
        q: queries ``[Nq, H, dk]``.
        k: keys ``[Nk, H, dk]``, or ``[Nk, Hkv, dk]`` with ``H`` a multiple of ``Hkv`` (grouped heads).
        v: values ``[Nk, H or Hkv, dv]``, as many heads as ``k``.
        edge_index: ``LongTensor[2, E]``; row 0 = key j, row 1 = query i; or an
            :class:`~tgattn.EdgeSet` prepared for ``Nq`` queries and ``Nk`` keys.
        bias: additive edge scores ``[E]`` (shared by heads) or ``[E, H]``, of ``q``'s dtype
            or float32 (the rule of :func:`~torch.nn.functional.scaled_dot_product_attention`
            for a float ``attn_mask``; another dtype is a ``ValueError``). It is added in the
            dtype the scores are computed in, and its gradient comes back in its own dtype.
        scale: score scale (default: ``1 / sqrt(dk)``); must be finite.
        dropout_p: dropout probability on the attention weights (apply only in training).
        return_weights: also return the weights ``[E, H]`` (before dropout), in the order
            of ``edge_index``.
        backend: ``"auto"`` (default) lets :mod:`tgattn.engine` pick from a cached analysis
            of ``edge_index``; ``"dense"`` (SDPA on provably full / causal sets), ``"tile"``
            (row-blocked dense tiles), ``"fused"`` (a compiled C++ kernel over CSR rows) and
            ``"csr"`` (PyTorch sparse kernels) name an engine backend, which falls back along
            dense -> tile -> fused -> csr when it cannot honour the call
            (see :func:`tgattn.engine.plan`); ``"triton"`` (Triton kernels, CUDA) falls back
            like ``"fused"``; ``"tc"`` (Triton kernels with tensor-core tiles, CUDA) falls back to
            ``"triton"`` for calls its tiles do not take; ``"gather"`` is the textbook per-edge path
            (it materializes ``[E, H, d]`` copies; use it as a reference).
        edge_scale: a factor ``[E]`` or ``[E, H]`` on each edge's weight after the softmax
            (``o_i = sum_j m_ij a_ij v_j``), differentiable: what PyG's explainers apply as
            their edge mask; of ``q``'s dtype or float32, as ``bias`` (default: None).
        edge_key: a per-edge key term :math:`k^e_{ij}` (``TransformerConv``'s edge features in
            the keys): the vectors ``[E, H, dk]``, or ``(features [E, F], weight [H * dk, F])``
            for :math:`k^e_{ij} = W^h e_{ij}` (``lin_edge.weight``), in the order of
            ``edge_index`` (default: None).
        edge_value: a per-edge value term :math:`v^e_{ij}`, ``[E, H, dv]`` or
            ``(features [E, F], weight [H * dv, F])`` (default: None).
        softcap: logit soft-capping ``c``, a positive finite number: ``c * tanh(s / c)`` on the
            scaled scores, before the bias (default: None). Not combined with ``edge_key``. It must
            be a normal number of the dtype the scores are computed in (float32 for float16 /
            bfloat16 inputs): a cap that would round to 0 or overflow there is a ``ValueError``.
        sinks: one learned logit per head ``[H]`` in every softmax's denominator (attention
            sinks), of ``q``'s dtype or float32, differentiable (default: None). The returned
            weights are the edges' shares of that denominator: a query's weights sum to one
            minus its sink's share, and a query without edges has no weights and outputs 0.

    softcap / sinks run on Triton's kernels where those run (``"auto"`` or ``"triton"``) and
    on the fused C++ kernel on the CPU otherwise: every other backend name falls back to
    ``"fused"`` for them (``"csr"`` where it is named or the kernel cannot be built; ``"gather"``
    honours them too).

    Edge terms run on every backend, exactly. ``(features, weight)`` pairs over one features tensor
    (``TransformerConv``'s ``(edge_attr, lin_edge.weight)`` for both) run inside the fused C++ kernel
    on the CPU, from every backend name but ``"csr"`` and ``"gather"``, without an ``edge_scale``
    and outside ``torch.compile`` (dropout with the kernel's own mask, on both value terms alike).
    Otherwise they are composed around the backend: the key term is added to the score bias as
    ``scale * <q_i, ek_ij>``, the value term is ``sum_j a_ij ev_ij`` over the weights the backend
    returns (with an ``edge_scale`` and dropout applied to both terms alike: the dropout mask
    is drawn once and handed to the backend as an edge scale, so the call runs on ``csr``).
    Memory: vectors handed in are ``[E, H, d]`` by definition; a ``(features, weight)`` pair
    with fewer features than head channels (F < d) is applied in its factored form
    (:math:`\langle W^{h\top} q_i, e_{ij}\rangle`, :math:`W^h \sum_j a_{ij} e_{ij}`), which holds
    ``[E, H, F]`` and nothing of size ``[E, H, d]``.

    Returns:
        ``out [Nq, H, dv]``, or ``(out, weights [E, H])`` with ``return_weights=True``.

    Example:
        >>> from tgattn import builders
        >>> q = k = v = torch.randn(5, 2, 4)
        >>> out = graph_attention(q, k, v, builders.causal(5))
        >>> out.shape
        torch.Size([5, 2, 4])
        >>> e, w = torch.randn(15, 3), torch.randn(2 * 4, 3)  # 3 edge features, H * d = 8
        >>> with_edges = graph_attention(q, k, v, builders.causal(5), edge_key=(e, w), edge_value=(e, w))
        >>> ek = (e @ w.T).view(15, 2, 4)  # the same terms as vectors [E, H, d]
        >>> torch.allclose(with_edges, graph_attention(q, k, v, builders.causal(5), edge_key=ek, edge_value=ek))
        True
        >>> kv = torch.randn(5, 1, 4)  # grouped-query heads: both query heads read the one key/value head
        >>> grouped = graph_attention(q, kv, kv, builders.causal(5))
        >>> torch.allclose(grouped, graph_attention(q, kv.expand(5, 2, 4), kv.expand(5, 2, 4), builders.causal(5)))
        True
    """
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1) (got {dropout_p})")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} (got {backend!r})")
    if scale is not None and not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number (got {scale})")
    if softcap is not None:
        check_softcap(softcap)
        if edge_key is not None:  # its term enters the scores as a bias, after the cap, not inside it
            raise ValueError("softcap cannot be combined with edge_key (the cap would not see the key term)")
    mods = dict(softcap=softcap, sinks=sinks)
    if edge_key is not None or edge_value is not None:
        out, weights = attention_with_edge_terms(
            q, k, v, edge_index, bias, edge_scale, scale, dropout_p, return_weights, backend, edge_key, edge_value,
            **mods,
        )
    else:
        out, weights = _attention(
            q, k, v, edge_index, bias, edge_scale, scale, dropout_p, return_weights, backend, **mods
        )
    return (out, weights) if return_weights else out


def _attention(
    q, k, v, edge_index, bias, edge_scale, scale, dropout_p, return_weights, backend, generator=None, *,
    softcap=None, sinks=None,
):
    """``(out, weights or None)``: the custom op under ``torch.compile``, else :func:`eager_graph_attention`."""
    if torch.compiler.is_compiling():
        from .engine.custom_op import compiled_graph_attention

        if isinstance(edge_index, EdgeSet):  # the op takes tensors: its edges, found again in the engine's cache
            edge_index = edge_index.edge_index
        return compiled_graph_attention(
            q, k, v, edge_index, bias, edge_scale, scale, dropout_p, return_weights, backend, softcap, sinks
        )
    return eager_graph_attention(
        q, k, v, edge_index, bias, edge_scale, scale, dropout_p, return_weights, backend, generator=generator,
        softcap=softcap, sinks=sinks,
    )


def attention_with_edge_terms(
    q, k, v, edge_index, bias, edge_scale, scale, dropout_p, return_weights, backend, edge_key, edge_value,
    generator=None, *, softcap=None, sinks=None,
):
    """:func:`graph_attention` with ``edge_key`` / ``edge_value`` (see there): ``(out, weights or None)``.

    ``(features, weight)`` pairs over one features tensor run inside the fused kernel where
    :func:`tgattn.engine.dispatch.edge_terms_on_fused` says so, else inside the Triton kernels where
    :func:`tgattn.engine.dispatch.edge_terms_on_triton` does (outside ``torch.compile``); other
    calls compose the terms around the engine. ``generator`` draws the dropout mask (or the fused
    kernel's seed) that both value terms share.
    """
    check_qkv(q, k, v)
    if softcap is not None:
        check_softcap(softcap, q.dtype)
    compiling = torch.compiler.is_compiling()
    prepared = isinstance(edge_index, EdgeSet) and not compiling
    if prepared:
        es, ei = edge_index.check_sizes(q.shape[0], k.shape[0], q.device), edge_index.edge_index
    elif isinstance(edge_index, EdgeSet):  # the op takes tensors (see _attention)
        es, ei = None, edge_index.edge_index
    else:
        # Under torch.compile the op validates the edges; reading them here would break the graph. The node ids
        # are checked where the edges are first read: by structure_of on the kernel's path, else below.
        es, ei = None, edge_index if compiling else check_edge_index(edge_index, k.shape[0], q.shape[0], ranges=False)
    check_device("edge_index", ei, q)
    num_edges, heads = ei.shape[1], q.shape[1]
    work = engine.dispatch.compute_dtype(q.dtype)  # half precision: the terms in float32, as the kernels
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if edge_scale is not None:
        edge_scale = check_edge_tensor("edge_scale", edge_scale, num_edges, q)
    shared = _same_term(edge_key, edge_value) and v.shape[2] == q.shape[2]  # one term for keys and values
    key = None if edge_key is None else edge_terms.read("edge_key", edge_key, num_edges, heads, q.shape[2], q)
    value = None if edge_value is None else edge_terms.read("edge_value", edge_value, num_edges, heads, v.shape[2], q)
    mods = dict(softcap=softcap, sinks=sinks)
    features = None if compiling or backend == "gather" else edge_terms.shared_features(key, value)
    if features is not None:
        if bias is not None:
            bias = check_bias(bias, num_edges, q)
        if sinks is not None:
            sinks = check_sinks(sinks, q)
        s = es.structure if prepared else engine.structure_of(ei, q.shape[0], k.shape[0])
        maps = tuple(t.weight for t in (key, value) if t is not None)
        key_maps = None if key is None else key.weight  # one tensor for both terms when they share it
        value_maps = None if value is None else key_maps if shared else value.weight
        if engine.dispatch.edge_terms_on_fused(
            s, backend, q, k, v, features, maps, bias, edge_scale=edge_scale is not None, softcap=softcap is not None,
            sinks=sinks,
        ):
            s, k, v = on_touched_keys(s, k, v)
            k, v = engine.dispatch.query_heads(k, v, q.shape[1])  # after the gather: memory follows the edges
            if edge_terms._native(q, k, v, features, *maps):  # the maps inside the kernel's node
                return engine.dispatch.run_mapped_edge_terms(
                    q, k, v, s, bias, scale, dropout_p, return_weights, features, key_maps, value_maps,
                    generator=generator, **mods,
                )
            key_blocks = None if key is None else edge_terms.per_head(key, work)
            edge_q = None if key is None else edge_terms.key_features(q.to(work), key_blocks)  # W_h^T q_i [Nq, H, F]
            out, weights, summed = engine.dispatch.run_edge_terms(
                q, k, v, s, bias, scale, dropout_p, return_weights, edge_q, features, value is not None,
                generator=generator, **mods,
            )
            if value is not None:  # + W_h sum_j a_ij e_ij, one map for both terms when they share it
                blocks = key_blocks if shared else edge_terms.per_head(value, work)
                out = edge_terms.project(summed, blocks, out.to(work)).to(q.dtype)
            return out, weights
        if engine.dispatch.edge_terms_on_triton(s, backend, q, edge_scale=edge_scale is not None,
                                                softcap=softcap is not None):
            k, v = engine.dispatch.query_heads(k, v, q.shape[1])
            return engine.dispatch.run_triton_edge_terms(
                q, k, v, s, bias, scale, dropout_p, return_weights, features, key_maps, value_maps, sinks=sinks,
            )
    k, v = engine.dispatch.query_heads(k, v, q.shape[1])  # edge terms never run on tc's tiles
    if not (compiling or prepared) and features is None:  # (structure_of has checked them where features are given)
        check_ranges(ei, k.shape[0], q.shape[0])
    dst = ei[1].long()
    ei = es if prepared else ei  # the engine takes the prepared set as it is
    if key is not None:
        if shared and key.weight is not None and not key.factored():
            key = edge_terms.Term(key.vectors(), None)  # one [E, H, d] for both terms (TransformerConv's W_E e_ij)
        key_bias = edge_terms.key_scores(q.to(work), dst, key, scale)  # [E, H]
        if bias is not None:  # checked before the sum, which would promote its dtype
            bias = check_edge_tensor("bias", bias, num_edges, q) if compiling else check_bias(bias, num_edges, q)
        bias = key_bias if bias is None else key_bias + bias
    if value is None:
        return _attention(q, k, v, ei, bias, edge_scale, scale, dropout_p, return_weights, backend, generator, **mods)
    if shared:
        value = key
    mult = edge_scale
    if dropout_p > 0:
        # One mask for a_ij v_j and a_ij ev_ij: drawn here, applied by the backend as an edge scale.
        dropped = engine.recompute.dropout_factor(num_edges, heads, dropout_p, q.new_empty(0, dtype=work), generator)
        mult = dropped if mult is None else mult.to(work) * dropped  # [E, H]
    out, weights = _attention(q, k, v, ei, bias, mult, scale, 0.0, True, backend, generator, **mods)
    used = weights.to(work) if mult is None else weights.to(work) * mult.to(work)  # [E, H]
    out = (out.to(work) + edge_terms.value_sum(used, dst, value, q.shape[0])).to(q.dtype)  # [Nq, H, dv]
    return out, weights if return_weights else None


def _same_term(key, value) -> bool:
    """Whether ``edge_key`` and ``edge_value`` are the same tensors (compared element-wise for pairs:
    ``torch.compile`` traces ``is`` on tensors, not on tuples)."""
    pairs = [isinstance(t, (tuple, list)) for t in (key, value)]
    if all(pairs):
        return len(key) == len(value) and all(a is b for a, b in zip(key, value))
    return not any(pairs) and key is not None and key is value
