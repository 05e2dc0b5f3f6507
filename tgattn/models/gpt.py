"""A character-level GPT whose attention runs over edge sets (nanoGPT's model, as a graph).

Radford et al., "Language Models are Unsupervised Multitask Learners" (GPT-2), 2019; the
layout follows Karpathy's nanoGPT ``model.py``: token + position embeddings, pre-LayerNorm
blocks (attention, then MLP), a final LayerNorm and a head tied to the token embedding.

A batch ``idx [B, T]`` becomes one graph of ``N = B * T`` nodes whose block-diagonal edge set
comes from the configured pattern (:mod:`tgattn.models.patterns`); it is built once per
``(B, T)`` and shared by all layers. With ``attention="indexer_topk"`` or ``"block_topk"``
each layer selects its own keys per forward instead (:mod:`tgattn.models.indexer`).
"""
from __future__ import annotations

import math
from collections import OrderedDict
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..nn.attention import GraphAttention
from .config import SELECTIONS, GPTConfig
from .dense import DenseAttention
from .indexer import SelectedAttention
from .patterns import Pattern, make_pattern

_CACHE_SIZE = 8  # edge sets kept per model (one per (B, T, device) seen recently)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LN block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``, on nodes ``x [N, D]``."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        if config.attention == "graph":
            self.attn = GraphAttention(config.n_embd, config.n_head, dropout=config.dropout, bias=config.bias)
        elif config.attention == "dense":
            self.attn = DenseAttention(config.n_embd, config.n_head, dropout=config.dropout, bias=config.bias)
        else:
            self.attn = SelectedAttention(config)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: Tensor, graph: Tensor, return_attention: bool = False):
        """``graph`` is the edge set ``[2, E]`` (graph attention) or the mask ``[B, T, T]`` (dense)."""
        out = self.attn(self.ln_1(x), graph, return_attention_weights=return_attention)
        a, weights = out if return_attention else (out, None)
        x = x + self.resid_dropout(a)
        x = x + self.mlp(self.ln_2(x))
        return x, weights

    def select(self, x: Tensor, lengths: list, return_attention: bool = False, *, dense: bool = False):
        """:meth:`forward` of a block whose attention selects its keys: ``(x, weights, indexer kl)``."""
        a, weights, kl = self.attn.select(self.ln_1(x), lengths, dense=dense, return_attention_weights=return_attention)
        x = x + self.resid_dropout(a)
        x = x + self.mlp(self.ln_2(x))
        return x, weights, kl


