"""Context parallel training of the tiny GPT: one long sequence split across ranks, each rank
running its own contiguous token range and fetching the key / value rows its attention reads
across a boundary (:mod:`tgattn.distributed.context_parallel`), DDP averaging the gradients::

    python -m tgattn.distributed.gpt --nproc 2 --length 65536 --steps 30
    torchrun --nproc-per-node 4 -m tgattn.distributed.gpt --length 65536 --steps 30

Writes ``<out>/gpt_cp_<world>.csv`` (one row per step: loss, seconds, exchange seconds) and
``gpt_cp_<world>.json`` (per rank: tokens, halo rows, peak RSS; the final validation loss), and
ends by printing the losses and the two paths. The arguments are checked and the corpus is
read before any process starts: a bad value, a missing corpus or an ``--out`` folder that
cannot be written ends on one line (exit 2).
A rank that is gone (killed, crashed) or stuck (stopped) ends the job within ``--timeout``
seconds (default 60), on one line naming the rank and why (:func:`tgattn.distributed.launch.spawn`).
The model is :class:`~tgattn.distributed.context_parallel.ContextParallelGPT`. torch is imported
after the arguments are parsed: ``--help`` and argument errors answer at once.
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

from .._cli import (check_writable, int_in, non_negative_int, out_help, positive_float, positive_int, run, runs_dir,
                   seed_int)
from ..models.config import PATTERNS, GPTConfig
from .launch import MAX_RANKS, PEER_TIMEOUT_S, TIMEOUT_HELP


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def train_rank(rank: int, world: int, args, text: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from ..lm.data import CharTokenizer, get_batch, split
    from ..models import GPT, GPTConfig
    from .context_parallel import ContextParallelGPT, context_plan
    from .plan import ExchangeStats

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
    from ..bench.report import write_csv

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
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="python -m tgattn.distributed.gpt", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int_in(1, MAX_RANKS), default=1,
                        help=f"local processes when not under torchrun, at most {MAX_RANKS} (default: 1)")
    parser.add_argument("--length", type=positive_int, default=65536, help="sequence length T (default: 65536)")
    parser.add_argument("--batch", type=positive_int, default=1, help="sequences per step (default: 1)")
    parser.add_argument("--pattern", default="window", choices=PATTERNS, help="GPTConfig pattern (default: window)")
    parser.add_argument("--window", type=non_negative_int, default=64, help="window radius w (default: 64)")
    parser.add_argument("--n-layer", type=positive_int, default=4)
    parser.add_argument("--n-head", type=positive_int, default=4)
    parser.add_argument("--n-embd", type=positive_int, default=128)
    parser.add_argument("--steps", type=positive_int, default=30, help="optimizer steps (default: 30)")
    parser.add_argument("--lr", type=positive_float, default=1e-3, help="AdamW learning rate (default: 1e-3)")
    parser.add_argument("--seed", type=seed_int, default=1337)
    parser.add_argument("--threads", type=positive_int, default=1, help="torch threads per rank (default: 1)")
    parser.add_argument("--timeout", type=positive_float, default=PEER_TIMEOUT_S, help=TIMEOUT_HELP)
    parser.add_argument("--data", default=None, help="data folder (default: $TGATTN_DATA)")
    parser.add_argument("--out", default=runs_dir("distributed"), help=out_help("distributed"))
    args = parser.parse_args(argv)
    try:  # the model's settings, checked before any process starts
        GPTConfig(block_size=args.length, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                  pattern=args.pattern, window=args.window)
    except ValueError as err:
        parser.error(str(err).replace("n_embd", "--n-embd").replace("n_head", "--n-head"))
    return run(parser, _load_and_launch, args)


def _load_and_launch(args) -> int:
    from ..datasets import load_tiny_shakespeare
    from .launch import launch

    text = load_tiny_shakespeare(args.data)  # here, so that a missing corpus is one line
    check_writable(args.out)  # before any rank starts: the files are written after training
    launch(train_rank, args.nproc, args, text, threads=args.threads, peer_timeout_s=args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
