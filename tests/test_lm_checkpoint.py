"""Checkpoints: atomic saves, a checksum that catches corruption, errors that name the file."""
import errno
import zipfile

import pytest
import torch

from tgattn.lm import CheckpointError, checkpoint_config, load_checkpoint, model_from_checkpoint, save_checkpoint, state_digest
from tgattn.models import GPT, GPTConfig


def state():
    g = torch.Generator().manual_seed(0)
    return {"model": {"w": torch.randn(64, 32, generator=g), "b": torch.zeros(32)}, "config": {"n_embd": 32},
            "vocab": "abc", "iter": 7, "rng": {"batches": g.get_state()}, "best_val": float("inf")}


@pytest.fixture
def ckpt(tmp_path):
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, state())
    return path


def test_a_saved_checkpoint_loads_back_equal(ckpt):
    loaded, original = load_checkpoint(ckpt), state()
    assert loaded.keys() == original.keys() and loaded["iter"] == 7 and loaded["vocab"] == "abc"
    torch.testing.assert_close(loaded["model"], original["model"], rtol=0, atol=0)
    assert torch.load(ckpt, weights_only=True)["sha256"] == state_digest(original)  # plain torch.load still reads it


def test_an_empty_checkpoint_is_named(ckpt):
    ckpt.write_bytes(b"")
    with pytest.raises(CheckpointError, match=f"checkpoint {ckpt} is empty"):
        load_checkpoint(ckpt)


@pytest.mark.parametrize("keep", [0.5, 0.99])
def test_a_truncated_checkpoint_is_named(ckpt, keep):
    data = ckpt.read_bytes()
    ckpt.write_bytes(data[: int(keep * len(data))])
    with pytest.raises(CheckpointError, match=f"checkpoint {ckpt} .* is truncated or corrupted"):
        load_checkpoint(ckpt)


def _data_offset(path, record: str) -> int:
    """Where the bytes of zip member ``record`` begin in the file (stored uncompressed)."""
    with zipfile.ZipFile(path) as zf:
        info = next(i for i in zf.infolist() if i.filename.endswith(record))
    with open(path, "rb") as fh:
        fh.seek(info.header_offset + 26)
        name_len, extra_len = (int.from_bytes(fh.read(2), "little") for _ in range(2))
    return info.header_offset + 30 + name_len + extra_len


def test_a_flipped_byte_in_tensor_data_is_caught(ckpt):
    data = bytearray(ckpt.read_bytes())
    start = _data_offset(ckpt, "data/0")  # the first tensor's storage
    data[start + 100] ^= 0x01  # one bit of one float: torch.load alone returns the changed weight
    ckpt.write_bytes(bytes(data))
    assert not torch.equal(torch.load(ckpt, weights_only=True)["model"]["w"], state()["model"]["w"])
    with pytest.raises(CheckpointError, match=f"checkpoint {ckpt} is corrupted: its contents do not match the SHA-256"):
        load_checkpoint(ckpt)


def test_a_failed_save_leaves_no_tmp_and_the_old_checkpoint(ckpt, monkeypatch):
    def disk_full(obj, fh):
        fh.write(b"PK\x03\x04 half a zip")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError, match="No space left"):
        save_checkpoint(ckpt, {**state(), "iter": 8})
    assert sorted(p.name for p in ckpt.parent.iterdir()) == ["ckpt.pt"]
    assert load_checkpoint(ckpt)["iter"] == 7


def test_not_a_gpt_checkpoint_and_an_unverified_one(tmp_path):
    path = tmp_path / "other.pt"
    torch.save({"model": {}}, path)
    with pytest.raises(CheckpointError, match=r"not a tgattn GPT checkpoint: keys \['config', 'vocab'\] are missing"):
        load_checkpoint(path)
    torch.save(state(), path)  # written by another program: no checksum
    with pytest.warns(UserWarning, match="has no checksum"):
        assert load_checkpoint(path)["iter"] == 7
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        load_checkpoint(tmp_path / "missing.pt")


def gpt_state():
    config = GPTConfig(block_size=4, vocab_size=3, n_layer=1, n_head=1, n_embd=4)
    return {"model": GPT(config).state_dict(), "config": dict(config.__dict__), "vocab": "abc"}


def test_checkpoint_config_accepts_a_matching_checkpoint_and_old_configs(ckpt):
    state = gpt_state()
    assert checkpoint_config(state) == GPTConfig(**state["config"])
    del state["config"]["pattern_seed"]  # written before a field existed: the default
    assert checkpoint_config(state).pattern_seed == 0 and model_from_checkpoint(state).config.n_embd == 4


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda s: s["model"].update(extra=torch.zeros(1)), "weights the config has no place for: 'extra'"),
        (lambda s: s["model"].update({"lm_head.weight": [0.0]}), "not a tensor: 'lm_head.weight'"),
        (lambda s: s["model"].pop("transformer.ln_f.weight"), "no weights for 'transformer.ln_f.weight'"),
        (lambda s: s["config"].update(block_size=8), "'transformer.wpe.weight' is [4, 4], the config needs [8, 4]"),
        (lambda s: s["config"].update(bias=1), "has config bias = 1 (an int), not a bool"),
        (lambda s: s["config"].update(dropout=2.0), "has an invalid config: dropout must be in [0, 1) (got 2.0)"),
        (lambda s: s.update(config=[1]), "has a config that is a list, not a dict"),
        (lambda s: s.update(vocab=["a", "b", "c"]), "has a vocabulary that is a list, not a str"),
        (lambda s: s.update(model=None), "has weights that are a NoneType, not a state dict"),
    ],
    ids=["extra", "not-a-tensor", "missing", "shape", "type", "range", "config", "vocab", "weights"],
)
def test_a_checkpoint_whose_parts_do_not_fit_is_named(tmp_path, change, message):
    state = gpt_state()
    change(state)
    with pytest.raises(CheckpointError) as without_path:
        model_from_checkpoint(state)
    with pytest.raises(CheckpointError) as with_path:
        checkpoint_config(state, tmp_path / "x.pt")
    for err, name in ((without_path, "the checkpoint"), (with_path, f"checkpoint {tmp_path / 'x.pt'}")):
        assert str(err.value).startswith(name + " has ") and str(err.value).endswith(message)
