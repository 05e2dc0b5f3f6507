"""Measurements of the character GPT, run as code (never timed tests).

* ``bench-decode``: per-token cost of incremental decoding (one node + its in-edges, cached
  keys/values) against recomputing the whole context, for a window pattern at long lengths.
* ``bench-train``: time per training step of the graph GPT and its dense twin (or of any
  attentions, learned selections included), interleaved step by step in one process so that
  machine load hits all alike.
* ``bench-memory``: the memory that training a configuration takes, each in a fresh
  subprocess (tensor bytes kept between steps plus a step's peak, and peak RSS as a
  cross-check), and the longest context a window pattern trains at within the dense
  model's memory.

Their flags are in :mod:`tgattn.lm.__main__`.
"""
from __future__ import annotations

import dataclasses
import gc
import json
import statistics
import subprocess
import sys
import time

import torch

from ..models import GPT, GPTConfig
from ..models.config import SELECTIONS
from ..models.decode import DecodePattern, KVCache, step


def _threads(args) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)


def bench_decode(args) -> int:
    _threads(args)
    torch.manual_seed(0)
    longest = max(args.lengths) + args.tokens + 1
    config = GPTConfig(block_size=longest, pattern="window", window=args.window)
    model = GPT(config).eval()
    pattern = DecodePattern(model)
    idx = torch.randint(config.vocab_size, (1, longest))
    cache, rows = KVCache(model, 1), []
    for length in args.lengths:
        while cache.length < length:  # prefill (untimed) up to the measured length
            step(model, cache, pattern, idx[:, cache.length])
        inc = []
        for _ in range(args.tokens):
            t0 = time.perf_counter()
            logits_inc = step(model, cache, pattern, idx[:, cache.length])
            inc.append(time.perf_counter() - t0)
        n = cache.length  # the last timed token sat at position n - 1
        full = []
        with torch.no_grad():
            for _ in range(max(3, args.tokens // 4)):
                t0 = time.perf_counter()
                logits_full, _ = model(idx[:, :n], edge_index=pattern.prefix(n, 1))
                full.append(time.perf_counter() - t0)
        diff = float((logits_full[0, -1] - logits_inc[0]).abs().max())
        row = {
            "context": n,
            "keys_per_new_token": int(pattern.keys(n - 1).numel()),
            "incremental_ms": 1e3 * statistics.median(inc),
            "full_recompute_ms": 1e3 * statistics.median(full),
            "max_abs_logit_diff": diff,
        }
        row["speedup"] = row["full_recompute_ms"] / row["incremental_ms"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return 0


def _train_step(model, optimizer, x, y) -> None:
    if model.config.attention in SELECTIONS:  # the selected keys' loss plus the indexers' (as training does)
        _, loss, indexer_loss = model(x, y, return_indexer_loss=True)
        loss = loss + indexer_loss
    else:
        _, loss = model(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _bench_config(name: str, args) -> GPTConfig:
    """``graph`` / ``dense``: the pattern's graph GPT or its dense twin; ``window``: the graph GPT
    on a window of ``args.window``; a selection: ``args.k_top`` keys per query (``block_topk``:
    ``k_top // block`` blocks of ``block`` keys)."""
    common = dict(block_size=args.block_size, pattern=args.pattern, window=args.window)
    if name == "graph":
        return GPTConfig(**common)
    if name == "window":
        return GPTConfig(**{**common, "pattern": "window"})
    if name == "dense":
        return GPTConfig(**common, attention="dense")
    blocks = max(1, args.k_top // args.block)  # block_topk counts blocks: as many keys as indexer_topk
    return GPTConfig(block_size=args.block_size, attention=name, k_top=args.k_top if name == "indexer_topk" else blocks,
                     block=args.block)


def bench_train(args) -> int:
    """Median time per training step of each of ``args.models``, interleaved step by step.

    The first model sets the weights the others load where their parameters match (the dense
    twin's are the graph GPT's); each step every model trains on the same batch, the order
    rotating so that none always goes first. With one thread the times are the thread's CPU
    time (``time.thread_time``), else wall time.
    """
    _threads(args)
    torch.manual_seed(0)
    models = {name: GPT(_bench_config(name, args)).train() for name in args.models}
    first = next(iter(models.values()))
    for model in models.values():
        model.load_state_dict(first.state_dict(), strict=False)
    opts = {name: m.configure_optimizer(lr=1e-3, weight_decay=0.1) for name, m in models.items()}
    g = torch.Generator().manual_seed(0)
    times = {name: [] for name in models}
    names = list(models)
    # One thread computes on this thread: its CPU time is what other jobs on a shared machine leave alone.
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    for i in range(args.steps + args.warmup):
        x = torch.randint(65, (args.batch_size, args.block_size), generator=g)
        for name in names[i % len(names):] + names[:i % len(names)]:  # rotate who goes first
            t0 = clock()
            _train_step(models[name], opts[name], x, x)
            if i >= args.warmup:  # the first steps warm up allocators and caches
                times[name].append(clock() - t0)
    row = {"pattern": args.pattern, "window": args.window, "k_top": args.k_top, "block": args.block,
           "block_size": args.block_size, "batch_size": args.batch_size, "threads": torch.get_num_threads(),
           "clock": clock.__name__}
    row.update({f"{name}_ms": 1e3 * statistics.median(times[name]) for name in names})
    if names == ["graph", "dense"]:
        row["ratio"] = row["graph_ms"] / row["dense_ms"]
    else:
        row.update({f"{name}/{names[0]}": row[f"{name}_ms"] / row[f"{names[0]}_ms"] for name in names[1:]})
    print(json.dumps(row))
    return 0


def _config(args, **kw) -> GPTConfig:
    return GPTConfig(attention=args.attention, pattern=args.pattern, window=args.window, **kw)


def _tensors(obj):
    """The tensors in obj: nested tuples, lists, dicts and dataclasses (a Structure)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        yield from _tensors(list(obj.values()))
    elif dataclasses.is_dataclass(obj):
        yield from _tensors([getattr(obj, f.name) for f in dataclasses.fields(obj)])


def _nbytes(objs) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in _tensors(objs)}
    return sum(storages.values())


def memory_probe(args) -> int:
    """One configuration, in this (fresh) process: the memory that training it takes.

    ``tensor_mb``, the measure compared: the bytes of tensors that live between steps
    (weights, Adam's moments, the cached edge set or mask and the engine's analysis of it)
    plus the peak bytes of the tensors one training step creates (activations, saved
    attention tensors, gradients; counted by storage as operators create and free them).
    ``rss_mb`` cross-checks it from the operating system's side: the peak RSS of building the
    model and three steps over the RSS before, after one-time costs that belong to neither
    model (lazy imports, the fused kernel's library, thread pools) were paid by a throwaway
    one-layer model of the same kind.
    """
    from ..bench.measure import _LiveBytes, reset_rss_high_water, rss_high_water_mb, rss_mb
    from ..engine import fused, structure_of

    _threads(args)
    torch.manual_seed(0)
    fused.available()
    scratch = GPT(_config(args, block_size=8, n_layer=1, n_embd=32, n_head=2)).train()
    _train_step(scratch, scratch.configure_optimizer(lr=1e-3, weight_decay=0.1), *(torch.randint(65, (2, 8)),) * 2)
    del scratch
    gc.collect()
    reset_rss_high_water()
    before = rss_mb()
    b, t = args.batch_size, args.block_size
    model = GPT(_config(args, block_size=t)).train()
    optimizer = model.configure_optimizer(lr=1e-3, weight_decay=0.1)
    x = torch.randint(65, (b, t))
    for _ in range(2):  # the second step runs with Adam's state and the edge caches in place
        _train_step(model, optimizer, x, x)
    with _LiveBytes() as probe:
        _train_step(model, optimizer, x, x)
    rss = rss_high_water_mb() - before
    graph = model._graph(b, t, torch.device("cpu"))  # (edge_index, edge_index or mask)
    kept = [list(model.parameters()), optimizer.state, graph]
    if args.attention == "graph":
        kept.append(structure_of(graph[0], b * t, b * t))
    state = _nbytes(kept)
    mb = 2.0**-20
    print(json.dumps({"tensor_mb": (state + probe.peak) * mb, "state_mb": state * mb, "step_mb": probe.peak * mb,
                      "rss_mb": rss, "edges": int(graph[0].shape[1])}))
    return 0


def _probe(**kw) -> dict:
    cmd = [sys.executable, "-m", "tgattn.lm", "memory-probe"]
    for k, v in kw.items():
        cmd += ["--" + k.replace("_", "-"), str(v)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def bench_memory(args) -> int:
    b = args.batch_size

    def _probe_t(**kw):
        return _probe(**kw, threads=args.threads)

    budget = _probe_t(attention="dense", pattern="causal", block_size=args.dense_block, batch_size=b)
    print(json.dumps({"model": "dense causal", "block_size": args.dense_block, "batch_size": b, **budget}), flush=True)
    longest = None
    for length in args.lengths:
        batch = max(args.tokens // length, 1) if args.tokens else b
        for name, kw in (("dense causal", dict(attention="dense", pattern="causal")),
                         (f"graph window w={args.window}", dict(attention="graph", pattern="window", window=args.window))):
            if name.startswith("dense") and not args.with_dense:
                continue
            row = _probe_t(**kw, block_size=length, batch_size=batch)
            fits = row["tensor_mb"] <= budget["tensor_mb"]
            if name.startswith("graph") and fits:
                longest = length
            print(json.dumps({"model": name, "block_size": length, "batch_size": batch, **row, "fits_dense_budget": fits}), flush=True)
    print(json.dumps({"longest_window_context_within_dense_budget": longest, "dense_budget_mb": budget["tensor_mb"]}))
    return 0
