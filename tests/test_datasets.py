"""Data location rules: explicit root, TGATTN_DATA, clear errors; a checked, atomic download."""
import email.message
import io
import urllib.request

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
    with pytest.raises(ConnectionResetError):
        datasets.load_tiny_shakespeare()
    assert list(home.iterdir()) == []  # neither input.txt nor a temporary file


def test_a_short_download_is_refused(home, monkeypatch):
    serve(monkeypatch, b"First Citizen:\n" * 1000)  # the server closed early, without an error
    with pytest.raises(ValueError, match=r"not the expected file \(15,000 bytes instead of 1,115,394\); nothing was saved"):
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
