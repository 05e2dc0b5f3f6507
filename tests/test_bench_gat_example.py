"""``python -m tgattn.bench.gat_example``: PyG's ``examples/gat.py`` loop, models side by side.

The oracle is the example's own loop written out here as PyG ships it (its ``train()`` and
``test()``): the benchmark's epochs must train the same weights and reach the same accuracies.
"""
import statistics

import pytest
import torch
import torch.nn.functional as F
from torch_geometric.data import Data

from tgattn.bench.gat_example import example_epochs, rows_of
from tgattn.bench.models import MODELS, Net


def small_graph(n=60, features=30, classes=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, features, generator=g)
    edge_index = torch.randint(0, n, (2, 4 * n), generator=g)
    masks = torch.randperm(n, generator=g)
    train, val, test = (torch.zeros(n, dtype=torch.bool) for _ in range(3))
    train[masks[:20]], val[masks[20:40]], test[masks[40:]] = True, True, True
    return Data(x=x / x.sum(1, keepdim=True), edge_index=edge_index, y=torch.randint(0, classes, (n,), generator=g),
                train_mask=train, val_mask=val, test_mask=test)


def pyg_example(net, data, epochs):
    """PyG's examples/gat.py: Adam(lr=0.005, weight_decay=5e-4), train() then test() per epoch."""
    optimizer = torch.optim.Adam(net.parameters(), lr=0.005, weight_decay=5e-4)
    for _ in range(epochs):
        net.train()
        optimizer.zero_grad()
        out = net(data.x, data.edge_index)
        loss = F.cross_entropy(out[data.train_mask], data.y[data.train_mask])
        loss.backward()
        optimizer.step()
        net.eval()
        with torch.no_grad():
            pred = net(data.x, data.edge_index).argmax(dim=-1)
        accs = [int((pred[m] == data.y[m]).sum()) / int(m.sum()) for m in (data.train_mask, data.val_mask, data.test_mask)]
    return accs


@pytest.mark.parametrize("model", ["gat", "tgattn"])
def test_the_epochs_are_the_examples(model):
    data = small_graph()
    torch.manual_seed(3)
    ours = Net(MODELS[model], 30, 3)
    torch.manual_seed(3)
    theirs = Net(MODELS[model], 30, 3)
    torch.manual_seed(4)
    result = example_epochs({model: ours}, data, 4)
    torch.manual_seed(4)
    accs = pyg_example(theirs, data, 4)
    for (name, a), b in zip(ours.state_dict().items(), theirs.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    assert result[model]["test_acc"] == accs[2] and len(result[model]["seconds"]) == 4


def test_rows_report_medians_and_ratios():
    result = {"gat": {"seconds": [0.3, 0.1, 0.2], "test_acc": 0.5}, "tgattn": {"seconds": [0.2, 0.6, 0.3], "test_acc": 0.6},
              "transformer": {"seconds": [0.4, 0.4, 0.9], "test_acc": 0.4}}
    rows = {r["model"]: r for r in rows_of("Cora", 2, result)}
    assert rows["tgattn"]["median_ms"] == pytest.approx(1000 * statistics.median([0.2, 0.6, 0.3]))
    assert rows["tgattn"]["vs_gat"] == pytest.approx(0.3 / 0.2) and rows["tgattn"]["vs_transformer"] == pytest.approx(0.3 / 0.4)
    assert rows["gat"]["vs_gat"] == 1.0 and rows["tgattn"]["epochs"] == 3
