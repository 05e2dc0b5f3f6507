"""Checkpoints of the character GPT: atomic writes, a checksum of the contents, clear errors.

A checkpoint is a :func:`torch.save` dict of plain types (tensors, dicts, lists, numbers,
strings), so :func:`torch.load` reads it with ``weights_only=True``. It holds ``"model"``
(state dict), ``"config"`` (the fields of :class:`tgattn.models.GPTConfig`) and ``"vocab"``
(the tokenizer's characters in id order); :func:`tgattn.lm.train` adds the optimizer and
random states. :func:`save_checkpoint` stores the SHA-256 of everything else under
``"sha256"`` (the zip container checks no CRC on load, so a flipped byte in tensor data
would otherwise load silently) and :func:`load_checkpoint` verifies it.
"""
from __future__ import annotations

import errno
import hashlib
import os
import warnings
from pathlib import Path
from typing import Union

import torch

REQUIRED = ("model", "config", "vocab")


class CheckpointError(ValueError):
    """A checkpoint file that is empty, truncated, corrupted or not a tgattn GPT checkpoint."""


def state_digest(state: dict) -> str:
    """SHA-256 of a checkpoint's contents: every key, number, string and tensor byte.

    The ``"sha256"`` entry itself is left out, so a loaded checkpoint digests to its stored value.

    Example:
        >>> a = state_digest({"w": torch.zeros(2), "iter": 3})
        >>> a == state_digest({"iter": 3, "w": torch.zeros(2)}), a == state_digest({"w": torch.ones(2), "iter": 3})
        (True, False)
    """
    h = hashlib.sha256()
    _feed(h, {k: v for k, v in state.items() if k != "sha256"})
    return h.hexdigest()


def _feed(h, obj) -> None:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(f"tensor {t.dtype} {tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())  # the raw bytes
    elif isinstance(obj, dict):
        h.update(f"dict {len(obj)};".encode())
        for key in sorted(obj, key=repr):
            _feed(h, key)
            _feed(h, obj[key])
    elif isinstance(obj, (list, tuple)):
        h.update(f"{type(obj).__name__} {len(obj)};".encode())
        for item in obj:
            _feed(h, item)
    elif obj is None or isinstance(obj, (bool, int, float, str)):
        h.update(f"{type(obj).__name__} {obj!r};".encode())
    else:
        raise TypeError(f"a checkpoint holds plain types only (got {type(obj).__name__})")


def save_checkpoint(path: Union[str, Path], state: dict) -> None:
    """Write ``state`` and its :func:`state_digest` to ``path`` atomically.

    The file is written as ``path + ".tmp"``, flushed to disk and renamed, so a reader sees
    the old checkpoint or the new one, never half of one; a failed save removes the
    temporary file and leaves ``path`` as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    state = {**state, "sha256": state_digest(state)}
    try:
        with open(tmp, "wb") as fh:
            torch.save(state, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        failed = _write_failure(err)
        if failed is None:
            raise
        raise OSError(failed.errno, f"{failed.strerror}: checkpoint {path} was not written "
                                    "(the previous one, if any, is kept)") from None


def _write_failure(err: BaseException):
    """The ``OSError`` behind torch's zip writer's ``RuntimeError`` (``unexpected pos ...``), or ``None``.

    On a full disk ``torch.save`` does not raise the ``OSError`` of the failed write: its zip
    writer raises ``RuntimeError: [enforce fail at inline_container.cc] . unexpected pos 832 vs
    726`` with the ``OSError`` (``ENOSPC``) only as its context. (EFBIG reaches the caller as an
    ``OSError`` itself.)
    """
    if not isinstance(err, RuntimeError):
        return None
    seen = err.__context__
    while seen is not None and not isinstance(seen, OSError):
        seen = seen.__context__
    if seen is not None:
        return seen
    if "inline_container" in str(err) or "unexpected pos" in str(err):  # the write failed without an OSError
        return OSError(errno.EIO, "the checkpoint's zip writer failed (" + " ".join(str(err).split()) + ")")
    return None


def load_checkpoint(path: Union[str, Path]) -> dict:
    """A checkpoint written by :func:`save_checkpoint`, loaded with ``weights_only=True`` and verified.

    Returns the saved dict without its ``"sha256"`` entry. A checkpoint without one (written
    by another program, or before tgattn stored it) loads with a warning.

    Raises:
        FileNotFoundError: when there is no file at ``path``.
        CheckpointError: when the file is empty, truncated, corrupted (its contents do not
            match the stored SHA-256) or lacks ``"model"``, ``"config"`` or ``"vocab"``.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    size = path.stat().st_size
    if size == 0:
        raise CheckpointError(f"checkpoint {path} is empty (0 bytes): its save did not finish; delete it")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a zip or pickle error: the file is cut short or damaged
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"checkpoint {path} ({size:,} bytes) is truncated or corrupted: {reason}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} is not a tgattn GPT checkpoint (it holds a {type(state).__name__}, not a dict)")
    missing = [key for key in REQUIRED if key not in state]
    if missing:
        raise CheckpointError(f"{path} is not a tgattn GPT checkpoint: keys {missing} are missing")
    stored = state.pop("sha256", None)
    if stored is None:
        warnings.warn(f"checkpoint {path} has no checksum (written before tgattn stored one): loaded unverified")
    elif stored != state_digest(state):
        raise CheckpointError(
            f"checkpoint {path} is corrupted: its contents do not match the SHA-256 stored when it was saved"
        )
    return state


