"""How each kind of model runs a sparse pattern for :mod:`tgattn.analysis.fidelity`.

A model and its tokenizer become a :class:`Subject`: it cuts a text into passages of token ids
and runs one passage under a pattern, returning a :class:`Run` (the output, what each head kept,
the attention, the time). Two kinds:

* :class:`HFSubject`: a transformers model on ``attn_implementation="tgattn"``; patterns go
  through :func:`tgattn.hf.use_pattern` (``topk``: each layer's own top-k keys per head), heads as
  graphs through :func:`tgattn.hf.heads.heads_only` (each head on its own edges).
* :class:`GPTSubject`: the character GPT of :mod:`tgattn.lm` (a checkpoint): patterns go in as
  its ``edge_index``; a model that selects its keys (learned indexer top-k) runs its selection,
  against dense causal attention as the reference.

Rows = queries i, columns = keys j; ``edge_index[0]`` = key, ``edge_index[1]`` = query.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch
from torch import Tensor

from ..hf.attention import recording
from ..hf.heads import HeadGraphs, heads_only
from ..hf.interface import register, use_pattern

Kept = List[Tuple[Tensor, Tensor]]  # per layer: edge_index [2, E], keep [E, H] (the heads that use each edge)


@dataclass
class Run:
    """One passage under one pattern: ``output`` (last hidden states ``[T, D]`` of an encoder, next-token
    logits ``[T, V]`` of a causal LM), the edges each head kept, the recorded attention, the seconds."""

    output: Tensor
    kept: Kept
    attention: List[Tuple[Tensor, Tensor]]
    seconds: float


class NotApplicable(ValueError):
    """A pattern this model cannot run (top-k per head on the GPT, the indexer on a model without one)."""


def _all_heads(attention) -> Kept:
    return [(ei, torch.ones_like(alpha, dtype=torch.bool)) for ei, alpha in attention]


def _nonzero(attention) -> Kept:
    # a selection records weight 0 on the keys a head dropped (a kept key underflows only 103 nats below the row's best)
    return [(ei, alpha > 0) for ei, alpha in attention]


def _graphs_kept(graphs: HeadGraphs) -> Kept:
    return list(zip(graphs.edges, graphs.keep))


class HFSubject:
    """A transformers model (encoder or causal LM) and its tokenizer, on tgattn's attention."""

    def __init__(self, model, tokenizer, *, causal: bool, name: str):
        self.model, self.tokenizer, self.causal, self.name = model.eval(), tokenizer, causal, name
        self.default_length = min(512, getattr(model.config, "max_position_embeddings", None) or 512)
        register()

    @classmethod
    def load(cls, path: str, *, name: Optional[str] = None) -> "HFSubject":
        """A local folder or hub id: ``AutoModelForCausalLM`` when its config names a causal LM, else ``AutoModel``;
        ``name`` for the reports (default: ``path``)."""
        from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

        config = AutoConfig.from_pretrained(path)
        causal = any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in (config.architectures or []))
        loader = AutoModelForCausalLM if causal else AutoModel
        model = loader.from_pretrained(path, attn_implementation=register())
        return cls(model, AutoTokenizer.from_pretrained(path), causal=causal, name=name or str(path))

    def passages(self, text: str, length: int, count: int) -> List[Tensor]:
        """``count`` consecutive passages of ``length`` token ids (the tokenizer's special tokens included)."""
        prefix, suffix = self._special_tokens()
        body = length - len(prefix) - len(suffix)
        if body < 1:
            raise ValueError(f"length must exceed the {len(prefix) + len(suffix)} special tokens the tokenizer adds "
                             f"(got {length})")
        ids = self.tokenizer(text[: count * length * 12], add_special_tokens=False, verbose=False)["input_ids"]
        if len(ids) < count * body:
            raise ValueError(f"the text holds {len(ids)} tokens, fewer than {count} passages of {body}")
        return [torch.tensor(prefix + ids[p * body:(p + 1) * body] + suffix) for p in range(count)]

    def _special_tokens(self) -> Tuple[List[int], List[int]]:
        """The ids the tokenizer puts before and after a text ([CLS] / [SEP] for BERT; none for GPT-2)."""
        plain = self.tokenizer("hello world", add_special_tokens=False)["input_ids"]
        full = self.tokenizer("hello world")["input_ids"]
        start = next(i for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain)
        return full[:start], full[start + len(plain):]

    def _forward(self, ids: Tensor) -> Tuple[Tensor, list, float]:
        with torch.no_grad(), recording() as layers:
            start = time.perf_counter()
            out = self.model(input_ids=ids.view(1, -1))
            seconds = time.perf_counter() - start
        output = out.logits[0] if self.causal else out.last_hidden_state[0]
        return output, [(ei.cpu(), alpha.cpu()) for ei, alpha in layers], seconds

    def run(self, ids: Tensor, *, builder: Optional[Callable] = None, topk: Optional[int] = None,
            heads: Optional[HeadGraphs] = None, own: bool = False) -> Run:
        """``ids`` under a builder, each layer's top-k per head, each head's own graph, or (none) the model's rule."""
        if own:
            raise NotApplicable("a learned indexer top-k applies to a tiny GPT checkpoint trained with one")
        if heads is not None:
            with heads_only(self.model, heads):
                output, attention, seconds = self._forward(ids)
            return Run(output, _graphs_kept(heads), attention, seconds)
        use_pattern(self.model, builder, topk=topk)
        try:
            output, attention, seconds = self._forward(ids)
        finally:
            use_pattern(self.model)
        return Run(output, _nonzero(attention) if topk else _all_heads(attention), attention, seconds)


