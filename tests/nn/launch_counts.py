"""Kernels per training step of every GNN layer path, on the route a GPU takes (a table, not a test).

Counted as ``tests/nn/test_layer_host_reads.py`` counts them (``tests/host_reads.py``: aten ops
that are not views plus Triton launches, the CPU taken for a device, Triton's interpreter for
the GPU), forward and backward, on a never-seen ``edge_index`` and over a prepared set, with
``TransformerConv``'s count for the same batch. Run from the repository root:

    TRITON_INTERPRET=1 python tests/nn/launch_counts.py
"""
import os
import sys

if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:0] = [here, os.path.dirname(here)]
    import pytest
    import tgattn
    import test_layer_host_reads as layers
    from host_reads import cpu_as_cuda, recording

    with pytest.MonkeyPatch.context() as patch:
        fixture = cpu_as_cuda.__wrapped__(patch)
        next(fixture)
        x, ei, edge_attr, batch = layers._batch()
        print(f"{'path':40s} {'new':>5s} {'prepared':>9s}   (aten ops + Triton launches; syncs new / prepared)")
        for name, (layer, options) in layers._layers(ei, batch).items():
            edges = layers._attended(ei, options)
            layers._step(layer, x, ei, edge_attr, edges.clone(), options)
            with recording() as new:
                layers._step(layer, x, ei, edge_attr, edges.clone(), options)
            prepared = tgattn.prepare(edges, layers.N, layers.N)
            layers._step(layer, x, ei, edge_attr, prepared, options)
            with recording() as steady:
                layers._step(layer, x, ei, edge_attr, prepared, options)
            print(f"{name:40s} {new.kernels + new.launches:5d} {steady.kernels + steady.launches:9d}"
                  f"   ({len(new.syncs)} / {len(steady.syncs)})")
        for path, options in layers.CONVS.items():
            if path != "self_loops":  # (TransformerConv has no self-loop option)
                count = layers._transformer_kernels(x, ei, edge_attr, options)
                print(f"{f'TransformerConv, as conv_{path}':40s} {count:5d} {count:9d}")
