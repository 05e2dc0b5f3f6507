import pytest
import torch

from tgattn.planetoid_raw import read_planetoid

# Statistics of the public Planetoid split, as listed in PyG's dataset table and the GCN paper
# (Kipf & Welling, ICLR 2017): nodes, undirected edges stored both ways, features, classes.
STATS = {"Cora": (2708, 10556, 1433, 7, 140), "CiteSeer": (3327, 9104, 3703, 6, 120)}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(STATS))
def test_reader_gives_public_split(data_root, name):
    data = read_planetoid(data_root / "planetoid" / name / "raw", name)
    nodes, edges, features, classes, train = STATS[name]
    assert data.x.shape == (nodes, features) and data.edge_index.shape == (2, edges)
    assert int(data.y.max()) + 1 == classes
    assert [int(m.sum()) for m in (data.train_mask, data.val_mask, data.test_mask)] == [train, 500, 1000]
    assert not (data.train_mask & data.val_mask).any() and not (data.val_mask & data.test_mask).any()
    assert data.is_undirected() and not data.has_self_loops()
    assert set(data.x.unique().tolist()) == {0.0, 1.0}  # binary bag-of-words
    assert data.y[data.train_mask].bincount().tolist() == [20] * classes  # 20 labels per class
    # CiteSeer's 15 isolated nodes inside the test range have no features: zero rows, label 0,
    # outside the test mask (PyG's convention); Cora has none.
    empty = data.x.sum(1) == 0
    assert int(empty.sum()) == (15 if name == "CiteSeer" else 0)
    assert not (empty & data.test_mask).any() and not data.y[empty].any()
