"""A model trained on PyG's GPSConv loads strictly into the same model built on tgattn.nn.GPSConv."""
import pytest
import torch
from torch import nn
from torch_geometric.data import Batch, Data
from torch_geometric.nn import GINConv
from torch_geometric.nn import GPSConv as PyGGPSConv

from tgattn.nn import GPSConv

D, H = 16, 4


class Model(nn.Module):
    """Two GPS layers and a head: the layer's keys sit under a prefix, as in any real model."""

    def __init__(self, gps, bias=True):
        super().__init__()
        self.layers = nn.ModuleList(
            gps(D, GINConv(nn.Sequential(nn.Linear(D, D), nn.ReLU(), nn.Linear(D, D))), heads=H,
                attn_kwargs={"bias": bias}) for _ in range(2))
        self.head = nn.Linear(D, 3)

    def forward(self, x, edge_index, batch):
        for layer in self.layers:
            x = layer(x, edge_index, batch)
        return self.head(x)


def graphs(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    chains = [Data(x=torch.randn(n, D, generator=g), edge_index=torch.stack([torch.arange(n - 1), torch.arange(1, n)]))
              for n in lengths]
    return Batch.from_data_list(chains)


@pytest.mark.parametrize("bias", [True, False])
def test_a_pyg_gps_state_dict_loads_strictly_and_gives_the_same_outputs(bias):
    torch.manual_seed(0)
    pyg = Model(PyGGPSConv, bias).double()
    batch = graphs([7, 3, 12, 1, 9])
    x = batch.x.double()
    pyg.train()
    for _ in range(2):  # batch-norm statistics that are not the initial ones
        pyg(x, batch.edge_index, batch.batch)
    saved = pyg.state_dict()
    assert any(key.endswith("attn.in_proj_weight") for key in saved)  # PyG's packed projection
    keys = list(saved)
    ours = Model(GPSConv, bias).double()
    ours.load_state_dict(saved)  # strict: a key missing or left over raises
    assert list(saved) == keys  # the caller's dict is left as it was
    pyg.eval(), ours.eval()
    torch.testing.assert_close(ours(x, batch.edge_index, batch.batch), pyg(x, batch.edge_index, batch.batch),
                               rtol=1e-12, atol=1e-12)


def test_a_wrong_shape_is_still_refused():
    saved = Model(PyGGPSConv).state_dict()
    saved["layers.0.attn.in_proj_weight"] = saved["layers.0.attn.in_proj_weight"][:, :8]
    with pytest.raises(RuntimeError, match=r"size mismatch for layers\.0\.attn\.q_proj\.weight"):
        Model(GPSConv).load_state_dict(saved)


def test_its_own_state_dict_still_loads():
    torch.manual_seed(1)
    a, b = Model(GPSConv), Model(GPSConv)
    b.load_state_dict(a.state_dict())
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), name
