"""Data location rules: explicit root, TGATTN_DATA, clear errors; checked files, atomic downloads."""
import email.message
import hashlib
import io
import pickle
import shutil
import urllib.error
import urllib.request

import pytest
import torch
from torch_geometric.datasets import Planetoid

from tgattn import datasets


def test_tiny_shakespeare_from_shared_data(data_root):
    text = datasets.load_tiny_shakespeare(data_root)
    assert len(text) == 1_115_394 and text.startswith("First Citizen")


def test_planetoid_from_shared_data(data_root):
    data = datasets.load_planetoid("cora", data_root)[0]
    assert data.num_nodes == 2708 and data.edge_index.shape[1] == 10556
    assert int(data.train_mask.sum()) == 140 and int(data.test_mask.sum()) == 1000


def test_planetoid_is_what_pyg_users_expect_a_dataset_of_one_graph(data_root, tmp_path):
    from torch_geometric.data import Data, InMemoryDataset
    from torch_geometric.loader import DataLoader

    dataset = datasets.load_planetoid("CiteSeer", data_root)
    shutil.copytree(data_root / "planetoid" / "CiteSeer" / "raw", tmp_path / "CiteSeer" / "raw")
    pyg = Planetoid(str(tmp_path), "CiteSeer")  # PyG's own, on a copy of the same raw files
    assert isinstance(dataset, InMemoryDataset) and repr(dataset) == repr(pyg) == "CiteSeer()"
    assert len(dataset) == len(pyg) == 1 and isinstance(dataset[0], Data)
    assert (dataset.num_classes, dataset.num_features) == (pyg.num_classes, pyg.num_features) == (6, 3703)
    for key in ("x", "edge_index", "y", "train_mask", "val_mask", "test_mask"):
        assert torch.equal(dataset[0][key], pyg[0][key])
    assert [g.num_nodes for g in dataset] == [3327]
    batch = next(iter(DataLoader(dataset, batch_size=1)))
    assert batch.num_graphs == 1 and torch.equal(batch.edge_index, pyg[0].edge_index)
    # code written for the graph it returned before reads the graph through it
    assert dataset.num_nodes == 3327 and torch.equal(dataset.edge_index, pyg[0].edge_index)
    assert isinstance(dataset.clone(), Data) and torch.equal(dataset.clone().y, pyg[0].y)


def test_a_planetoid_load_prints_nothing(data_root, capfd, monkeypatch):
    # PyG prints "Processing...\nDone!" on stderr outside pytest, and load_planetoid processes on every load
    monkeypatch.delenv("PYTEST_CURRENT_TEST", raising=False)
    assert datasets.load_planetoid("Cora", data_root)[0].num_nodes == 2708
    assert capfd.readouterr() == ("", "")


def test_env_variable_is_used(data_root, monkeypatch):
    monkeypatch.setenv("TGATTN_DATA", str(data_root))
    assert datasets.data_dir() == data_root


def test_missing_folder_and_bad_names_are_named(tmp_path, monkeypatch):
    monkeypatch.setenv("TGATTN_DATA", str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="from TGATTN_DATA"):
        datasets.data_dir()
    with pytest.raises(FileNotFoundError, match=f"Tiny Shakespeare not found: {tmp_path}/tinyshakespeare/input.txt "
                                                f"does not exist .*put the corpus from https://"):
        datasets.load_tiny_shakespeare(tmp_path)
    with pytest.raises(FileNotFoundError, match=f"Planetoid Cora not found: {tmp_path}/planetoid/Cora/raw/ind.cora.x "
                                                "does not exist .*put the files from https://"):
        datasets.load_planetoid("Cora", tmp_path)
    with pytest.raises(ValueError, match="unknown Planetoid dataset 'Kora'"):
        datasets.load_planetoid("Kora", tmp_path)


class FakeResponse(io.BytesIO):
    """``urlopen``'s answer: serves ``data``, then raises ``error`` (a dropped connection) if given."""

    def __init__(self, data: bytes, error=None):
        super().__init__(data)
        self.error = error

    def read(self, size=-1):
        chunk = super().read(size if size and size > 0 else 4096)
        if not chunk and self.error is not None:
            raise self.error
        return chunk

    def info(self):  # the headers (none: no Content-Length, like a chunked answer)
        return email.message.Message()


