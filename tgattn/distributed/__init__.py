"""Graph attention across ``torch.distributed`` ranks, equal to one process.

Each rank owns a part of the query nodes (a :class:`Partition`: token ranges for sequences,
METIS parts for graphs) and their incoming edges. A :class:`HaloPlan` lists the key / value
rows those edges read on other ranks (the halo); :func:`halo_exchange` fetches them with one
``all_to_all_single`` (sizes exchanged first when the plan is made) and sends their gradients
back along the same routes in backward; the ordinary engine
(:func:`tgattn.functional.graph_attention`) then runs on the local edges. Outputs and
gradients equal a single process on the whole edge set (tested in float64 to 1e-10 on 2 and 4
gloo ranks). Works with gloo (CPU) and NCCL (GPU tensors); nothing is padded.

Layers take the local part: ``DistributedGraphAttention(D, H)(x_local, plan)`` and
``DistributedGraphAttentionConv``; :func:`distribute` swaps them into an existing model.

Launch (one process per rank; ``torchrun`` sets the rendezvous variables)::

    torchrun --nproc-per-node 4 -m tgattn.distributed.gnn             # DDP GAT on partitioned Cora
    torchrun --nproc-per-node 4 -m tgattn.distributed.gpt --length 65536  # context-parallel GPT
    python -m tgattn.distributed.gnn --nproc 2                        # same, local gloo processes
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29500 -m tgattn.distributed.gpt         # two machines, NCCL

In a script of your own::

    rank, world = tgattn.distributed.init()                  # gloo, or NCCL with a GPU per rank
    part = contiguous(n, world)                              # or partition_graph(edge_index, n, world)
    plan = make_plan(part.local_edges(edge_index, rank), part)  # collective
    out = layer(x[plan.nodes], plan)                         # this rank's rows, in plan.nodes order

Measurements (halo vs ring bytes, time split, memory per rank, partition quality) and the
multi-node plan (NCCL, overlap, partitions, halo vs ring): ``data/distributed/PLAN.md``;
benchmark: ``python -m tgattn.bench.distributed``.

Example:
    >>> from tgattn import builders
    >>> from tgattn.distributed import contiguous, make_plans
    >>> part = contiguous(12, 3)
    >>> [p.halo_rows for p in make_plans(builders.window(12, 2, causal=True), part)]  # w rows per boundary
    [0, 2, 2]

Layer "applications" (with models, lm, hf, distributed, analysis, verify): built on the layers
below, never importing a benchmark or a command line (docs/conventions.md, "Layering"). Its command lines
(:mod:`tgattn.distributed.gnn`, :mod:`tgattn.distributed.gpt`) sit with the benchmarks.
"""
from .._cli import lazy_exports
from .launch import init, launch, spawn  # here, not lazily: the function launch shares its module's name

__all__ = [
    "DistributedGraphAttention",
    "DistributedGraphAttentionConv",
    "ExchangeStats",
    "HaloPlan",
    "Partition",
    "bandwidth",
    "contiguous",
    "distribute",
    "exchange_keys_values",
    "graph_attention",
    "halo_exchange",
    "halo_rows",
    "louvain",
    "init",
    "launch",
    "make_plan",
    "make_plans",
    "metis",
    "partition_graph",
    "spawn",
]

# The rest is imported on first use (tgattn._cli.lazy_exports): the command lines answer --help before torch is imported.
__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        **dict.fromkeys(["exchange_keys_values", "graph_attention"], "attention"),
        "halo_exchange": "exchange",
        **dict.fromkeys(["DistributedGraphAttention", "DistributedGraphAttentionConv", "distribute"], "nn"),
        **dict.fromkeys(["Partition", "bandwidth", "contiguous", "halo_rows", "louvain", "metis", "partition_graph"],
                        "partition"),
        **dict.fromkeys(["ExchangeStats", "HaloPlan", "make_plan", "make_plans"], "plan"),
    },
)
