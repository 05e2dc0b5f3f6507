import networkx as nx
import numpy as np
import pytest
import torch

from analysis_cases import HAND, dense_residual, flow_oracle, random_edges, random_stack
from tgattn import builders
from tgattn.analysis import attention_flow, attention_rollout, top_flow
from tgattn.analysis.flow import flow_cone, flow_upper_bounds
from tgattn.analysis.weights import layer_csr
from tgattn.analysis.maxflow import Network


def test_hand_example():
    # Capacities A~ = rownorm(0.5 A + 0.5 I) (see test_analysis_rollout.test_hand_example):
    #   A~1 = [[1, 0, 0], [.25, .75, 0], [.25, .125, .625]]   A~2 = [[1, 0, 0], [.5, .5, 0], [0, .25, .75]]
    # Into (2, 2): in-edges (1,1) .25 and (1,2) .75; (1,1) gets (0,0) .25, (0,1) .75;
    # (1,2) gets (0,0) .25, (0,1) .125, (0,2) .625. Paths from one input share no edge, so
    #   from (0,0): min(.25, .25) + min(.25, .75) = .5
    #   from (0,1): min(.75, .25) + min(.125, .75) = .375
    #   from (0,2): min(.625, .75) = .625
    # (The three values sum to 1.5 > 1: inputs are measured one at a time, they share capacity.)
    expected = torch.tensor([0.5, 0.375, 0.625], dtype=torch.float64)
    torch.testing.assert_close(attention_flow(HAND, 2), expected, atol=1e-12, rtol=0)
    # Into (2, 1): in-edges (1,0) .5 and (1,1) .5; (1,0) gets (0,0) 1; (1,1) gets (0,0) .25, (0,1) .75
    #   from (0,0): min(1, .5) + min(.25, .5) = .75;  from (0,1): min(.75, .5) = .5;  (0,2): no path.
    torch.testing.assert_close(attention_flow(HAND, 1), torch.tensor([0.75, 0.5, 0.0], dtype=torch.float64))
    # Into (2, 0): the single path (0,0) -> (1,0) -> (2,0) of capacity 1.
    torch.testing.assert_close(attention_flow(HAND, -3), torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64))


def dense_layered_flows(dense, head="mean"):
    """Oracle: every (input, output) max flow on the full layered graph built from dense matrices."""
    n, depth = dense[0].shape[1], len(dense)
    graph = nx.DiGraph()
    graph.add_nodes_from((layer, i) for layer in range(depth + 1) for i in range(n))
    for layer, weights in enumerate(dense, start=1):
        cap = dense_residual(weights, head)
        for i in range(n):
            for j in range(n):
                if cap[i, j] > 0:
                    graph.add_edge((layer - 1, j), (layer, i), capacity=float(cap[i, j]))
    flows = torch.zeros(n, n, dtype=torch.float64)  # [output i, input j]
    for i in range(n):
        for j in range(n):
            flows[i, j] = nx.maximum_flow_value(graph, (0, j), (depth, i))
    return flows


@pytest.mark.parametrize("pattern", ["window", "random"])
def test_flow_equals_networkx_on_dense_layered_graph(pattern):
    n = 6
    make = {"window": lambda s: builders.window(n, 1), "random": lambda s: random_edges(n, 0.3, s)}[pattern]
    layers, dense = random_stack([make(s) for s in range(3)], n, heads=2, seed=1)
    expected = dense_layered_flows(dense)
    got = torch.stack([attention_flow(layers, i) for i in range(n)])
    torch.testing.assert_close(got, expected, atol=1e-10, rtol=0)


def test_flow_with_other_algorithm_and_head():
    n = 5
    layers, dense = random_stack([builders.causal(n)] * 2, n, heads=3, seed=2)
    expected = dense_layered_flows(dense, head=2)[4]
    edmonds_karp = nx.algorithms.flow.edmonds_karp
    torch.testing.assert_close(attention_flow(layers, 4, head=2, flow_func=edmonds_karp), expected, atol=1e-10, rtol=0)


def test_inputs_outside_the_cone_get_zero():
    # window(n, 1) over 2 layers: token 10 after layer 2 is reached from inputs 8..12 only.
    n = 20
    layers, _ = random_stack([builders.window(n, 1)] * 2, n, heads=1)
    flow = attention_flow(layers, 10)
    assert (flow[8:13] > 0).all() and flow[:8].eq(0).all() and flow[13:].eq(0).all()
    # A flow is at most what enters the output: the in-capacity of (2, 10), which sums to 1.
    assert float(flow.max()) <= 1 + 1e-12


def test_flow_errors():
    with pytest.raises(ValueError, match="output"):
        attention_flow(HAND, 3)
    with pytest.raises(ValueError, match="head"):
        attention_flow(HAND, 0, head="max")