@pytest.fixture
def home(tmp_path, monkeypatch):
    """An empty home folder (no cached corpus) and no TGATTN_DATA: the download path."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("TGATTN_DATA", raising=False)
    return tmp_path / ".cache" / "tgattn" / "tinyshakespeare"


def serve(monkeypatch, data: bytes, error=None):
    urls = []
    monkeypatch.setattr(urllib.request, "urlopen", lambda url, *args, **kw: urls.append(url) or FakeResponse(data, error))
    return urls


def test_a_download_cut_midway_saves_nothing(home, monkeypatch):
    serve(monkeypatch, b"First Citizen:\n" * 1000, ConnectionResetError("connection reset by peer"))
    with pytest.raises(FileNotFoundError, match=r"download .* failed \(connection reset by peer\)") as info:
        datasets.load_tiny_shakespeare()
    assert isinstance(info.value.__cause__, ConnectionResetError)
    assert list(home.iterdir()) == []  # neither input.txt nor a temporary file


def _offline(monkeypatch):
    def urlopen(url, *args, **kwargs):
        raise urllib.error.URLError(OSError(-3, "Temporary failure in name resolution"))

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)


@pytest.mark.parametrize("load, name, inside", [
    (datasets.load_tiny_shakespeare, "Tiny Shakespeare", "tinyshakespeare/input.txt"),
    (lambda: datasets.load_planetoid("Cora"), "Planetoid Cora", "planetoid/Cora/raw"),
])
def test_offline_without_a_data_folder_one_message_names_the_set_where_and_how(home, monkeypatch, load, name, inside):
    _offline(monkeypatch)
    with pytest.raises(FileNotFoundError) as info:
        load()
    message = str(info.value)
    assert message.startswith(f"{name} not found: TGATTN_DATA is not set, {home.parent}/")
    assert "Temporary failure in name resolution" in message and "\n" not in message
    assert message.endswith(f"set TGATTN_DATA to a folder holding {inside} (like ../shared/data), or connect "
                            "to the internet and run again")


def test_a_data_folder_that_does_not_exist_is_named_with_the_data_set(monkeypatch, tmp_path):
    monkeypatch.setenv("TGATTN_DATA", str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match=f"Planetoid CiteSeer not found: data folder '{tmp_path}/nope' "
                                                "\\(from TGATTN_DATA\\) does not exist; point it at"):
        datasets.load_planetoid("CiteSeer")


def test_a_short_download_is_refused(home, monkeypatch):
    serve(monkeypatch, b"First Citizen:\n" * 1000)  # the server closed early, without an error
    with pytest.raises(ValueError, match=r"not the expected file \(15,000 bytes, SHA-256 [0-9a-f]{64}; expected 1,115,394 bytes, SHA-256 86c4e6aa9db7\w+\); nothing was saved"):
        datasets.load_tiny_shakespeare()
    assert list(home.iterdir()) == []


def test_the_checked_download_is_saved_and_reused(home, monkeypatch, data_root):
    corpus = (data_root / "tinyshakespeare" / "input.txt").read_bytes()
    urls = serve(monkeypatch, corpus)
    assert datasets.load_tiny_shakespeare() == corpus.decode()
    assert [p.name for p in home.iterdir()] == ["input.txt"] and urls == [datasets.TINY_SHAKESPEARE_URL]
    assert datasets.load_tiny_shakespeare() == corpus.decode() and len(urls) == 1  # read from the cache


def test_a_truncated_cached_corpus_is_named_with_the_fix(home):
    home.mkdir(parents=True)
    (home / "input.txt").write_text("First Citizen:\n" * 1000)  # left by an interrupted download
    with pytest.raises(ValueError, match="input.txt is not the Tiny Shakespeare corpus") as info:
        datasets.load_tiny_shakespeare()
    assert str(home / "input.txt") in str(info.value) and "delete it to download it again" in str(info.value)
    corrupt = (b"x" * datasets.TINY_SHAKESPEARE_BYTES)  # the right length, the wrong text
    (home / "input.txt").write_bytes(corrupt)
    with pytest.raises(ValueError, match="SHA-256"):
        datasets.load_tiny_shakespeare()


class Plant:
    """A pickle that creates ``marker`` when it is loaded: any code could run in its place."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


@pytest.fixture
def cora_copy(data_root, tmp_path):
    """A data folder holding a copy of the shared Cora raw files."""
    root = tmp_path / "data"
    shutil.copytree(data_root / "planetoid" / "Cora" / "raw", root / "planetoid" / "Cora" / "raw")
    return root


