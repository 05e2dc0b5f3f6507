"""The per-rank side of tests/test_distributed_spawn.py: every case against one process.

Each rank computes the single-process result itself (same seeds), runs the distributed twin
on its part, and reports per case the largest absolute difference of outputs and gradients
(its own rows; parameter gradients summed over ranks), plus the halo rows it received
against the minimum the partition allows. One job of 4 ranks runs the cases twice: on all 4
(the default group) and on ranks 0 and 1 (a subgroup), so one spawn covers both world sizes.
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from tgattn import GraphAttention, GraphAttentionConv, builders
from tgattn.functional import graph_attention as single_attention
from tgattn.distributed import (DistributedGraphAttention, ExchangeStats, Partition, contiguous, graph_attention,
                                halo_rows, make_plan, partition_graph)

H, D = 2, 4
DT = torch.float64


def _err(a, b) -> float:
    return float((a - b).detach().abs().max()) if a.numel() else 0.0


def _param_err(dist_model, single_model, group) -> float:
    worst = 0.0
    for p, q in zip(dist_model.parameters(), single_model.parameters()):
        grad = p.grad.clone()
        dist.all_reduce(grad, group=group)
        worst = max(worst, _err(grad, q.grad))
    return worst


def attention_case(edge_index, part: Partition, rank: int, group, *, with_bias: bool = False, seed: int = 0):
    """Functional attention: outputs and the gradients of q, k, v (and bias) vs one process."""
    n = part.num_nodes
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(n, H, D, generator=g, dtype=DT, requires_grad=True) for _ in range(3))
    grad_out = torch.randn(n, H, D, generator=g, dtype=DT)
    bias = torch.randn(edge_index.shape[1], H, generator=g, dtype=DT, requires_grad=True) if with_bias else None
    single_attention(q, k, v, edge_index, bias=bias).backward(grad_out)
    mine = part.owner[edge_index[1]] == rank
    plan = make_plan(edge_index[:, mine], part, group=group)
    plan.stats = ExchangeStats()
    nodes = plan.nodes
    ql, kl, vl = (t.detach()[nodes].clone().requires_grad_() for t in (q, k, v))
    bl = bias.detach()[mine].clone().requires_grad_() if with_bias else None
    out = graph_attention(ql, kl, vl, plan, bias=bl)
    out.backward(grad_out[nodes])
    with torch.no_grad():
        ref = single_attention(q, k, v, edge_index, bias=bias)
    errs = [_err(out, ref[nodes])] + [_err(a.grad, b.grad[nodes]) for a, b in ((ql, q), (kl, k), (vl, v))]
    if with_bias:
        errs.append(_err(bl.grad, bias.grad[mine]))
    minimum = halo_rows(edge_index, part)[rank]
    # rows received: the halo in forward, then the gradients of the rows this rank sent
    return {"err": max(errs), "halo": plan.halo_rows, "minimum": minimum, "sent": plan.send_index.numel(),
            "received": plan.stats.rows_received, "calls": plan.stats.calls}


def layer_case(part: Partition, rank: int, group):
    """DistributedGraphAttention vs GraphAttention: outputs, input and parameter gradients."""
    n = part.num_nodes
    edge_index = builders.window(n, 3)
    torch.manual_seed(0)  # the same weights on every rank
    single = GraphAttention(H * D, H).to(DT)
    mine = DistributedGraphAttention.from_layer(single)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, H * D, generator=g, dtype=DT, requires_grad=True)
    grad_out = torch.randn(n, H * D, generator=g, dtype=DT)
    single(x, edge_index).backward(grad_out)
    plan = make_plan(part.local_edges(edge_index, rank), part, group=group)
    xl = x.detach()[plan.nodes].clone().requires_grad_()
    out, (edges, alpha) = mine(xl, plan, return_attention_weights=True)
    out.backward(grad_out[plan.nodes])
    with torch.no_grad():
        ref, (_, ref_alpha) = single(x, edge_index, return_attention_weights=True)
    keep = part.owner[edge_index[1]] == rank
    errs = [_err(out, ref[plan.nodes]), _err(xl.grad, x.grad[plan.nodes]), _param_err(mine, single, group),
            _err(alpha, ref_alpha[keep]), float((edges != edge_index[:, keep]).sum())]
    return {"err": max(errs)}


def conv_case(data, part: Partition, rank: int, group):
    """DistributedGraphAttentionConv vs GraphAttentionConv on Cora, edge features included."""
    from tgattn.distributed.gnn import graph_with_loops
    from tgattn.distributed.nn import DistributedGraphAttentionConv

    edge_index = graph_with_loops(data)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(data.num_nodes, 6, generator=g, dtype=DT, requires_grad=True)
    attr = torch.randn(edge_index.shape[1], 3, generator=g, dtype=DT)
    torch.manual_seed(0)  # the same weights on every rank
    single = GraphAttentionConv(6, D, H, edge_dim=3).to(DT)
    mine = DistributedGraphAttentionConv.from_conv(single)
    grad_out = torch.randn(data.num_nodes, H * D, generator=g, dtype=DT)
    single(x, edge_index, attr).backward(grad_out)
    keep = part.owner[edge_index[1]] == rank
    plan = make_plan(edge_index[:, keep], part, group=group)
    xl = x.detach()[plan.nodes].clone().requires_grad_()
    out = mine(xl, plan, attr[keep])
    out.backward(grad_out[plan.nodes])
    with torch.no_grad():
        ref = single(x, edge_index, attr)
    return {"err": max(_err(out, ref[plan.nodes]), _err(xl.grad, x.grad[plan.nodes]), _param_err(mine, single, group))}


def gpt_case(world: int, group, halo_group):
    """One context-parallel step through DDP vs the single-process GPT: loss and gradients."""
    from torch.nn.parallel import DistributedDataParallel

    from tgattn.distributed.context_parallel import ContextParallelGPT, context_plan
    from tgattn.models import GPT, GPTConfig

    torch.manual_seed(0)
    b, t = 2, 24
    config = GPTConfig(block_size=t, vocab_size=11, n_layer=2, n_head=2, n_embd=8, pattern="bigbird", window=3,
                       num_random=2)
    single = GPT(config).to(DT)
    cp = ContextParallelGPT(copy.deepcopy(single))
    idx = torch.randint(11, (b, t), generator=torch.Generator().manual_seed(3))
    targets = torch.roll(idx, -1, dims=1)
    _, loss = single(idx, targets)
    loss.backward()
    plan = context_plan(cp, batch=b, length=t, group=halo_group)
    ddp = DistributedDataParallel(cp, process_group=group)
    share = ddp(idx.view(-1)[plan.nodes], targets.view(-1)[plan.nodes], plan, length=t, total=b * t)
    (share * world).backward()
    total = share.detach().clone()
    dist.all_reduce(total, group=group)
    errs = [_err(total, loss.detach())]
    for p, q in zip(cp.model.parameters(), single.parameters()):  # DDP already averaged the gradients
        errs.append(_err(p.grad, q.grad))
    return {"err": max(errs)}


def gnn_case(data, part: Partition, rank: int, world: int, group, halo_group):
    """One DDP step of the GAT-protocol network (dropout off) vs one process on Cora."""
    from torch.nn.parallel import DistributedDataParallel

    from tgattn.bench.models import Net, prepare
    from tgattn.distributed.gnn import distributed_net, graph_with_loops, loss_share, shard

    torch.manual_seed(0)
    single = Net(lambda i, o, h, c: GraphAttentionConv(i, o, h, concat=c, dropout=0.0, root_weight=False),
                 data.num_features, 7, dropout=0.0).to(DT)
    mine = distributed_net(data.num_features, 7, dropout=0.0).to(DT)
    mine.load_state_dict(single.state_dict())
    x = prepare(data).x.to_dense().to(DT)
    loss = torch.nn.functional.cross_entropy(single(x, graph_with_loops(data))[data.train_mask], data.y[data.train_mask])
    loss.backward()
    plan, rows = shard(data, part, rank, group=halo_group)
    rows["x"] = rows["x"].to(DT)
    ddp = DistributedDataParallel(mine, process_group=group)
    share = loss_share(ddp(rows["x"], plan), rows, "train", int(data.train_mask.sum()))
    (share * world).backward()
    total = share.detach().clone()
    dist.all_reduce(total, group=group)
    errs = [_err(total, loss.detach())] + [_err(p.grad, q.grad) for p, q in zip(mine.parameters(), single.parameters())]
    return {"err": max(errs)}


def run_cases(group, halo_group, data):
    """Every case on this rank of ``group``; ``{case: {"err": ..., ...}}``."""
    from tgattn.distributed.gnn import graph_with_loops

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    n = 60
    gen = torch.Generator().manual_seed(0)
    seq = contiguous(n, world)
    results = {
        "window": attention_case(builders.window(n, 3), seq, rank, group, with_bias=True),
        "bigbird": attention_case(builders.bigbird(n, 2, 1, 2, generator=gen), seq, rank, group),
        "random": attention_case(builders.random(n, 3, generator=gen), seq, rank, group),
        "causal": attention_case(builders.causal(n), seq, rank, group),
    }
    owner = torch.randint(world - 1, (n,), generator=gen)
    owner = owner + (owner >= 1).long()  # rank 1 owns nothing: it only sends
    results["empty_rank"] = attention_case(builders.window(n, 2), Partition(owner, world), rank, group)
    part = partition_graph(data.edge_index, data.num_nodes, world)
    results["cora"] = attention_case(graph_with_loops(data), part, rank, group)
    results["cora"]["method"] = part.method
    results["layer"] = layer_case(seq, rank, group)
    results["conv"] = conv_case(data, part, rank, group)
    results["gpt"] = gpt_case(world, group, halo_group)
    results["gnn"] = gnn_case(data, part, rank, world, group, halo_group)
    return results


def run_job(rank: int, world: int, data_root: str):
    """``{4: results on all ranks, 2: results on ranks 0 and 1}`` (this rank's part of them)."""
    from tgattn.datasets import load_planetoid

    data = load_planetoid("Cora", data_root)
    # new_group is collective over the default group: every rank creates every group
    pair, pair_halo, halo = dist.new_group([0, 1]), dist.new_group([0, 1]), dist.new_group()
    results = {world: run_cases(dist.group.WORLD, halo, data)}
    if rank < 2:
        results[2] = run_cases(pair, pair_halo, data)
    dist.barrier()
    return results


def rank_one_fails(rank: int, world: int, how: str) -> float:
    """Rank 1 ends as ``how`` says (``"kill"``: SIGKILL, ``"stop"``: SIGSTOP, ``"raise"``: ValueError)
    while the others wait for it in an all-reduce (tests/test_distributed_hangs.py)."""
    import os
    import signal

    if rank == 1:
        if how == "raise":
            raise ValueError("rank one's own error")
        os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    total = torch.ones(1)
    dist.all_reduce(total)
    return float(total)