@pytest.mark.slow
def test_top_flow_equals_sorting_all_flows():
    n = 12
    layers, _ = random_stack([builders.window(n, 2), random_edges(n, 0.2, 5), builders.window(n, 2)], n, heads=2)
    for output in (0, 6, 11):
        flow = attention_flow(layers, output)
        for k in (0, 1, 3, 8):
            order = sorted(range(n), key=lambda j: (-float(flow[j]), j))[:k]
            order = [j for j in order if flow[j] > 0]
            index, value = top_flow(layers, output, k)
            assert index.tolist() == order
            torch.testing.assert_close(value, flow[order], atol=1e-12, rtol=0)


def test_cut_bounds_hold_and_prune():
    n = 24
    layers, _ = random_stack([builders.window(n, 2)] * 3, n, heads=2, seed=4)
    matrices = [layer_csr(ei, alpha, n) for ei, alpha in layers]
    levels = flow_cone(matrices, 12).levels
    assert levels[-1].tolist() == [12] and levels[0].tolist() == list(range(6, 19))  # |j - 12| <= 3 w
    bound = flow_upper_bounds(matrices, levels)
    flow = attention_flow(layers, 12)[levels[0]]
    assert (flow <= bound + 1e-12).all()
    # The two outermost inputs reach the output along one path only: the bound is the flow.
    torch.testing.assert_close(bound[[0, -1]], flow[[0, -1]], atol=1e-12, rtol=0)
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return nx.algorithms.flow.boykov_kolmogorov(*args, **kwargs)

    top_flow(layers, 12, 2, flow_func=counted)
    assert 2 <= len(calls) < len(levels[0])


@pytest.mark.parametrize("depth", [3, 4])
def test_compiled_flow_equals_networkx_max_flow_on_deeper_stacks(depth):
    # SciPy's integer max-flow, refined to a certified gap of 1e-13, against networkx's float one
    n = 14
    layers, _ = random_stack([random_edges(n, 0.3, s) for s in range(depth)], n, heads=2, seed=depth)
    for output in (0, 7, 13):
        compiled = attention_flow(layers, output)
        exact = attention_flow(layers, output, flow_func=nx.algorithms.flow.edmonds_karp)
        torch.testing.assert_close(compiled, exact, atol=1e-12, rtol=0)
        index, value = top_flow(layers, output, 4)
        torch.testing.assert_close(value, exact[index], atol=1e-12, rtol=0)


def test_two_layers_in_closed_form_equal_the_max_flow_solver():
    n = 40
    layers, _ = random_stack([builders.causal(n)] * 2, n, heads=2, seed=7)
    matrices = [layer_csr(ei, alpha, n) for ei, alpha in layers]
    cone = flow_cone(matrices, 31)
    network = Network(cone.num_nodes, cone.src, cone.dst, cone.cap)
    solved = torch.tensor([network.max_flow(r, cone.num_nodes - 1) for r in range(len(cone.levels[0]))], dtype=torch.float64)
    torch.testing.assert_close(attention_flow(layers, 31)[cone.levels[0]], solved, atol=1e-12, rtol=0)


def test_the_refined_integer_max_flow_equals_networkx_on_random_graphs():
    # general graphs (cycles, long paths, capacities spread over 9 decades), not only layered cones
    rng = np.random.default_rng(0)
    worst = 0.0
    for _ in range(60):
        n = int(rng.integers(4, 25))
        pairs = {}
        for u, v in rng.integers(0, n, (4 * n, 2)).tolist():
            if u != v and (v, u) not in pairs:
                pairs[u, v] = float(rng.random() ** 9)
        src, dst = np.array([p[0] for p in pairs]), np.array([p[1] for p in pairs])
        network = Network(n, src, dst, np.array(list(pairs.values())))
        graph = nx.DiGraph()
        graph.add_nodes_from(range(n))
        graph.add_edges_from((u, v, {"capacity": c}) for (u, v), c in pairs.items())
        for s, t in ((0, n - 1), (1, 2)):
            worst = max(worst, abs(network.max_flow(s, t) - nx.maximum_flow_value(graph, s, t)))
    assert worst <= 1e-12


def test_a_gap_left_open_is_an_error_not_a_value(monkeypatch):
    from tgattn.analysis import maxflow

    network = Network(3, np.array([0, 1]), np.array([1, 2]), np.array([0.3, 0.7]))
    monkeypatch.setattr(maxflow, "MAX_ROUNDS", 0)
    with pytest.raises(RuntimeError, match=r"max-flow from 0 to 2: 0 rounds left a gap of 0.3"):
        network.max_flow(0, 2)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("depth", [1, 2, 3, 4])
