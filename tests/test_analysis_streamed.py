"""The page data made block by block (tgattn.analysis.streamed, random_layers, budget.estimate_memory): the same
kept keys as the whole layers, checked against dense softmax + top-k, and a peak memory that follows what is
kept (issue 57, item 10: 10,000 causal tokens took >= 9.5 GB)."""
import subprocess
import sys

import pytest
import torch

from analysis_cases import dense_residual, flow_oracle, random_stack
from tgattn import builders
from tgattn.__main__ import main
from tgattn.analysis import influence_data, kept_edges, kept_rollout
from tgattn.analysis.budget import estimate_memory, key_ranges
from tgattn.analysis.random_layers import random_attention, random_attention_blocks
from tgattn.analysis.rollout import TILE
from tgattn.analysis.show import PATTERNS, pattern_edges
from tgattn.analysis.streamed import Block, streamed_influence_data
from conftest import one_line_error


def blocks_of(layers, n):
    """Whole layers (edges sorted by query) cut into the streamed blocks of TILE queries."""
    for number, (edge_index, alpha) in enumerate(layers):
        for start in range(0, n, TILE):
            rows = (edge_index[1] >= start) & (edge_index[1] < start + TILE)
            yield Block(number, start, edge_index[:, rows], alpha[rows])


def top_of(row: torch.Tensor, k: int, threshold: float) -> dict:
    """Oracle: the k largest entries >= threshold of a dense row (ties to the smaller key, as sorting gives)."""
    order = sorted(range(len(row)), key=lambda j: (-float(row[j]), j))[:k]
    return {j: float(row[j]) for j in order if row[j] >= threshold and row[j] > 0}


def as_dict(index, weight):
    return {(int(i), int(j)): float(w) for j, i, w in zip(index[0], index[1], weight)}


@pytest.mark.parametrize("pattern, depth", [("causal", 2), ("window", 3), ("causal_window", 1), ("full", 2)])
def test_streamed_top_keys_rollout_and_flow_equal_dense_softmax_and_top_k(pattern, depth):
    n, top_k, threshold = 150, 4, 0.01  # two blocks of queries
    edges = pattern_edges(pattern, n, window=3)
    layers, dense = random_stack([edges] * depth, n, heads=2, seed=5)  # dense: softmax of the dense oracle [H, N, N]
    data = streamed_influence_data([f"t{i}" for i in range(n)], blocks_of(layers, n), heads=[2] * depth,
                                   key_ranges=key_ranges(pattern, n, 3), query=n - 7, top_k=top_k, threshold=threshold)
    for layer, weights in enumerate(dense):
        for head, matrix in (("mean", weights.mean(0)), (0, weights[0]), (1, weights[1])):
            got = as_dict(*kept_edges(data, layer, head))
            expected = {(i, j): w for i in range(n) for j, w in top_of(matrix[i], top_k, threshold).items()}
            assert got.keys() == expected.keys()
            for pair, w in got.items():  # 16-bit quantisation of each row's largest kept weight
                assert abs(w - expected[pair]) <= 8e-6 * float(matrix[pair[0]].max())
            lost = data["pruned"][layer][0 if head == "mean" else head + 1]
            assert lost["edges"] == edges.shape[1] - len(got)
            assert lost["total"] == pytest.approx(float(matrix.sum()), abs=1e-9)
    rollout = torch.eye(n, dtype=torch.float64)
    for weights in dense:
        rollout = dense_residual(weights) @ rollout
    got = as_dict(*kept_rollout(data))
    expected = {(i, j): w for i in range(n) for j, w in top_of(rollout[i], top_k, threshold).items()}
    assert got.keys() == expected.keys()
    assert max(abs(w - expected[p]) / float(rollout[p[0]].max()) for p, w in got.items()) <= 8e-6
    flow = data["flow"]
    if depth <= 2:  # the closed form, written densely: sum_m min(A1[m, j], A2[o, m])
        first, last = dense_residual(dense[0]), dense_residual(dense[-1])[n - 7]
        exact = last if depth == 1 else torch.minimum(first, last[:, None]).sum(0)
    else:  # networkx's max-flow on the layered graph (window: a small cone)
        exact = flow_oracle(layers, n - 7, n)
    order = [j for j in sorted(range(n), key=lambda j: (-float(exact[j]), j))[:top_k] if exact[j] > 0]
    assert flow["token"] == n - 7 and flow["index"] == order
    torch.testing.assert_close(torch.tensor(flow["value"], dtype=torch.float64), exact[order], atol=1e-12, rtol=0)


