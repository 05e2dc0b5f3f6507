"""Draws ``docs/images/patterns.png``: every builder's pattern at n = 32, one panel each.

Run from the repository root: ``python docs/make_gallery.py`` (needs the ``plot`` and ``models``
extras). Rows of a panel are queries i, columns keys j; a dark cell
is an edge ``(j, i)``. The selections that depend on the data (top-k, ProbSparse, the indexer,
block top-k) are made from a real model's queries and keys: all-MiniLM-L6-v2's third layer,
heads 0 and 1, on the first 30 word pieces of Tiny Shakespeare (with its [CLS] and [SEP]).
"""
from pathlib import Path

import torch

from tgattn import builders

TEXT = ("First Citizen: Before we proceed any further, hear me speak. All: Speak, speak. First Citizen: "
        "You are all resolved rather to die than to famish?")


def minilm_queries_keys(n: int, *, layer: int = 2, heads: int = 2):
    """``(q, k)``, each ``[n, heads, 32]``: all-MiniLM-L6-v2's queries and keys of ``layer`` on :data:`TEXT`'s first n tokens."""
    from transformers import AutoModel, AutoTokenizer

    from tgattn.hf import minilm_path

    path = minilm_path()
    tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()
    ids = tokenizer(TEXT, return_tensors="pt", max_length=n, truncation=True)["input_ids"]  # [1, n]
    if ids.shape[1] != n:
        raise ValueError(f"the text has {ids.shape[1]} tokens, fewer than {n}")
    attention = model.encoder.layer[layer].attention.self
    found = {}
    hooks = [module.register_forward_hook(lambda _, __, out, name=name: found.__setitem__(name, out[0]))
             for name, module in (("q", attention.query), ("k", attention.key))]
    with torch.no_grad():
        model(input_ids=ids)
    for hook in hooks:
        hook.remove()
    size = model.config.hidden_size // model.config.num_attention_heads
    return tuple(found[name].view(n, -1, size)[:, :heads] for name in ("q", "k"))  # [n, heads, 32] each


def patterns(n: int = 32):
    """(title, edge_index, n_queries, n_keys) of each pattern drawn."""
    g = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    q, k = minilm_queries_keys(n)
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
    yield "MiniLM topk(3), head 0", _head(builders.topk(q, k, 3), 0), n, n
    yield "MiniLM probsparse(c=1), head 0", _head(builders.probsparse(q, k, 1, generator=g()), 0), n, n
    # the model's two heads as the indexer's heads, its head-0 keys as the index keys, equal weights
    yield "MiniLM as indexer_topk(4)", builders.indexer_topk(q, k[:, 0], torch.ones(n, 2), 4), n, n
    yield "MiniLM block_topk(4, 3), head 0", _head(builders.block_topk(q, k, 4, 3), 0), n, n


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
