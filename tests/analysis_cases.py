"""Shared inputs for the analysis tests: a hand-checked 3-token stack and random stacks."""
import networkx as nx
import torch

from tgattn import builders
from tgattn.functional import graph_attention
from tgattn.reference import dense_attention

# Three tokens, causal, one head, two layers. Edges of builders.causal(3) as (j, i):
# (0,0) (0,1) (1,1) (0,2) (1,2) (2,2). Layer attention matrices A[i, j] (rows = queries):
#   A1 = [[1, 0, 0], [.5, .5, 0], [.5, .25, .25]]      A2 = [[1, 0, 0], [1, 0, 0], [0, .5, .5]]
HAND_EDGES = builders.causal(3)
HAND_A1 = torch.tensor([1.0, 0.5, 0.5, 0.5, 0.25, 0.25], dtype=torch.float64)
HAND_A2 = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.5, 0.5], dtype=torch.float64)
HAND = [(HAND_EDGES, HAND_A1), (HAND_EDGES, HAND_A2)]


def random_stack(edge_sets, n, heads=2, seed=0):
    """Attention of random float64 projections over each edge set, sparse and dense.

    Returns ``(layers, dense)``: ``layers`` = ``[(edge_index, alpha [E, H])]`` from
    :func:`graph_attention`; ``dense`` = ``[weights [H, N, N]]`` from the dense oracle
    with the same queries and keys, so the two inputs are computed independently.
    """
    g = torch.Generator().manual_seed(seed)
    layers, dense = [], []
    for edge_index in edge_sets:
        q, k, v = (torch.randn(n, heads, 4, generator=g, dtype=torch.float64) for _ in range(3))
        _, alpha = graph_attention(q, k, v, edge_index, return_weights=True)
        _, weights = dense_attention(q, k, v, builders.to_mask(edge_index, n, n), return_weights=True)
        layers.append((edge_index, alpha))
        dense.append(weights)
    return layers, dense


def dense_residual(weights, head="mean"):
    """Abnar & Zuidema's rownorm(0.5 A + 0.5 I) from a dense [H, N, N] attention matrix."""
    a = weights.mean(0) if head == "mean" else weights[head]
    a = 0.5 * a + 0.5 * torch.eye(a.shape[0], dtype=a.dtype)
    return a / a.sum(1, keepdim=True)


def random_edges(n, p, seed):
    """A random edge set with every self-loop (so every query sees something)."""
    g = torch.Generator().manual_seed(seed)
    return builders.from_mask((torch.rand(n, n, generator=g) < p) | torch.eye(n, dtype=torch.bool))


def flow_oracle(layers, output, n, residual=True):
    """Flow into ``output`` by networkx on the dense layered graph, written here: NaN for an input with a path
    through a non-finite capacity, else the max flow over the finite edges (the others are never on its paths)."""
    depth = len(layers)
    graph, bad = nx.DiGraph(), []
    graph.add_nodes_from((layer, i) for layer in range(depth + 1) for i in range(n))
    for layer, (edge_index, alpha) in enumerate(layers, start=1):
        a = torch.zeros(n, n, dtype=torch.float64)
        a.index_put_((edge_index[1], edge_index[0]), (alpha.double()[:, None] if alpha.dim() == 1 else alpha.double()).mean(1), accumulate=True)
        edges = builders.to_mask(edge_index, n, n) | (torch.eye(n, dtype=torch.bool) if residual else False)
        if residual:
            a = 0.5 * a + 0.5 * torch.eye(n, dtype=torch.float64)
            a = a / a.sum(1, keepdim=True)
        for i, j in edges.nonzero().tolist():
            if not a[i, j] <= 0:  # positive or NaN / inf
                graph.add_edge((layer - 1, j), (layer, i), capacity=float(a[i, j]))
                if not torch.isfinite(a[i, j]):
                    bad.append(((layer - 1, j), (layer, i)))
    sink = (depth, output)
    unknown = {j for j in range(n) for tail, head in bad
               if nx.has_path(graph, (0, j), tail) and nx.has_path(graph, head, sink)}
    graph.remove_edges_from(bad)
    return torch.tensor([float("nan") if j in unknown else nx.maximum_flow_value(graph, (0, j), sink)
                         for j in range(n)], dtype=torch.float64)

