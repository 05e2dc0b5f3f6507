"""FlexAttention with a BlockMask built from the CSR structure: the tiles it visits, its
mask_mod on every cell, and its (eager) output against the dense oracle. The compiled kernel
runs in ``python -m tgattn.bench --peers flex_csr`` (a compile takes tens of seconds here)."""
import warnings

import pytest
import torch

from tgattn import builders, engine
from tgattn.engine.triton.flex import block_mask, flex_attention
from tgattn.reference import dense_attention
from tgattn.verify import random_edges

from engine_helpers import inputs, max_err

pytest.importorskip("torch.nn.attention.flex_attention")

def _random_with_empty_rows():
    ei = random_edges(100, 100, 0.05, seed=1)
    return ei[:, ei[1] % 5 != 0]  # every fifth query without edges


CASES = {
    "packed_full": (lambda: builders.full([40, 24, 36]), 100),  # full tiles (block 16) inside each sequence
    "packed_causal": (lambda: builders.causal([50, 30, 20]), 100),
    "window": (lambda: builders.window(100, 9), 100),
    "random_with_empty_rows": (_random_with_empty_rows, 100),
    "bigbird": (lambda: builders.bigbird(90, 4, 2, 2, generator=torch.Generator().manual_seed(0)), 90),
    "every_tile_full": (lambda: builders.block_local(96, 32), 96),  # no partial tile: no bitmask words of its own
}


def _cells(bm, n, block):
    """The cells FlexAttention attends to: visited tiles, all of a full tile, mask_mod in a partial one."""
    qi, kj = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")
    visited = bm.to_dense()[0, 0].bool()
    full = torch.zeros_like(visited)
    num, idx = bm.full_kv_num_blocks[0, 0], bm.full_kv_indices[0, 0]
    for r in range(num.numel()):
        full[r, idx[r, : num[r]]] = True
    tile = (qi // block, kj // block)
    return visited[tile] & (full[tile] | bm.mask_mod(0, 0, qi, kj)), full


@pytest.mark.parametrize("case", list(CASES))
def test_block_mask_is_the_edge_set(case):
    make, n = CASES[case]
    ei = make()
    bm = block_mask(engine.analyse(ei, n, n), block=16)
    cells, full = _cells(bm, n, 16)
    assert torch.equal(cells, builders.to_mask(ei, n, n))
    qi, kj = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")
    assert torch.equal(bm.mask_mod(0, 0, qi, kj), builders.to_mask(ei, n, n))  # exact on full tiles too
    if case == "packed_full":
        assert int(full.sum()) > 0


def test_block_mask_is_compact():
    n = 1024
    s = engine.analyse(builders.window(n, 64), n, n)
    bm = block_mask(s)  # 128 x 128 tiles
    assert block_mask(s) is bm  # cached on the structure
    read = bm.mask_mod.__closure__  # the tile table and bitmask the mask_mod reads
    stored = sum(c.cell_contents.numel() for c in read if isinstance(c.cell_contents, torch.Tensor))
    stored += sum(t.numel() for t in bm.as_tuple() if isinstance(t, torch.Tensor))
    assert stored < n * n / 10


@pytest.mark.parametrize("case", ["packed_full", "random_with_empty_rows", "every_tile_full"])
def test_eager_output_equals_the_oracle(case):
    make, n = CASES[case]
    ei = make()
    q, k, v, _ = inputs(n, n, heads=2, dk=8, dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()"
        out = flex_attention(q.detach(), k.detach(), v.detach(), engine.analyse(ei, n, n), 0.3)
    ref = dense_attention(q.detach(), k.detach(), v.detach(), builders.to_mask(ei, n, n), scale=0.3)
    assert max_err(out, ref) <= 1e-5


def test_duplicates_are_refused():
    ei = builders.window(20, 2)
    with pytest.raises(ValueError, match="duplicate"):
        block_mask(engine.analyse(torch.cat([ei, ei[:, :3]], dim=1), 20, 20))
