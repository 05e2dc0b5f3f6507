"""Who influences whom in a Hugging Face model: its attention as graphs for :mod:`tgattn.analysis`."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from ..analysis.influence import Influencers
from ..analysis.figure import rank, show_figure
from .attention import Layer, attention_forward, recording
from .interface import register
from .support import select


def attention_graph(model, input_ids, *, name: str = "tgattn") -> List[Layer]:
    """The attention of every layer of ``model`` on one sequence, as ``(edge_index, alpha)`` pairs.

    Runs one forward with tgattn's attention (switching the model to ``name`` for the call
    when it uses another implementation) and returns, first layer first, the model's edge set
    ``[2, E]`` over token positions and the weights ``alpha [E, H]`` of each query head: what
    :func:`tgattn.analysis.attention_rollout`, :func:`~tgattn.analysis.attention_flow` and
    :func:`~tgattn.analysis.top_influencers` take.

    Args:
        model: a transformers model whose attention goes through ``AttentionInterface``
            (others raise ``ValueError`` naming their class).
        input_ids: token ids ``[T]`` or ``[1, T]``.
        name: the implementation to run with (registered when needed; default: ``"tgattn"``).

    Example:
        >>> from transformers import GPT2Config, GPT2Model
        >>> model = GPT2Model(GPT2Config(vocab_size=16, n_embd=8, n_layer=2, n_head=2))
        >>> layers = attention_graph(model, [3, 1, 4, 1])
        >>> len(layers), layers[1][0].shape, layers[1][1].shape  # causal: 4 * 5 / 2 edges
        (2, torch.Size([2, 10]), torch.Size([10, 2]))
    """
    from transformers import AttentionInterface

    ids = torch.as_tensor(input_ids, dtype=torch.long)
    ids = ids.unsqueeze(0) if ids.dim() == 1 else ids
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] == 0:
        raise ValueError(f"input_ids must be one sequence [T] or [1, T] (got shape {list(ids.shape)})")
    previous = model.config._attn_implementation
    switch = AttentionInterface().get(previous) is not attention_forward
    if switch:
        select(model, register(name))
    try:
        with torch.no_grad(), recording() as layers:
            model(input_ids=ids.to(model.device))
    finally:
        if switch:
            model.set_attn_implementation(previous)
    return [(ei.cpu(), alpha.detach().float().cpu()) for ei, alpha in layers]


class Shown(NamedTuple):
    """What :func:`show` computed: the tokens, each layer's attention, the ranked influencers and the picture."""

    tokens: List[str]
    attention: List[Layer]
    ranked: Dict[str, Influencers]
    figure: Any


def show(model, input_ids, *, tokens: Optional[Sequence[str]] = None, query: int = -1, top_k: int = 5,
         figure: bool = True, title: str = "") -> Shown:
    """``python -m tgattn show`` for a transformers model: attention, rollout and flow into one token.

    Args:
        model: a transformers model (see :func:`attention_graph`).
        input_ids: token ids ``[T]`` or ``[1, T]``.
        tokens: the tokens' text for the labels (default: the ids).
        query: the token whose influencers are ranked (default: the last).
        top_k: influencers to rank (default: 5).
        figure: also draw the four panels of ``show`` (a matplotlib ``Figure``; needs matplotlib).
        title: the figure's title.

    Returns:
        :class:`Shown`; ``ranked`` maps ``"rollout"`` and ``"flow"`` to the top influencers.

    Example:
        >>> from transformers import GPT2Config, GPT2Model
        >>> model = GPT2Model(GPT2Config(vocab_size=16, n_embd=8, n_layer=2, n_head=2))
        >>> shown = show(model, [3, 1, 4, 1], top_k=2, figure=False)
        >>> shown.tokens, shown.ranked["rollout"].index.shape
        (['3', '1', '4', '1'], torch.Size([2]))
    """
    attention = attention_graph(model, input_ids)
    n = int(torch.as_tensor(input_ids).shape[-1])
    tokens = [str(t) for t in torch.as_tensor(input_ids).flatten().tolist()] if tokens is None else list(tokens)
    if len(tokens) != n:
        raise ValueError(f"tokens has {len(tokens)} entries for {n} token ids")
    if isinstance(query, bool) or not isinstance(query, int) or not -n <= query < n:
        raise ValueError(f"query must be a token index in [0, {n}) (got {query!r})")
    query %= n
    ranked = rank(attention, query, top_k, n)
    fig = show_figure(tokens, attention, ranked, query=query, title=title) if figure else None
    return Shown(tokens, attention, ranked, fig)


def _random_model(words: Sequence[str], args: argparse.Namespace):
    """A tiny random Llama over ``words`` (equal words share an id); seeded, nothing downloaded."""
    from transformers import LlamaConfig, LlamaModel

    vocab = {word: number for number, word in enumerate(sorted(set(words)))}
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=16 * args.heads, intermediate_size=32 * args.heads,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
                         max_position_embeddings=max(len(words), 8))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(args.seed)
        model = LlamaModel(config).eval()
    return model, torch.tensor([vocab[w] for w in words])


def cli_attention(args: argparse.Namespace) -> Tuple[List[str], List[Layer], str]:
    """Tokens, attention and a description for ``python -m tgattn show --hf PATH|random``."""
    if args.hf == "random":
        tokens = args.text.split()
        if not tokens:
            raise ValueError("--text has no words")
        model, ids = _random_model(tokens, args)
        source = f"tiny random Llama, seed {args.seed}"
    else:
        model, tokenizer = _local_model(args.hf)
        ids = tokenizer(args.text, return_tensors="pt")["input_ids"][0]  # with the model's own [CLS] / [SEP] / BOS
        positions = getattr(model.config, "max_position_embeddings", None)
        if positions is not None and len(ids) > positions:
            raise ValueError(f"the text is {len(ids)} tokens long, more than the {positions} positions of {args.hf}: "
                             "give a shorter text")
        tokens = tokenizer.convert_ids_to_tokens(ids.tolist())
        source = f"{type(model).__name__} {Path(args.hf).name}"
    attention = attention_graph(model, ids)
    causal = all(bool((ei[0] <= ei[1]).all()) for ei, _ in attention)
    heads = attention[0][1].shape[1]
    return list(tokens), attention, f"{source}, {len(attention)} layers x {heads} heads, {'causal' if causal else 'bidirectional'}"


def _local_model(path: str):
    """``(model, tokenizer)`` from a model folder, the ``tgattn[models]`` extra's model by its name
    (``all-MiniLM-L6-v2``), or the Hugging Face cache for a hub id; nothing downloaded."""
    from transformers import AutoModel, AutoTokenizer

    from .pretrained import NAME, minilm_path

    if path == NAME and not Path(path).is_dir():
        try:
            path = str(minilm_path())
        except ModuleNotFoundError as err:
            raise ValueError(str(err)) from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except OSError:  # transformers' several-line answer for a name that is neither a folder nor cached
        if Path(path).is_dir():
            raise
        raise ValueError(f"no model folder at {path} (nor a model of that name in the Hugging Face cache)") from None
    return AutoModel.from_pretrained(path, local_files_only=True).eval(), tokenizer