@pytest.mark.parametrize("pattern", PATTERNS)
def test_the_blocks_hold_the_patterns_edges_and_the_whole_layers_weights(pattern):
    n = 300
    tokens = [f"w{i % 13}" for i in range(n)]
    whole = random_attention(tokens, pattern_edges(pattern, n, window=2), layers=2, heads=2)
    blocks = list(random_attention_blocks(tokens, pattern, window=2, layers=2, heads=2))
    assert [(b.layer, b.start) for b in blocks] == [(l, s) for l in range(2) for s in range(0, n, TILE)]
    for layer, (edge_index, alpha) in enumerate(whole):
        mine = [b for b in blocks if b.layer == layer]
        assert torch.equal(torch.cat([b.edge_index for b in mine], 1), edge_index)  # the builder's edges, in order
        torch.testing.assert_close(torch.cat([b.alpha for b in mine]), alpha, atol=1e-6, rtol=0)


def test_show_html_streams_the_same_data_as_the_whole_layers(tmp_path):
    n = 400
    words = [f"w{i % 23}" for i in range(n)]
    out = tmp_path / "data.json"
    assert main(["show", "--text", " ".join(words), "--json", str(out), "--keep", "5"]) == 0
    from tgattn.analysis import load_influence

    streamed = load_influence(out)
    whole = influence_data(words, random_attention(words, builders.causal(n)), query=n - 1, top_k=5,
                           title=streamed["title"])
    for layer in range(2):
        for head in ("mean", 0, 1):
            a, b = kept_edges(streamed, layer, head), kept_edges(whole, layer, head)
            assert torch.equal(a[0], b[0]) and torch.allclose(a[1], b[1], atol=1e-5, rtol=0)
    assert torch.equal(kept_rollout(streamed)[0], kept_rollout(whole)[0])
    assert streamed["flow"]["index"] == whole["flow"]["index"]


def test_the_memory_estimate_counts_the_rollout_band():
    from tgattn.analysis.budget import BASE_BYTES, EDGE_BYTES, estimate_bytes

    n = 1000
    blocks = [(s, min(s + TILE, n)) for s in range(0, n, TILE)]

    def expected(layers, band, block_edges):
        return BASE_BYTES + band + EDGE_BYTES * block_edges + 4 * estimate_bytes(n, layers, 2, 10)

    # causal: the tile of a block of rows spans keys 0 .. its last row, after any number of layers; 8 bytes an entry
    causal = sum(8 * (t - s) * t for s, t in blocks)
    widest = max(sum(i + 1 for i in range(s, t)) for s, t in blocks)  # the block with most edges: rows 768 .. 895
    assert estimate_memory(n, 1, 2, 10, "causal") == expected(1, 0, widest)  # one layer: its tiles pruned as made
    assert estimate_memory(n, 2, 2, 10, "causal") == expected(2, causal, widest)  # one layer of tiles kept
    assert estimate_memory(n, 3, 2, 10, "causal") == expected(3, 2 * causal, widest)  # two, while the third is made
    # window(2): after l layers a block's tile spans its rows +- 2 l
    def band(l):
        return sum(8 * (t - s) * (min(t + 2 * l, n) - max(s - 2 * l, 0)) for s, t in blocks)
    widest = max(sum(min(i + 3, n) - max(i - 2, 0) for i in range(s, t)) for s, t in blocks)  # 5 keys a row: 640
    assert widest == 640 and estimate_memory(n, 3, 2, 10, "window", 2) == expected(3, band(1) + band(2), widest)


def test_a_page_over_the_memory_budget_is_refused_before_any_work(cli, tmp_path):
    text = " ".join(["word"] * 20_000)
    status, err = cli(main, ["show", "--text", text, "--html", str(tmp_path / "p.html"), "--max-memory-gb", "1"])
    gb = estimate_memory(20_000, 2, 2, 10, "causal") / 1e9
    assert status == 2 and one_line_error(err, "python -m tgattn show").startswith(
        f"the page data would take about {gb:.1f} GB of memory at its peak (20000 tokens, causal pattern, 2 layers")


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_the_peak_memory_of_a_3000_token_page_stays_under_its_estimate(tmp_path):
    # a separate process, its peak RSS read from the kernel: 1.53 GB before streaming (whole layers). VmHWM, the
    # high-water mark of the process's own memory map, not ru_maxrss, which Linux carries over exec from the
    # parent's map (a pytest worker of 1.3 GB made the probe read 1.27 GB)
    n = 3000
    words = " ".join(f"w{i % 101}" for i in range(n))
    probe = ("import re, sys; from tgattn.__main__ import main; "
             f"main(['show', '--text', {words!r}, '--html', sys.argv[1]]); "
             "print(int(re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read()).group(1)) * 1024)")
    run = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "p.html")], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr
    peak = int(run.stdout.split()[-1])
    assert peak <= estimate_memory(n, 2, 2, 10, "causal"), f"peak {peak / 1e9:.2f} GB"
