"""tgattn.hf.pretrained: the tgattn[models] extra's all-MiniLM-L6-v2, found and extracted once."""
import importlib.util
import json
import threading

import pytest

from tgattn.hf import pretrained
from tgattn.hf.pretrained import cache_dir, minilm_path

pytestmark = pytest.mark.skipif(importlib.util.find_spec(pretrained.PACKAGE) is None,
                                reason='needs the tgattn[models] extra (in the test extra)')


def test_cache_dir_follows_tgattn_cache_then_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("TGATTN_CACHE", str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "mine"
    monkeypatch.delenv("TGATTN_CACHE")
    assert cache_dir() == tmp_path / "xdg" / "tgattn"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "tgattn"


def test_minilm_path_extracts_the_bert_folder_once(monkeypatch, tmp_path):
    monkeypatch.setenv("TGATTN_CACHE", str(tmp_path))
    path = minilm_path()
    assert path.parent == tmp_path / "models" and path.name.startswith("all-MiniLM-L6-v2-")
    config = json.loads((path / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"], config["num_attention_heads"],
            config["hidden_size"]) == ("bert", 6, 12, 384)
    assert (path / "model.safetensors").stat().st_size == 90_868_376  # the zip's size for it: complete
    stamp = (path / "config.json").stat().st_mtime_ns
    assert minilm_path() == path and (path / "config.json").stat().st_mtime_ns == stamp  # not extracted again
    assert [p.name for p in (tmp_path / "models").iterdir()] == [path.name]  # no scratch folder left


@pytest.mark.slow  # three extractions of 90 MB: 4 s
def test_minilm_path_from_threads_at_once_leaves_one_whole_copy(monkeypatch, tmp_path):
    monkeypatch.setenv("TGATTN_CACHE", str(tmp_path))
    found, failed = [], []

    def extract():
        try:
            found.append(minilm_path())
        except Exception as err:  # noqa: BLE001 (reported below)
            failed.append(err)

    threads = [threading.Thread(target=extract) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failed == [] and len(set(found)) == 1 and len(found) == 3
    assert [p.name for p in (tmp_path / "models").iterdir()] == [found[0].name]
    assert (found[0] / "model.safetensors").stat().st_size == 90_868_376


def test_a_missing_extra_is_one_line_naming_it(monkeypatch):
    monkeypatch.setattr(pretrained, "PACKAGE", "no_such_package_of_tgattn")
    with pytest.raises(ModuleNotFoundError) as err:
        minilm_path()
    assert str(err.value) == 'the pretrained model all-MiniLM-L6-v2 is not installed: pip install "tgattn[models]"'


def test_a_zip_reaching_outside_its_folder_is_not_extracted(monkeypatch, tmp_path):
    import zipfile

    bad = tmp_path / "pkg" / "model.zip"
    bad.parent.mkdir()
    with zipfile.ZipFile(bad, "w") as archive:
        archive.writestr("../escaped.txt", "x")
    monkeypatch.setattr(pretrained, "_model_zip", lambda: bad)
    monkeypatch.setenv("TGATTN_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="'../escaped.txt', a path outside its folder"):
        minilm_path()
    assert not (tmp_path / "cache" / "escaped.txt").exists()
    assert list((tmp_path / "cache" / "models").iterdir()) == []