class GPTSubject:
    """The character GPT of a :mod:`tgattn.lm` checkpoint (causal; characters are its tokens)."""

    causal = True

    def __init__(self, model, vocab: str, *, name: str):
        self.model, self.vocab, self.name = model.eval(), vocab, name
        self.selects = model.config.attention in ("indexer_topk", "block_topk")
        self.default_length = model.config.block_size

    @classmethod
    def load(cls, path: str) -> "GPTSubject":
        from ..lm.checkpoint import load_checkpoint, model_from_checkpoint

        state = load_checkpoint(path)
        return cls(model_from_checkpoint(state, path), state["vocab"], name=str(path))

    def passages(self, text: str, length: int, count: int) -> List[Tensor]:
        """``count`` consecutive passages of ``length`` characters."""
        if length > self.model.config.block_size:
            raise ValueError(f"length {length} exceeds the checkpoint's block_size {self.model.config.block_size}")
        if len(text) < count * length:
            raise ValueError(f"the text holds {len(text)} characters, fewer than {count} passages of {length}")
        unknown = sorted(set(text[: count * length]) - set(self.vocab))
        if unknown:
            raise ValueError(f"the text holds characters outside the checkpoint's vocabulary: {''.join(unknown)!r}")
        index = {c: i for i, c in enumerate(self.vocab)}
        return [torch.tensor([index[c] for c in text[p * length:(p + 1) * length]]) for p in range(count)]

    def run(self, ids: Tensor, *, builder: Optional[Callable] = None, topk: Optional[int] = None,
            heads: Optional[HeadGraphs] = None, own: bool = False) -> Run:
        """``ids`` under a causal builder, the union of head graphs, its own selection, or (none) its pattern."""
        if topk is not None:
            raise NotApplicable("top-k per head from the model's scores runs on transformers models (use_pattern)")
        if own and not self.selects:
            raise NotApplicable("the checkpoint has no learned indexer (attention 'graph' or 'dense')")
        if self.selects and not own and (builder is not None or heads is not None):
            raise NotApplicable(f"the checkpoint selects its keys (attention {self.model.config.attention!r}): "
                                "it runs its own selection or dense attention only")
        n = ids.shape[0]
        kwargs = {}
        if heads is not None:
            kwargs["edge_index"] = heads.union()
        elif builder is not None:
            kwargs["edge_index"] = builder([n])
        elif self.selects and not own:
            kwargs["dense"] = True  # the reference of a selecting model: every causal key
        with torch.no_grad():
            start = time.perf_counter()
            logits, _, attention = self.model(ids.view(1, -1), return_attention=True, **kwargs)
            seconds = time.perf_counter() - start
        attention = [(ei.cpu(), alpha.cpu()) for ei, alpha in attention]
        kept = _nonzero(attention) if own else _all_heads(attention)  # head graphs run as their union here
        return Run(logits[0], kept, attention, seconds)
