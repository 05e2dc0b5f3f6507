"""Graph attention as one ``torch.library`` custom op, the form ``torch.compile`` traces.

Under ``torch.compile``, :func:`tgattn.functional.graph_attention` becomes a single call to
``torch.ops.tgattn.graph_attention``: the compiler sees its output shapes (a fake kernel)
and its autograd formula, and never traces into the engine, whose analysis and dispatch are
data dependent (validation, caching, the backend choice). So a compiled model has no graph
break at the attention, ``fullgraph=True`` included.

The backward op recomputes the forward on the same backend with autograd and differentiates
it (one extra forward per backward, compiled models only). Dropout draws its mask from a seed
that the compiled graph samples from torch's generator and hands to both ops, so the
recomputed forward drops the same weights.
"""
from __future__ import annotations

import contextlib
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from .eager import eager_graph_attention
from .recompute import recompute_grads


def _generator(seed: Optional[Tensor], device: torch.device) -> Optional[torch.Generator]:
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(int(seed))


def _seeded(seed: Optional[Tensor]):
    """Fixes torch's global generator for the SDPA backend's dropout; nothing without a seed."""
    if seed is None:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(torch.random.fork_rng(devices=[]))
    torch.manual_seed(int(seed))
    return stack


@contextlib.contextmanager
def _autograd_inside_op():
    """Autograd on inside a custom op's kernel, which the dispatcher enters below autograd.

    The backward op recomputes the forward with autograd (the engine's backends are autograd
    Functions), so it lifts the dispatcher's exclusion of the autograd keys for its own body.
    """
    key = torch._C.DispatchKey.AutogradFunctionality
    excluded = torch._C._dispatch_tls_is_dispatch_key_excluded(key)
    torch._C._dispatch_tls_set_dispatch_key_excluded(key, False)
    try:
        yield
    finally:
        torch._C._dispatch_tls_set_dispatch_key_excluded(key, excluded)


def _attend(q, k, v, edge_index, bias, edge_scale, sinks, seed, scale, softcap, dropout_p, return_weights, backend):
    with _seeded(seed):
        return eager_graph_attention(
            q, k, v, edge_index, bias, edge_scale, scale, dropout_p, return_weights, backend,
            generator=_generator(seed, q.device), softcap=softcap, sinks=sinks,
        )


# Not capturable by CUDA graphs: the op analyses its edge set in Python (once per edge set, cached),
# which a graph replay would skip, reusing a capture-time analysis for new edge contents.
# The tag makes Inductor's cudagraph trees run the op outside the captured graphs.
_UNSAFE_TO_CAPTURE = (torch.Tag.cudagraph_unsafe,)


@torch.library.custom_op("tgattn::graph_attention", mutates_args=(), tags=_UNSAFE_TO_CAPTURE)
def graph_attention_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    edge_index: Tensor,
    bias: Optional[Tensor],
    edge_scale: Optional[Tensor],
    seed: Optional[Tensor],
    scale: Optional[float],
    dropout_p: float,
    return_weights: bool,
    backend: str,
    sinks: Optional[Tensor] = None,
    softcap: Optional[float] = None,
) -> Tuple[Tensor, Tensor]:
    """``(out [Nq, H, dv], weights [E, H], or [0, H] when not asked for)``; ``sinks`` / ``softcap``
    come last, so that the op keeps the positions of its first arguments."""
    with torch.no_grad():
        options = (scale, softcap, dropout_p, return_weights, backend)
        out, weights = _attend(q, k, v, edge_index, bias, edge_scale, sinks, seed, *options)
    if weights is None:
        weights = q.new_empty(0, q.shape[1])
    return out.contiguous(), weights.contiguous()


@graph_attention_op.register_fake
def _(q, k, v, edge_index, bias, edge_scale, seed, scale, dropout_p, return_weights, backend, sinks=None, softcap=None):
    num_weights = edge_index.shape[1] if return_weights else 0
    return q.new_empty(q.shape[0], q.shape[1], v.shape[2]), q.new_empty(num_weights, q.shape[1])


@torch.library.custom_op("tgattn::graph_attention_backward", mutates_args=(), tags=_UNSAFE_TO_CAPTURE)
def graph_attention_backward_op(
    grad_out: Tensor,
    grad_weights: Optional[Tensor],
    q: Tensor,
    k: Tensor,
    v: Tensor,
    edge_index: Tensor,
    bias: Optional[Tensor],
    edge_scale: Optional[Tensor],
    seed: Optional[Tensor],
    scale: Optional[float],
    dropout_p: float,
    return_weights: bool,
    backend: str,
    needs: List[bool],
    sinks: Optional[Tensor] = None,
    softcap: Optional[float] = None,
) -> List[Tensor]:
    """Gradients of ``(q, k, v, bias, edge_scale, sinks)``; an empty tensor where none is needed."""
    inputs = (q, k, v, bias, edge_scale, sinks)

    def forward(q, k, v, bias, edge_scale, sinks):
        options = (scale, softcap, dropout_p, return_weights, backend)
        return _attend(q, k, v, edge_index, bias, edge_scale, sinks, seed, *options)

    if grad_weights is not None and grad_weights.numel() == 0:
        grad_weights = None
    with _autograd_inside_op():
        grads = recompute_grads(forward, inputs, (grad_out, grad_weights), needs)
    return [q.new_empty(0) if g is None else g.contiguous() for g in grads]


@graph_attention_backward_op.register_fake
def _(grad_out, grad_weights, q, k, v, edge_index, bias, edge_scale, seed, scale, dropout_p, return_weights, backend,
      needs, sinks=None, softcap=None):
    inputs = (q, k, v, bias, edge_scale, sinks)
    return [torch.empty_like(t) if t is not None and need else q.new_empty(0) for t, need in zip(inputs, needs)]


def _setup_context(ctx, inputs, output):
    q, k, v, edge_index, bias, edge_scale, seed, scale, dropout_p, return_weights, backend, sinks, softcap = inputs
    ctx.save_for_backward(q, k, v, edge_index, bias, edge_scale, seed, sinks)
    ctx.options = (scale, dropout_p, return_weights, backend)
    ctx.softcap = softcap


def _backward(ctx, grad_out, grad_weights):
    q, k, v, edge_index, bias, edge_scale, seed, sinks = ctx.saved_tensors
    given = len(ctx.needs_input_grad)  # a call that leaves out sinks / softcap has fewer inputs
    needs = [bool(ctx.needs_input_grad[i]) for i in (0, 1, 2, 4, 5)] + [given > 11 and bool(ctx.needs_input_grad[11])]
    grads = graph_attention_backward_op(
        grad_out, grad_weights, q, k, v, edge_index, bias, edge_scale, seed, *ctx.options, needs, sinks, ctx.softcap
    )
    dq, dk, dv, dbias, dscale, dsinks = (g if need else None for g, need in zip(grads, needs))
    return (dq, dk, dv, None, dbias, dscale, None, None, None, None, None, dsinks, None)[:given]


graph_attention_op.register_autograd(_backward, setup_context=_setup_context)


def compiled_graph_attention(
    q, k, v, edge_index, bias, edge_scale, scale, dropout_p, return_weights, backend, softcap=None, sinks=None
):
    """The traced form of :func:`tgattn.functional.graph_attention`: ``(out, weights or None)``."""
    seed = torch.randint(0, 2**62, (), device="cpu") if dropout_p > 0 else None
    out, weights = graph_attention_op(
        q, k, v, edge_index, bias, edge_scale, seed, scale, dropout_p, return_weights, backend, sinks, softcap
    )
    return out, (weights if return_weights else None)
