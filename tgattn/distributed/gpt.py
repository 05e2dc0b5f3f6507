"""Context parallel training of the tiny GPT: one long sequence split across ranks.

The packed batch (node ``b * T + t`` = token t of sequence b) is cut into contiguous token
ranges, one per rank (:func:`~tgattn.distributed.partition.contiguous`). Every rank holds the
whole model and runs embeddings, MLPs and the head on its own tokens only; each attention
layer fetches the key / value rows its pattern reads across a boundary (a causal window of
radius w: w rows from the previous rank). Gradients are averaged by DDP over a second process
group, so the halo exchange and DDP's all-reduce never share a communicator.

Memory per rank is that of ``T / world`` tokens plus the halo, while dense attention over the
same sequence needs ``H * T^2`` scores per layer in one place::

    python -m tgattn.distributed.gpt --nproc 2 --length 65536 --steps 30
    torchrun --nproc-per-node 4 -m tgattn.distributed.gpt --length 65536 --steps 30

Writes ``<out>/gpt_cp_<world>.csv`` (one row per step: loss, seconds, exchange seconds) and
``gpt_cp_<world>.json`` (per rank: tokens, halo rows, peak RSS; the final validation loss), and
ends by printing the losses and the two paths. The corpus is read before any process starts:
without it, the command ends on one line saying where it looked and how to get it (exit 2).
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._cli import out_help, run, runs_dir
from ..bench.report import write_csv
from ..models import GPT, GPTConfig
from .launch import launch
from .nn import distribute
from .partition import contiguous
from .plan import ExchangeStats, HaloPlan, make_plan


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


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _train(rank: int, world: int, args, text: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from ..lm.data import CharTokenizer, get_batch, split

    torch.set_num_threads(args.threads)
    tok = CharTokenizer.from_text(text)
    train_ids, val_ids = split(tok.encode(text))
    torch.manual_seed(args.seed)
    config = GPTConfig(block_size=args.length, vocab_size=len(tok), n_layer=args.n_layer, n_head=args.n_head,
                       n_embd=args.n_embd, pattern=args.pattern, window=args.window)
    cp = ContextParallelGPT(GPT(config))
    halo_group = dist.new_group()  # the exchange's communicator; DDP all-reduces on the default one
    plan = context_plan(cp, batch=args.batch, length=args.length, group=halo_group)
    plan.stats = ExchangeStats()
    ddp = DistributedDataParallel(cp)  # broadcasts rank 0's weights, averages gradients
    optimizer = cp.model.configure_optimizer(lr=args.lr, weight_decay=0.1)
    generator = torch.Generator().manual_seed(args.seed)  # the same batches on every rank
    total = args.batch * args.length
    rows = []
    for step in range(args.steps):
        x, y = get_batch(train_ids, args.length, args.batch, generator)
        start, exchange = time.perf_counter(), plan.stats.seconds
        share = ddp(x.view(-1)[plan.nodes], y.view(-1)[plan.nodes], plan, length=args.length, total=total)
        optimizer.zero_grad(set_to_none=True)
        (share * world).backward()  # DDP averages: the world factor makes it the sum of the shares
        torch.nn.utils.clip_grad_norm_(cp.parameters(), 1.0)
        optimizer.step()
        loss = share.detach().clone()
        dist.all_reduce(loss)
        rows.append({"step": step, "loss": float(loss), "seconds": time.perf_counter() - start,
                     "exchange_seconds": plan.stats.seconds - exchange})
        if rank == 0:
            print(f"step {step}: loss {rows[-1]['loss']:.4f}, {rows[-1]['seconds']:.2f} s", flush=True)
    cp.eval()
    with torch.no_grad():
        x, y = val_ids[: args.length].view(1, -1), val_ids[1: args.length + 1].view(1, -1)
        val_plan = context_plan(cp, batch=1, length=args.length, group=halo_group)
        val = cp(x.view(-1)[val_plan.nodes], y.view(-1)[val_plan.nodes], val_plan, length=args.length,
                 total=args.length)
        dist.all_reduce(val)
    mine = {"rank": rank, "tokens": plan.num_queries, "halo_rows": plan.halo_rows, "edges": plan.edge_index.shape[1],
            "exchange_bytes_sent": plan.stats.bytes_sent, "peak_rss_mb": _peak_rss_mb(),
            "seconds_per_step_min": min(r["seconds"] for r in rows)}
    ranks = [None] * world
    dist.all_gather_object(ranks, mine)
    if rank == 0:
        _report(args, world, rows, ranks, float(val))


def _report(args, world: int, rows, ranks, val_loss: float) -> None:
    out = Path(args.out)
    write_csv(rows, out / f"gpt_cp_{world}.csv", list(rows[0]))
    summary = {"world": world, "length": args.length, "batch": args.batch, "pattern": args.pattern,
               "window": args.window, "steps": args.steps, "first_loss": rows[0]["loss"],
               "last_loss": rows[-1]["loss"], "val_loss": val_loss, "ranks": ranks}
    (out / f"gpt_cp_{world}.json").write_text(json.dumps(summary, indent=1))
    print(f"{world} rank{'s' * (world > 1)}, {args.steps} steps of {args.batch} x {args.length} tokens: loss {rows[0]['loss']:.4f} -> "
          f"{rows[-1]['loss']:.4f}, validation loss {val_loss:.4f}")
    print(f"wrote {out / f'gpt_cp_{world}.csv'} and {out / f'gpt_cp_{world}.json'}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tgattn.distributed.gpt", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=1, help="local processes when not under torchrun (default: 1)")
    parser.add_argument("--length", type=int, default=65536, help="sequence length T (default: 65536)")
    parser.add_argument("--batch", type=int, default=1, help="sequences per step (default: 1)")
    parser.add_argument("--pattern", default="window", help="GPTConfig pattern (default: window)")
    parser.add_argument("--window", type=int, default=64, help="window radius w (default: 64)")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps (default: 30)")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default: 1e-3)")
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (default: 1)")
    parser.add_argument("--data", default=None, help="data folder (default: $TGATTN_DATA)")
    parser.add_argument("--out", default=runs_dir("distributed"), help=out_help("distributed"))
    args = parser.parse_args(argv)
    return run(parser, _load_and_launch, args)


def _load_and_launch(args) -> int:
    from ..datasets import load_tiny_shakespeare

    text = load_tiny_shakespeare(args.data)  # here, so that a missing corpus is one line
    launch(_train, args.nproc, args, text, threads=args.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
