"""tgattn in transformers' interfaces: :func:`register` (the attention function and the mask
builder under one name) and :func:`use_pattern` (any builder as a model's pattern)."""
from __future__ import annotations

from typing import Callable, Optional

from .attention import attention_forward
from .masks import edge_mask
from .patterns import make_choice, set_choice
from .support import select


def register(name: str = "tgattn") -> str:
    """Register tgattn's attention function and mask builder with transformers under ``name``.

    Afterwards ``model.set_attn_implementation(name)`` (or ``from_pretrained(...,
    attn_implementation=name)``) runs every model whose attention goes through transformers'
    attention interface on edge sets. Registering again is harmless.

    Args:
        name: the ``attn_implementation`` name (default: ``"tgattn"``).

    Returns:
        ``name``.

    Example:
        >>> from transformers import AttentionInterface
        >>> register()
        'tgattn'
        >>> "tgattn" in AttentionInterface()
        True
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string (got {name!r})")
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, edge_mask)
    return name


def use_pattern(model, builder: Optional[Callable] = None, *, window: Optional[int] = None,
                causal: Optional[bool] = None, topk: Optional[int] = None, name: str = "tgattn"):
    """Run ``model``'s attention on another pattern, built for each batch from its lengths.

    The pattern replaces the model's self-attention pattern only: cross attention (a decoder's
    queries on the encoder's keys) keeps the model's own mask. It is applied to every document
    of the batch: each row's real tokens (padding removed), split where transformers' own mask
    keeps a token from seeing its predecessor (packed sequences; for a chunked-attention model
    also its chunk borders). The builder
    gets the list of document lengths and returns the packed batch's edges, like every
    :mod:`tgattn.builders` function; key j / query i are the real tokens in order. During
    ``generate()`` each step keeps the rows of the new queries (the builder runs over whole
    documents, so its cost per step is that of the whole pattern), and keys a sliding-window
    cache no longer holds are dropped.

    ``topk=K`` adds a selection that each layer makes on its own (top-k attention: Gupta et al.,
    "Memory-efficient Transformers via Top-k Attention", 2021): in every self-attention call,
    each query head keeps the ``K`` keys with the largest attention logits (scaled, soft-capped,
    plus any position bias, as the softmax sees them) among the keys the pattern allows (the
    model's own rule when no builder or window is given), ties to the smaller key; a query
    with at most ``K`` keys keeps them all. The result equals dense attention with that per-head
    mask, forward and backward (the choice itself is not differentiated). Cost: one logit per
    allowed key and head, then the attention over ``K`` keys per query. DeepSeek-V3.2's
    learned indexer (its ``indices=`` argument) is not run: such a call is refused.

    Sets the model's ``attn_implementation`` to ``name`` (registering it when needed). The
    pattern is kept beside the model's config (not in it: ``save_pretrained`` is unchanged);
    ``use_pattern(model)`` returns to the model's own rule.

    Args:
        model: a transformers ``PreTrainedModel``.
        builder: ``lengths -> LongTensor[2, E]``, e.g.
            ``lambda n: builders.bigbird(n, 8, 1, 2, causal=True, generator=g)`` (default:
            none). Its result is checked at each forward (:func:`tgattn.hf.patterns.check_built`):
            an integer ``[2, E]`` tensor of token ids in range, each edge inside one document
            and, when causal, never from a later key to an earlier query.
        window: shortcut for ``builders.window(lengths, window, causal=...)``: keys with
            ``|i - j| <= window`` (``0 <= i - j <= window`` when causal), i.e. transformers'
            causal ``sliding_window = window + 1``.
        causal: ``True``, ``False`` or ``None`` (default: follow the model, causal when its own
            mask never lets a query see the next token). For ``window``: its direction; for a
            ``builder``: whether a later key is refused (``False`` lets it through).
        topk: keys kept per query and head in every self-attention call, ``>= 1`` (default:
            all that the pattern allows).
        name: the registered implementation to use (default: ``"tgattn"``).

    Returns:
        ``model``.

    Raises:
        TypeError, ValueError: naming the argument and its value, before anything changes; a
            builder's bad edges at the first forward.
        ValueError: naming the class, for a model whose attention tgattn cannot run
            (:func:`tgattn.hf.support.unsupported`: BLOOM, Falcon, MPT, ...), which
            ``set_attn_implementation`` alone would leave on its own attention.

    Example:
        >>> import torch
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        ...                      num_attention_heads=2, num_key_value_heads=1)
        >>> model = use_pattern(LlamaForCausalLM(config), window=2)
        >>> model.config._attn_implementation
        'tgattn'
        >>> model(torch.tensor([[1, 2, 3, 4, 5]])).logits.shape
        torch.Size([1, 5, 32])
        >>> model = use_pattern(model, topk=2)  # each layer's two best causal keys per query head
        >>> model(torch.tensor([[1, 2, 3, 4, 5]])).logits.shape
        torch.Size([1, 5, 32])
    """
    from transformers import PreTrainedModel

    choice = make_choice(builder, window, causal, topk)
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"model must be a transformers PreTrainedModel (got {type(model).__name__})")
    register(name)
    select(model, name)
    set_choice(model, choice)
    return model
