"""Data location rules: explicit root, TGATTN_DATA, clear errors."""
import pytest

from tgattn import datasets


def test_tiny_shakespeare_from_shared_data(data_root):
    text = datasets.load_tiny_shakespeare(data_root)
    assert len(text) == 1_115_394 and text.startswith("First Citizen")


def test_planetoid_from_shared_data(data_root):
    data = datasets.load_planetoid("cora", data_root)
    assert data.num_nodes == 2708 and data.edge_index.shape[1] == 10556
    assert int(data.train_mask.sum()) == 140 and int(data.test_mask.sum()) == 1000


def test_env_variable_is_used(data_root, monkeypatch):
    monkeypatch.setenv("TGATTN_DATA", str(data_root))
    assert datasets.data_dir() == data_root


def test_missing_folder_and_bad_names_are_named(tmp_path, monkeypatch):
    monkeypatch.setenv("TGATTN_DATA", str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="from TGATTN_DATA"):
        datasets.data_dir()
    with pytest.raises(FileNotFoundError, match="no Tiny Shakespeare corpus"):
        datasets.load_tiny_shakespeare(tmp_path)
    with pytest.raises(FileNotFoundError, match="no Planetoid Cora raw files"):
        datasets.load_planetoid("Cora", tmp_path)
    with pytest.raises(ValueError, match="unknown Planetoid dataset 'Kora'"):
        datasets.load_planetoid("Kora", tmp_path)
