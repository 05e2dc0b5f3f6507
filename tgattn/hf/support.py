"""Which transformers models tgattn can run, and what a mask request is for (self or cross attention).

transformers offers no per-model hook for a registered attention name: any model accepts
``attn_implementation="tgattn"``, whether or not its attention reads the mask through
``AttentionInterface``. So tgattn checks the model itself, in :func:`tgattn.hf.use_pattern`
and :func:`tgattn.hf.attention_graph` before switching, and in the mask builder at the
first forward, before any attention runs.
"""
from __future__ import annotations

import sys
from typing import Any, NamedTuple, Optional

# Models whose attention goes through the interface but that first rework the mask as a dense
# tensor of their own (tgattn's mask is an edge set), by the module that defines them.
OWN_MASK = {
    "transformers.models.doge.modeling_doge": "it turns the mask into a dense per-head score bias of its own "
                                              "(dynamic mask attention)",
}


def unsupported(cls: type) -> Optional[str]:
    """Why tgattn cannot run the attention of the transformers model class ``cls``, or ``None``.

    A model runs on tgattn when its attention calls the function registered in
    ``AttentionInterface`` with the mask it was given: transformers' own test for that
    (``_can_set_attn_implementation``, which ``set_attn_implementation`` consults: a module
    with an attention class that never asks ``ALL_ATTENTION_FUNCTIONS`` for its function, or
    whose source cannot be read) minus the models of :data:`OWN_MASK`.

    Example:
        >>> from transformers import BloomModel, LlamaModel
        >>> unsupported(LlamaModel) is None
        True
        >>> unsupported(BloomModel)
        "its attention does not go through transformers' attention interface (it computes attention itself)"
    """
    if cls.__module__ in OWN_MASK:
        return OWN_MASK[cls.__module__]
    if not cls._can_set_attn_implementation():
        return "its attention does not go through transformers' attention interface (it computes attention itself)"
    return None


# Layer kinds that keep keys and values in the cache (transformers' names in config.layer_types).
ATTENTION_LAYERS = ("full_attention", "sliding_attention", "chunked_attention")


def first_layer_keeps_no_keys(config) -> Optional[str]:
    """The kind of ``config``'s first layer when it keeps no keys (``"linear_attention"``), else ``None``.

    Example:
        >>> from transformers import MiniMaxConfig
        >>> linear_first = MiniMaxConfig(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
        >>> first_layer_keeps_no_keys(linear_first)
        'linear_attention'
        >>> first_layer_keeps_no_keys(MiniMaxConfig(num_hidden_layers=2)) is None  # full, linear
        True
    """
    kinds = getattr(config, "layer_types", None) or [None]
    return kinds[0] if kinds[0] is not None and kinds[0] not in ATTENTION_LAYERS else None


def check_class(cls: type, name: str = "tgattn") -> None:
    """Raise ``ValueError`` naming ``cls`` when its models cannot run on tgattn (:func:`unsupported`)."""
    reason = unsupported(cls)
    if reason is not None:
        raise ValueError(f"{cls.__name__} cannot run on attn_implementation={name!r}: {reason}; "
                         "use 'eager' or 'sdpa' for this model")


def select(model, name: str) -> None:
    """Switch ``model`` to the registered implementation ``name``, or raise when it cannot run it.

    Every transformers model inside ``model`` is checked first: ``set_attn_implementation``
    alone only logs a warning for such models and leaves them as they were.
    """
    from transformers import PreTrainedModel

    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            check_class(type(module), name)
    model.set_attn_implementation(name)


class MaskRequest(NamedTuple):
    """Who asked the mask builder for a mask: read from the call stack by :func:`mask_request`."""

    model: Optional[Any]  # the nearest transformers model up the stack (None: called outside one)
    cross: bool  # transformers' mask function was given encoder_hidden_states


def mask_request() -> MaskRequest:
    """The model and the kind of attention the mask being built is for (call it from the mask builder).

    transformers builds a cross-attention mask with the same call as an encoder's
    self-attention mask (``create_bidirectional_mask``, bidirectional rule, the encoder's
    padding), only with ``encoder_hidden_states`` given, and it does not hand that argument on
    to the mask builder. Config flags (``is_encoder_decoder``, ``add_cross_attention``) do not
    tell either: a decoder's own sub-config (T5Gemma, MusicGen) carries neither. So the
    innermost frame of ``transformers.masking_utils`` up the stack is asked for its
    ``encoder_hidden_states``, and the first frame whose ``self`` is a ``PreTrainedModel`` is the
    model whose forward asked.
    """
    from transformers import PreTrainedModel

    cross = None
    frame = sys._getframe(2)  # the mask builder's caller
    while frame is not None:
        code = frame.f_code
        if cross is None and frame.f_globals.get("__name__") == "transformers.masking_utils":
            cross = frame.f_locals.get("encoder_hidden_states") is not None
        if "self" in code.co_varnames[:code.co_argcount] and isinstance(frame.f_locals.get("self"), PreTrainedModel):
            return MaskRequest(frame.f_locals["self"], bool(cross))
        frame = frame.f_back
    return MaskRequest(None, bool(cross))