def test_a_planted_planetoid_pickle_is_refused_before_it_runs(cora_copy, tmp_path):
    x = cora_copy / "planetoid" / "Cora" / "raw" / "ind.cora.x"
    x.write_bytes(pickle.dumps(Plant(tmp_path / "marker")))
    with pytest.raises(ValueError, match="ind.cora.x is not Planetoid's ind.cora.x") as info:
        datasets.load_planetoid("Cora", cora_copy)
    assert not (tmp_path / "marker").exists()
    message = str(info.value)
    assert str(x) in message and hashlib.sha256(x.read_bytes()).hexdigest() in message
    assert datasets.PLANETOID_FILES["ind.cora.x"][1] in message and "TGATTN_DATA" in message


def test_untouched_planetoid_files_load_and_a_truncated_or_missing_one_is_named(cora_copy):
    data = datasets.load_planetoid("Cora", cora_copy)
    assert data.num_nodes == 2708 and data.edge_index.shape[1] == 10556
    tx = cora_copy / "planetoid" / "Cora" / "raw" / "ind.cora.tx"
    full = tx.read_bytes()
    tx.write_bytes(full[:1000])
    with pytest.raises(ValueError, match=r"ind.cora.tx \(1,000 bytes, SHA-256 [0-9a-f]{64}; expected 148,025 bytes"):
        datasets.load_planetoid("Cora", cora_copy)
    tx.write_bytes(full)
    graph = tx.with_name("ind.cora.graph")
    graph.unlink()
    with pytest.raises(FileNotFoundError, match=f"Planetoid Cora not found: {graph} does not exist"):
        datasets.load_planetoid("Cora", cora_copy)


def test_known_planetoid_files_are_the_shared_ones(data_root):
    for name in ("Cora", "CiteSeer"):
        for path in (data_root / "planetoid" / name / "raw").iterdir():
            data = path.read_bytes()
            assert datasets.PLANETOID_FILES[path.name] == (len(data), hashlib.sha256(data).hexdigest())
    assert sum(f.startswith("ind.pubmed.") for f in datasets.PLANETOID_FILES) == 8


@pytest.fixture
def planetoid_cache(tmp_path, monkeypatch):
    """An empty home folder and no TGATTN_DATA: Planetoid's cache, where the download goes."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("TGATTN_DATA", raising=False)
    return tmp_path / ".cache" / "tgattn" / "planetoid" / "Cora"


def test_a_planted_processed_file_in_the_cache_is_never_read(planetoid_cache, data_root, tmp_path, monkeypatch):
    shutil.copytree(data_root / "planetoid" / "Cora" / "raw", planetoid_cache / "raw")
    (planetoid_cache / "processed").mkdir()
    torch.save(Plant(tmp_path / "marker"), planetoid_cache / "processed" / "data.pt")  # PyG loads it if it is used
    urls = serve(monkeypatch, b"")
    assert datasets.load_planetoid("Cora").num_nodes == 2708
    assert not (tmp_path / "marker").exists() and urls == []  # the cached raw files were used, checked


def test_the_planetoid_download_is_checked_file_by_file(planetoid_cache, data_root, tmp_path, monkeypatch):
    raw = data_root / "planetoid" / "Cora" / "raw"
    urls = []
    served = {"ind.cora.tx": pickle.dumps(Plant(tmp_path / "marker"))}  # one file replaced on the way

    def urlopen(url, *args, **kwargs):
        urls.append(url)
        name = url.rsplit("/", 1)[1]
        return FakeResponse(served.get(name) or (raw / name).read_bytes())

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)
    with pytest.raises(ValueError, match=f"the download from {Planetoid.url}/ind.cora.tx is not the expected file"):
        datasets.load_planetoid("Cora")
    assert not (tmp_path / "marker").exists() and sorted(p.name for p in (planetoid_cache / "raw").iterdir()) == ["ind.cora.x"]
    served.clear()
    assert datasets.load_planetoid("Cora").num_nodes == 2708
    files = [f for f in datasets.PLANETOID_FILES if f.startswith("ind.cora.")]
    assert urls == [f"{Planetoid.url}/{f}" for f in files[:2] + files[1:]]  # x once, tx twice, then the rest
    assert [p.name for p in planetoid_cache.iterdir()] == ["raw"]  # nothing processed is kept
    assert datasets.load_planetoid("Cora").num_nodes == 2708 and len(urls) == 9  # read from the cache