def _a(noun: str) -> str:
    return ("an " if noun[:1] in "aeiou" else "a ") + noun


def checkpoint_config(state: dict, path: Union[str, Path, None] = None):
    """The :class:`tgattn.models.GPTConfig` of a loaded checkpoint, checked against its vocabulary and weights.

    ``path`` names the file in the errors. Checked: ``"config"`` holds only fields of
    ``GPTConfig``, of their types and within their ranges (fields it lacks take their
    defaults); its ``vocab_size`` is the length of ``"vocab"``; ``"model"`` holds exactly
    the tensors of that model, of its shapes (compared on the meta device: nothing is
    allocated). So :func:`model_from_checkpoint` and a resumed :func:`tgattn.lm.train` load
    the weights without a size-mismatch error from ``load_state_dict``.

    Raises:
        CheckpointError: naming the file and the first mismatch (one line).
    """
    from dataclasses import fields

    from ..models import GPT, GPTConfig

    where = f"checkpoint {path}" if path is not None else "the checkpoint"
    config, vocab, weights = state["config"], state["vocab"], state["model"]
    if not isinstance(config, dict):
        raise CheckpointError(f"{where} has a config that is {_a(type(config).__name__)}, not a dict")
    kinds = {f.name: f.type if isinstance(f.type, str) else f.type.__name__ for f in fields(GPTConfig)}
    unknown = sorted((key for key in config if key not in kinds), key=repr)
    if unknown:
        raise CheckpointError(f"{where} has config keys unknown to GPTConfig: {', '.join(map(repr, unknown))}")
    accepted = {"int": int, "float": (int, float), "str": str, "bool": bool}
    for key, value in config.items():
        kind = kinds[key]
        if not isinstance(value, accepted[kind]) or (kind != "bool" and isinstance(value, bool)):
            raise CheckpointError(f"{where} has config {key} = {value!r} ({_a(type(value).__name__)}), not {_a(kind)}")
    try:
        config = GPTConfig(**config)
    except ValueError as err:
        raise CheckpointError(f"{where} has an invalid config: {err}") from None
    if not isinstance(vocab, str):
        raise CheckpointError(f"{where} has a vocabulary that is {_a(type(vocab).__name__)}, not a str")
    if config.vocab_size != len(vocab):
        raise CheckpointError(f"{where} has config vocab_size {config.vocab_size}, but its vocabulary holds {len(vocab)} characters")
    if not isinstance(weights, dict):
        raise CheckpointError(f"{where} has weights that are {_a(type(weights).__name__)}, not a state dict")
    with torch.device("meta"):
        expected = {name: tuple(t.shape) for name, t in GPT(config).state_dict().items()}
    shapes = {name: tuple(t.shape) for name, t in weights.items() if isinstance(t, torch.Tensor)}
    problems = [
        ("no weights for {}", [repr(name) for name in expected if name not in weights]),
        ("weights the config has no place for: {}", [repr(name) for name in weights if name not in expected]),
        ("not a tensor: {}", [repr(name) for name in expected if name in weights and name not in shapes]),
        ("{}", [f"{name!r} is {list(shapes[name])}, the config needs {list(shape)}"
                for name, shape in expected.items() if name in shapes and shapes[name] != shape]),
    ]
    problems = [text.format(items[0]) + (f" (and {len(items) - 1} more)" if len(items) > 1 else "")
                for text, items in problems if items]
    if problems:
        sizes = ", ".join(f"{key} {getattr(config, key)}" for key in ("n_layer", "n_embd", "vocab_size", "block_size", "bias"))
        raise CheckpointError(f"{where} has weights that do not match its config ({sizes}): {'; '.join(problems)}")
    return config


def model_from_checkpoint(state: dict, path: Union[str, Path, None] = None):
    """The :class:`tgattn.models.GPT` stored in a checkpoint, with its weights, in eval mode.

    The config is checked against the weights first (:func:`checkpoint_config`, whose
    :class:`CheckpointError` names ``path``).
    """
    from ..models import GPT

    model = GPT(checkpoint_config(state, path))
    model.load_state_dict(state["model"])
    return model.eval()
