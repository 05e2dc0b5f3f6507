"""Context parallel training of the tiny GPT: one long sequence split across ranks.

The packed batch (node ``b * T + t`` = token t of sequence b) is cut into contiguous token
ranges, one per rank (:func:`~tgattn.distributed.partition.contiguous`). Every rank holds the
whole model and runs embeddings, MLPs and the head on its own tokens only; each attention
layer fetches the key / value rows its pattern reads across a boundary (a causal window of
radius w: w rows from the previous rank). Gradients are averaged by DDP over a second process
group, so the halo exchange and DDP's all-reduce never share a communicator.

Memory per rank is that of ``T / world`` tokens plus the halo, while dense attention over the
same sequence needs ``H * T^2`` scores per layer in one place. The command line
:mod:`tgattn.distributed.gpt` trains it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..models import GPT, GPTConfig
from .nn import distribute
from .partition import contiguous
from .plan import HaloPlan, make_plan


class ContextParallelGPT(nn.Module):
    """A :class:`~tgattn.models.GPT` (graph attention) that runs on one rank's tokens.

    Its forward returns this rank's share of the loss, ``sum of its tokens' cross-entropy /
    total``: the shares of all ranks add up to the single-process mean loss, and so do their
    gradients (sum them, or let DDP average them and scale the shares by the world size).

    Args:
        model: the GPT; its attention layers are swapped, in place, for distributed ones with
            the same weights (so ``model`` itself then takes plans, not batches).

    Example:
        >>> gpt = GPT(GPTConfig(block_size=8, vocab_size=5, n_layer=1, n_head=2, n_embd=8))
        >>> idx = torch.randint(5, (2, 8))
        >>> loss = gpt(idx, idx)[1]
        >>> cp = ContextParallelGPT(gpt)
        >>> plan = context_plan(cp, batch=2, length=8)  # one rank: no process group
        >>> share = cp(idx.view(-1)[plan.nodes], idx.view(-1)[plan.nodes], plan, length=8, total=16)
        >>> torch.allclose(share, loss)
        True
    """

    def __init__(self, model: GPT):
        super().__init__()
        if model.config.attention != "graph":
            raise ValueError(f"context parallelism needs graph attention (got attention={model.config.attention!r})")
        self.model = distribute(model)

    def forward(self, idx: Tensor, targets: Tensor, plan: HaloPlan, *, length: int, total: int) -> Tensor:
        """Loss share of this rank's tokens.

        Args:
            idx: token ids of this rank's nodes ``[N_r]`` (``idx.view(-1)[plan.nodes]``).
            targets: their next-token ids ``[N_r]`` (``-1`` = ignore).
            plan: the plan of :func:`context_plan`.
            length: sequence length T of the packed batch.
            total: targets counted over all ranks (not ``-1``): the mean's denominator.
        """
        m = self.model
        pos = plan.nodes % length  # [N_r] positions within each sequence
        x = m.transformer.drop(m.transformer.wte(idx) + m.transformer.wpe(pos))  # [N_r, D]
        for block in m.transformer.h:
            x, _ = block(x, plan)
        logits = m.lm_head(m.transformer.ln_f(x))  # [N_r, V]
        return F.cross_entropy(logits, targets, ignore_index=-1, reduction="sum") / total


def context_plan(cp: ContextParallelGPT, *, batch: int, length: int, group=None) -> HaloPlan:
    """This rank's plan for ``batch`` sequences of ``length`` tokens cut into contiguous ranges
    (collective; the model's pattern decides the edges)."""
    import torch.distributed as dist

    world = dist.get_world_size(group) if dist.is_initialized() else 1
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    part = contiguous(batch * length, world)
    return make_plan(part.local_edges(cp.model.edges(batch, length), rank), part, group=group)