def test_a_non_finite_weight_gives_nan_to_exactly_the_inputs_whose_paths_cross_it(bad, depth):
    # issue 57: the max-flow solver dropped the NaN capacity and returned finite numbers
    ei = torch.tensor([[0, 1, 2, 3, 4, 0], [1, 2, 3, 4, 4, 4]])
    alpha = torch.tensor([0.3, 0.6, bad, 0.2, 0.5, 0.3], dtype=torch.float64)
    layers = [(ei, alpha)] * depth
    for output in range(5):
        expected = flow_oracle(layers, output, 5)
        torch.testing.assert_close(attention_flow(layers, output, num_nodes=5), expected, atol=1e-12, rtol=0,
                                   equal_nan=True)
        solved = attention_flow(layers, output, num_nodes=5, flow_func=nx.algorithms.flow.edmonds_karp)
        torch.testing.assert_close(solved, expected, atol=1e-12, rtol=0, equal_nan=True)
    if depth >= 2:  # input 2 reaches token 4 only over the bad edge (2 -> 3), then 3 -> 4
        assert attention_flow(layers, 4, num_nodes=5)[2].isnan()
        assert attention_rollout(layers, num_nodes=5).to_dense()[4].isnan().any()  # as rollout says
    with pytest.raises(ValueError, match=r"layer \d: the weight of key \d -> query 3 is not finite \(nan\) on a path "
                                         r"into token 3: the flows through it are unknown"):
        top_flow(layers, 3, 2, num_nodes=5)


def test_negative_weights_are_refused_naming_the_layer_and_edge():
    from tgattn.analysis import influence_data

    ei = torch.tensor([[0, 1, 2, 3, 4, 0], [1, 2, 3, 4, 4, 4]])
    good = torch.full((6, 2), 0.5, dtype=torch.float64)
    bad = good.clone()
    bad[2, 1] = -0.5
    layers = [(ei, good), (ei, bad), (ei, good)]
    message = r"layer 1: edge 2 \(key 2 -> query 3\) has weight -0.5 in head 1: attention weights are shares"
    for call in (lambda: attention_flow(layers, 4), lambda: attention_flow(layers[:2], 4), lambda: top_flow(layers, 4, 2),
                 lambda: attention_rollout(layers), lambda: attention_rollout(layers, queries=4, residual=False),
                 lambda: influence_data(list("abcde"), layers)):
        with pytest.raises(ValueError, match=message):
            call()
    with pytest.raises(ValueError, match=r"layer 0: edge 5 \(key 0 -> query 4\) has weight -inf: "):
        attention_rollout((ei, torch.tensor([0.1] * 5 + [-float("inf")])))


def test_the_closed_form_equals_the_general_path_on_150_random_stacks():
    # issue 57: the one/two-layer shortcut crashed (a dtype mismatch) on cones without edges, 4 in 150 stacks
    g = torch.Generator().manual_seed(57)
    empty_cones = unknown = 0
    for _ in range(150):
        n, depth, heads = int(torch.randint(2, 7, (1,), generator=g)), int(torch.randint(1, 3, (1,), generator=g)), 2
        residual = bool(torch.randint(0, 2, (1,), generator=g))
        layers = []
        for _ in range(depth):
            p = [0.0, 0.2, 0.5, 1.0][int(torch.randint(0, 4, (1,), generator=g))]
            ei = builders.from_mask(torch.rand(n, n, generator=g) < p)
            alpha = torch.rand(ei.shape[1], heads, generator=g, dtype=torch.float64)
            if ei.shape[1] and torch.rand(1, generator=g) < 0.15:
                alpha[int(torch.randint(0, ei.shape[1], (1,), generator=g))] = float("nan")
            layers.append((ei, alpha))
        output = int(torch.randint(0, n, (1,), generator=g))
        shortcut = attention_flow(layers, output, num_nodes=n, residual=residual)
        general = attention_flow(layers, output, num_nodes=n, residual=residual, flow_func=nx.algorithms.flow.edmonds_karp)
        torch.testing.assert_close(shortcut, general, atol=1e-12, rtol=0, equal_nan=True)
        torch.testing.assert_close(shortcut, flow_oracle(layers, output, n, residual), atol=1e-12, rtol=0,
                                   equal_nan=True)
        empty_cones += int(not shortcut.nan_to_num(1).any())
        unknown += int(shortcut.isnan().any())
        if not shortcut.isnan().any():
            index, value = top_flow(layers, output, 3, num_nodes=n, residual=residual)
            order = sorted(range(n), key=lambda j: (-float(shortcut[j]), j))[:3]
            assert index.tolist() == [j for j in order if shortcut[j] > 0]
            torch.testing.assert_close(value, shortcut[index], atol=1e-12, rtol=0)
    assert empty_cones >= 4 and unknown >= 4  # the cases of the issue were drawn


def test_the_compiled_solver_refuses_a_capacity_it_would_drop():
    for cap in (float("nan"), float("inf"), 0.0, -0.1):
        with pytest.raises(ValueError, match=r"capacities must be finite and > 0 \(edge 1 has "):
            Network(3, np.array([0, 1]), np.array([1, 2]), np.array([0.3, cap]))
