"""Packed sequences and FlashAttention's variable-length kernel, for the GPU benchmark.

:func:`packed_patterns` are block-diagonal causal and full sets over documents of random
lengths (what LM training with document masking attends over). :func:`varlen_rows` times
``torch.nn.attention.varlen.varlen_attn`` (FlashAttention's variable-length kernel, Dao 2023)
against tgattn on the same bfloat16 inputs (the kernel runs half precision only) on the packed
sets and on sliding windows, which it takes as ``window_size``.
"""
from __future__ import annotations

from typing import Dict, List, Sequence

import torch

from ... import builders
from ..patterns import Pattern
from ..report import _index

PACKED_LENGTHS = (256, 2048)  # document lengths of the packed sets (uniform, inclusive)


def document_lengths(n: int, lo: int, hi: int, seed: int = 0) -> List[int]:
    """Lengths drawn uniformly from ``lo..hi`` that sum to ``n`` (the last one cut short).

    Example:
        >>> lengths = document_lengths(1000, 100, 300)
        >>> sum(lengths), all(0 < x <= 300 for x in lengths)
        (1000, True)
    """
    g = torch.Generator().manual_seed(seed)
    out: List[int] = []
    while sum(out) < n:
        out.append(min(int(torch.randint(lo, hi + 1, (), generator=g)), n - sum(out)))
    return out


def packed_patterns(lengths=PACKED_LENGTHS) -> Dict[str, Pattern]:
    """``packed_causal`` and ``packed_full``: block-diagonal sets over documents whose lengths
    are drawn from ``lengths`` (no FlexAttention ``mask_mod``: the ``flex_csr`` peer covers Flex)."""
    return {
        f"packed_{kind}": Pattern(f"packed_{kind}", lambda n, make=make: make(document_lengths(n, *lengths)))
        for kind, make in (("causal", builders.causal), ("full", builders.full))
    }


def _varlen_call(edge_index: torch.Tensor, n: int, name: str):
    """``(cu_seq [B + 1], longest, window_size)`` of FlashAttention's varlen kernel for this
    edge set (packed causal / full sets from the engine's analysis, ``windowW`` by name), or ``None``."""
    from ...engine import structure_of

    s = structure_of(edge_index, n, n)
    if s.kind in ("full", "causal", "packed_full", "packed_causal"):
        lengths = list(s.lengths or (n,))
        window = (-1, 0) if s.kind.endswith("causal") else (-1, -1)
    elif name.startswith("window") and name[6:].isdigit():
        w = int(name[6:])
        if not (w < n and s.intervals and s.num_edges == n * (2 * w + 1) - w * (w + 1)):  # |i - j| <= w
            return None
        lengths, window = [n], (w, w)
    else:
        return None
    cu = torch.tensor([0] + lengths, device=edge_index.device).cumsum(0).to(torch.int32)
    return cu, max(lengths), window


def varlen_rows(
    patterns: Dict[str, Pattern],
    sizes: Dict[str, Sequence[int]],
    device,
    *,
    heads: int = 8,
    dim: int = 64,
    repeats: int = 3,
    budget_s: float = 10.0,
) -> List[dict]:
    """``varlen_bf16`` (``torch.nn.attention.varlen.varlen_attn``) and ``tgattn_bf16``
    (:func:`~tgattn.functional.graph_attention`, ``auto``) on the same bfloat16 inputs, forward
    and forward+backward, for the patterns the kernel can express. The ``note`` of a varlen row
    gives its largest difference from tgattn's output (or why it did not run)."""
    from ...functional import graph_attention
    from ..measure import best_time

    rows = []
    for name, pattern in patterns.items():
        for n in sizes[name]:
            edge_index = pattern.make(n).to(device)
            call = _varlen_call(edge_index, n, name)
            if call is None:
                continue
            g = torch.Generator().manual_seed(0)
            q, k, v, grad = (torch.randn(n, heads, dim, generator=g).to(device, torch.bfloat16) for _ in range(4))
            leaves = [t.requires_grad_() for t in (q, k, v)]
            base = dict(pattern=name, n=n, edges=edge_index.shape[1], density=edge_index.shape[1] / n**2, heads=heads, dim=dim)
            ours = lambda: graph_attention(q, k, v, edge_index)  # noqa: E731
            peers = {"tgattn_bf16": ours, "varlen_bf16": None}
            note = ""
            try:
                from torch.nn.attention.varlen import varlen_attn

                cu, longest, window = call
                theirs = lambda: varlen_attn(q, k, v, cu, cu, longest, longest, window_size=window)  # noqa: E731
                with torch.no_grad():
                    note = f"max |diff| vs tgattn {float((theirs().float() - ours().float()).abs().max()):.1e}"
                peers["varlen_bf16"] = theirs
            except Exception as err:  # no torch.nn.attention.varlen, or a device / dtype it does not take
                note = f"unavailable: {type(err).__name__}: {str(err)[:60]}"
            for peer, fn in peers.items():
                for backward in (False, True):
                    row = dict(base, peer=peer, mode="fwd+bwd" if backward else "fwd", ms=None, peak_mb=None,
                               note=note if peer == "varlen_bf16" else "")
                    rows.append(row)
                    if fn is None:
                        continue
                    try:
                        row["ms"] = best_time(fn, backward, leaves, grad, repeats=repeats, budget_s=budget_s)
                    except Exception as err:  # e.g. out of memory at the largest n
                        row["note"] = f"failed: {type(err).__name__}: {str(err)[:80]}"
    return rows


def varlen_table(rows: List[dict]) -> str:
    """``varlen_bf16`` time / ``tgattn_bf16`` time per pattern, n and mode (> 1: tgattn faster)."""
    idx = _index(rows)
    lines = [f"{'bfloat16':<16}{'n':>9} {'mode':<8}{'varlen / tgattn':>16}"]
    for (pattern, n, mode, peer), row in sorted(idx.items()):
        if peer == "tgattn_bf16" and row.get("ms"):
            theirs = idx.get((pattern, n, mode, "varlen_bf16"), {}).get("ms")
            shown = f"{theirs / row['ms']:.2f}x" if theirs else "n/a"
            lines.append(f"{pattern:<16}{n:>9} {mode:<8}{shown:>16}")
    return "\n".join(lines)
