"""Draws ``docs/images/patterns.png``: every builder's pattern at n = 32, one panel each.

Run from the repository root: ``python docs/make_gallery.py`` (needs matplotlib). Rows of a panel
are queries i, columns keys j; a dark cell is an edge ``(j, i)``.
"""
from pathlib import Path

import torch

from tgattn import builders


def patterns(n: int = 32):
    """(title, edge_index, n_queries, n_keys) of each pattern drawn."""
    g = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    q, k = torch.randn(n, 2, 8, generator=g()), torch.randn(n, 2, 8, generator=g())
    yield "full", builders.full(n), n, n
    yield "causal", builders.causal(n), n, n
    yield "window(w=3)", builders.window(n, 3), n, n
    yield "dilated(w=3, r=3)", builders.dilated(n, 3, 3), n, n
    yield "block_local(8)", builders.block_local(n, 8), n, n
    yield "strided(6, causal)", builders.strided(n, 6, causal=True), n, n
    yield "fixed(8, c=2, causal)", builders.fixed(n, 8, 2, causal=True), n, n
    yield "window(2) + global [0]", builders.union(builders.window(n, 2), builders.global_tokens(n, [0])), n, n
    yield "random(r=3)", builders.random(n, 3, generator=g()), n, n
    yield "bigbird(w=2, g=1, r=2)", builders.bigbird(n, 2, 1, 2, generator=g()), n, n
    yield "prefix_lm(8)", builders.prefix_lm(n, 8), n, n
    yield "causal([10, 14, 8]) packed", builders.causal([10, 14, 8]), n, n
    yield "cross_window(16 q, 32 k, w=2)", builders.cross_window(n // 2, n, 2), n // 2, n
    yield "topk(3) over causal, head 0", _head(builders.topk(q, k, 3, base=builders.causal(n)), 0), n, n
    yield "probsparse(c=1), head 0", _head(builders.probsparse(q, k, 1, generator=g()), 0), n, n
    indexer = g()  # one stream for the three inputs of the lightning indexer
    q_index, k_index = torch.randn(n, 2, 8, generator=indexer), torch.randn(n, 8, generator=indexer)
    weights = torch.rand(n, 2, generator=indexer)
    yield "indexer_topk(4)", builders.indexer_topk(q_index, k_index, weights, 4), n, n
    yield "block_topk(4, 3), head 0", _head(builders.block_topk(q, k, 4, 3), 0), n, n


def _head(pattern, h: int):
    """The edges head ``h`` keeps (bias 0) of a per-head pattern."""
    return pattern.edge_index[:, pattern.bias[:, h] == 0]


def main(path: Path = Path(__file__).parent / "images" / "patterns.png") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    items = list(patterns())
    cols = 5
    fig, axes = plt.subplots(-(-len(items) // cols), cols, figsize=(2.2 * cols, 2.45 * (-(-len(items) // cols))))
    for ax, (title, edge_index, n_q, n_k) in zip(axes.flat, items):
        mask = builders.to_mask(edge_index, n_q, n_k)
        ax.imshow(mask.numpy(), cmap="Greys", vmin=0, vmax=1, interpolation="nearest", aspect="auto")
        ax.set_title(f"{title}\n{int(mask.sum())} edges", fontsize=8)
        ax.set_xticks([])
        ax.set_yticks([])
    for ax in list(axes.flat)[len(items):]:
        ax.axis("off")
    fig.suptitle("attention patterns are edge sets (rows: queries i, columns: keys j)", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    main()