class GPT(nn.Module):
    """nanoGPT with graph attention: ``idx [B, T]`` -> next-token logits ``[B, T, V]``.

    Args:
        config: sizes and the attention pattern (:class:`GPTConfig`).
        pattern: overrides ``config.pattern`` with any causal builder ``lengths -> edge_index``
            (every token must keep at least one key, e.g. itself).

    Example:
        >>> model = GPT(GPTConfig(block_size=8, vocab_size=5, n_layer=1, n_head=2, n_embd=8))
        >>> idx = torch.randint(5, (2, 8))
        >>> logits, loss = model(idx, idx)
        >>> logits.shape, loss.shape
        (torch.Size([2, 8, 5]), torch.Size([]))
    """

    def __init__(self, config: GPTConfig, *, pattern: Optional[Pattern] = None):
        super().__init__()
        self.config = config
        self.pattern = pattern if pattern is not None else make_pattern(config)
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # weight tying (Press & Wolf, 2017)
        self._edges: "OrderedDict[tuple, tuple]" = OrderedDict()
        self.apply(self._init_weights)
        for block in self.transformer.h:  # GPT-2: scale residual projections by 1/sqrt(2 n_layer)
            for lin in (block.attn.out_proj, block.mlp.c_proj):
                nn.init.normal_(lin.weight, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    @property
    def has_indexer(self) -> bool:
        """Whether the layers hold lightning indexers (``attention="indexer_topk"``), trained by their own loss."""
        return self.config.attention == "indexer_topk"

    def num_params(self) -> int:
        """Parameters, the tied head counted once, position embeddings included."""
        return sum(p.numel() for p in self.parameters())

    def edges(self, batch: int, length: int, device=None) -> Tensor:
        """The packed edge set ``[2, E]`` of ``batch`` sequences of ``length`` (cached per shape)."""
        return self._graph(batch, length, torch.device(device or "cpu"))[0]

    def _graph(self, batch: int, length: int, device: torch.device):
        key = (batch, length, str(device))
        if key not in self._edges:
            edge_index = self.pattern([length] * batch).to(device)
            self._edges[key] = (edge_index, self._structure(edge_index, batch, length))
            if len(self._edges) > _CACHE_SIZE:
                self._edges.popitem(last=False)
        return self._edges[key]

    def _structure(self, edge_index: Tensor, batch: int, length: int) -> Tensor:
        """Check an edge set for this model; return what the attention layers take."""
        src, dst = edge_index
        n = batch * length
        if edge_index.numel() and (src // length != dst // length).any():
            raise ValueError("the attention pattern has edges between different sequences of the batch")
        if edge_index.numel() and (src > dst).any():
            raise ValueError("the attention pattern is not causal: some query i sees a later key j > i")
        seen = torch.bincount(dst, minlength=n)
        if n and int(seen.min()) == 0:
            raise ValueError(f"the attention pattern leaves query {int((seen == 0).nonzero()[0])} without keys")
        if self.config.attention == "graph":
            return edge_index
        mask = torch.zeros(batch, length, length, dtype=torch.bool, device=edge_index.device)
        mask[dst // length, dst % length, src % length] = True  # [B, T, T]
        return mask

    def forward(
        self,
        idx: Tensor,
        targets: Optional[Tensor] = None,
        *,
        return_attention: bool = False,
        edge_index: Optional[Tensor] = None,
        dense: bool = False,
        return_indexer_loss: bool = False,
    ):
        """Logits ``[B, T, V]`` and the mean cross-entropy with ``targets`` (``None`` without).

        Args:
            idx: token ids ``[B, T]``, ``T <= block_size``.
            targets: next-token ids ``[B, T]`` (``-1`` = ignore).
            return_attention: also return, per layer, ``(edge_index [2, E], alpha [E, H])``
                over the packed graph (node ``b * T + t`` = token t of sequence b).
            edge_index: use this packed edge set instead of the configured pattern.
            dense: attention ``indexer_topk`` / ``block_topk`` only: every layer attends to
                every causal key instead of its selection (the indexer's warm-up).
            return_indexer_loss: also return the indexers' loss, summed over layers
                (:func:`tgattn.models.indexer.indexer_kl`; 0 without indexers).

        Returns:
            ``(logits, loss)``, then ``attention`` with ``return_attention``, then the indexer
            loss with ``return_indexer_loss``.
        """
        b, t = idx.shape
        selects = self.config.attention in SELECTIONS
        if t > self.config.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.config.block_size}")
        if selects and edge_index is not None:
            raise ValueError(f"attention {self.config.attention!r} selects its keys in each layer: edge_index cannot be given")
        if dense and not selects:
            raise ValueError(f"dense=True is the warm-up of a model that selects its keys (got attention {self.config.attention!r})")
        if selects:
            graph = [t] * b
        elif edge_index is None:
            edge_index, graph = self._graph(b, t, idx.device)
        else:
            graph = self._structure(edge_index, b, t)
        pos = torch.arange(t, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))  # [B, T, D]
        x = x.reshape(b * t, -1)  # [N, D]: sequences packed back to back
        attention, indexer_loss = [], x.new_zeros(())
        for block in self.transformer.h:
            if selects:
                x, weights, kl = block.select(x, graph, return_attention, dense=dense)
                indexer_loss = indexer_loss + kl if kl is not None else indexer_loss
                attention.append(weights)
            else:
                x, weights = block(x, graph, return_attention)
                if return_attention:
                    attention.append((edge_index, self._edge_weights(weights, edge_index, t)))
        logits = self.lm_head(self.transformer.ln_f(x)).view(b, t, -1)  # [B, T, V]
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(b * t, -1), targets.reshape(-1), ignore_index=-1)
        return (logits, loss) + ((attention,) if return_attention else ()) + ((indexer_loss,) if return_indexer_loss else ())

    def _edge_weights(self, weights, edge_index: Tensor, length: int) -> Tensor:
        if self.config.attention == "graph":
            return weights[1]  # GraphAttention returned (edge_index, alpha [E, H])
        src, dst = edge_index
        w = weights.permute(0, 2, 3, 1)  # [B, T, T, H]
        return w[dst // length, dst % length, src % length]  # [E, H]

    def configure_optimizer(self, *, lr: float, weight_decay: float, betas=(0.9, 0.99)) -> torch.optim.AdamW:
        """AdamW with weight decay on matrices (Linear, Embedding) only, as nanoGPT does."""
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=lr, betas=betas)
