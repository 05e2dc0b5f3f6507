"""``python -m tgattn.bench.hf``: a tiny random Mistral or Gemma 2 at long context, tgattn against transformers.

One forward (prefill, batch 1, no gradient) of a seeded random ``MistralModel`` (or, with
``--model gemma2``, a ``Gemma2Model`` whose every layer is a sliding window with logit
soft-capping at 50, Gemma 2's value) whose own
pattern is a causal sliding window (``sliding_window = W``: W keys per query), with
transformers' ``sdpa`` and ``eager`` attention (both build the ``n x n`` mask) and with
``attn_implementation="tgattn"`` (the same window as an edge set, ``n W`` edges). Per run:
the best wall time over ``--repeats``, the peak bytes of tensors the forward creates
(counted by storage as operators create and free them, :mod:`tgattn.bench.measure`), and
the peak RSS over the RSS before (the operating system's view). Peers whose ``n x n`` mask
alone exceeds ``--mask-gb`` are skipped and say so in the CSV.

Examples::

    python -m tgattn.bench.hf --sizes 2048 8192 --no-progress      # a minute
    python -m tgattn.bench.hf                                       # 4k .. 128k tokens
    python -m tgattn.bench.hf --model gemma2 --window 4096 --sizes 1024 4096 16384
"""
from __future__ import annotations

import argparse
import gc
import os
import platform
import sys
from pathlib import Path

from .._cli import non_negative_float, out_help, runs_dir

FIELDS = ("peer", "n", "window", "edges", "ms", "tensor_mb", "rss_mb", "load", "note")
PEERS = ("tgattn", "sdpa", "eager")


MODELS = ("mistral", "gemma2")
SOFTCAP = 50.0  # Gemma 2's attn_logit_softcapping


def tiny_model(window: int, max_length: int, *, model: str = "mistral", layers: int = 2, hidden: int = 128,
               heads: int = 4, kv_heads: int = 2, seed: int = 0):
    """A seeded random ``MistralModel`` (grouped-query attention, RoPE, sliding window ``window``), or a
    ``Gemma2Model`` of the same sizes whose layers are all sliding windows, with soft-capped logits."""
    import torch
    import transformers

    common = dict(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, sliding_window=window,
                  max_position_embeddings=max_length)
    if model == "gemma2":
        config = transformers.Gemma2Config(**common, head_dim=hidden // heads, attn_logit_softcapping=SOFTCAP,
                                           layer_types=["sliding_attention"] * layers)
        cls = transformers.Gemma2Model
    else:
        config, cls = transformers.MistralConfig(**common), transformers.MistralModel
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return cls(config).eval()


def measure(model, peer: str, n: int, *, repeats: int, budget_s: float = 60.0) -> dict:
    """Time and peak memory of one forward of ``model`` with attention ``peer`` over ``n`` tokens."""
    import torch

    from .measure import _LiveBytes, best_time, reset_rss_high_water, rss_high_water_mb, rss_mb

    model.set_attn_implementation(peer)
    ids = torch.randint(model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(n))

    def forward():
        return model(input_ids=ids, use_cache=False).last_hidden_state

    gc.collect()
    reset_rss_high_water()
    before = rss_mb()
    with torch.no_grad(), _LiveBytes() as probe:
        forward()
    rss = rss_high_water_mb() - before
    ms = best_time(forward, False, [], None, repeats=repeats, budget_s=budget_s)
    return {"ms": ms, "tensor_mb": probe.peak / 2**20, "rss_mb": rss}


def run(sizes, window: int, peers, *, repeats: int = 3, mask_gb: float = 2.0, progress: bool = True, **model_kw):
    """One row per (n, peer): measured, or skipped with the reason."""
    from tqdm.auto import tqdm
    import tgattn.hf

    tgattn.hf.register()
    model = tiny_model(window, max(sizes), **model_kw)
    measure(model, "tgattn", 64, repeats=1)  # one-time costs (kernel library, thread pools) out of the way
    rows = []
    for n in tqdm(sorted(sizes), desc="hf bench", disable=not progress):
        edges = n * window - window * (window - 1) // 2 if n >= window else n * (n + 1) // 2
        for peer in peers:
            row = {"peer": peer, "n": n, "window": window, "edges": edges, "load": round(os.getloadavg()[0], 1)}
            mask_bytes = n * n * (1 if peer == "sdpa" else 4)  # bool for sdpa, float for eager
            if peer == "sdpa" and not model._supports_sdpa:
                row["note"] = f"skipped: transformers has no sdpa attention for {type(model).__name__}"
            elif peer != "tgattn" and mask_bytes > mask_gb * 2**30:
                row["note"] = f"skipped: the n x n mask alone is {mask_bytes / 2**30:.1f} GB (--mask-gb {mask_gb})"
            else:
                row.update(measure(model, peer, n, repeats=repeats))
            rows.append(row)
    return rows


def table(rows) -> str:
    head = f"{'n':>7} {'peer':<7} {'edges':>10} {'ms':>10} {'tensor MB':>10} {'RSS MB':>9} {'load':>5}  note"
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = [f"{r[k]:>10.1f}" if r.get(k) is not None else f"{'-':>10}" for k in ("ms", "tensor_mb", "rss_mb")]
        lines.append(f"{r['n']:>7} {r['peer']:<7} {r['edges']:>10} {' '.join(cells)} {r['load']:>5}  {r.get('note') or ''}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="python -m tgattn.bench.hf", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", type=int, default=[4096, 16384, 32768, 65536, 131072], help="tokens")
    parser.add_argument("--model", default="mistral", choices=MODELS,
                        help="mistral, or gemma2 (every layer a window, logits soft-capped at 50) (default: mistral)")
    parser.add_argument("--window", type=int, default=256, help="the model's sliding_window W (default: 256)")
    parser.add_argument("--peers", nargs="+", default=list(PEERS), choices=PEERS, help="attention implementations")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (default: 2)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs; the minimum is kept (default: 3)")
    parser.add_argument("--mask-gb", type=non_negative_float, default=2.0, help="skip sdpa / eager when the n x n mask exceeds this")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--out", type=Path, default=runs_dir("hf"), help=out_help("hf"))
    args = parser.parse_args(argv)
    # imported once the arguments parse: --help and argument errors answer without torch
    import torch

    from .report import write_csv

    torch.set_num_threads(args.threads)
    rows = run(args.sizes, args.window, args.peers, repeats=args.repeats, mask_gb=args.mask_gb,
               progress=not args.no_progress, layers=args.layers, model=args.model)
    name = "hf_long_context.csv" if args.model == "mistral" else f"hf_long_context_{args.model}.csv"
    write_csv(rows, args.out / name, FIELDS)
    kind = "MistralModel" if args.model == "mistral" else f"Gemma2Model (softcap {SOFTCAP:g}, every layer sliding)"
    print(f"torch {torch.__version__}, {args.threads} threads, {platform.processor() or platform.machine()}; "
          f"{kind} {args.layers} layers, hidden 128, 4 query / 2 key-value heads, sliding_window {args.window}, "
          f"fp32, batch 1, forward without cache; load = 1-minute load average at the start of each size")
    print(table(rows))
    print(f"\nwrote {args.out / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
