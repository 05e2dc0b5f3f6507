"""The check of an influence file (``python -m tgattn show --from FILE``) before a page is made of it.

A file read back may come from anywhere: :func:`check_influence` checks every field that
:func:`tgattn.analysis.export.influence_data` writes (types, shapes, finiteness, sizes, the
decoded arrays against the tokens) and names the first one that is wrong, so a crafted file
is refused with one line instead of a traceback or a blank page. No torch.
"""
from __future__ import annotations

import base64
import binascii
import math
from typing import Any, List

import numpy as np

LEVELS = 65535  # the quantisation of export.py: a weight is stored as a uint16 fraction of its row's scale
FIELDS = ("format", "version", "title", "tokens", "query", "heads", "keep", "index_bytes", "layers", "pruned",
          "rollout", "rollout_pruned", "flow")
VIEW = ("counts", "keys", "scale", "weights")  # and "flags" where a kept weight is not finite
LOST = ("edges", "weight", "total")  # and "nonfinite" where the totals are unknown (null)


def check_influence(data: Any) -> None:
    """Refuse data that :func:`~tgattn.analysis.export.influence_data` could not have written.

    Raises:
        ValueError: ``"<field>: <what is wrong>"``, e.g. ``"layers[0][1].keys: key 9 is not a token (4 tokens)"``.

    Example:
        >>> check_influence({"format": "tgattn.influence", "version": 1, "title": ["a"]})
        Traceback (most recent call last):
        ...
        ValueError: the file: has no field 'tokens'
        >>> check_influence({field: None for field in FIELDS} | {"title": ["a"]})
        Traceback (most recent call last):
        ...
        ValueError: title: must be a string (got list)
    """
    _dict(data, "the file", FIELDS, FIELDS + ("flows",))  # flows: only where the flow into every token was computed
    _text(data["title"], "title")
    tokens = _list(data["tokens"], "tokens")
    if not tokens:
        raise ValueError("tokens: the page needs at least one token (got [])")
    for number, token in enumerate(tokens):
        _text(token, f"tokens[{number}]")
    n = len(tokens)
    _index(data["query"], "query", n)
    keep = _dict(data["keep"], "keep", ("top_k", "threshold"), ("top_k", "threshold"))
    top_k = _int(keep["top_k"], "keep.top_k", 1, LEVELS)
    threshold = _number(keep["threshold"], "keep.threshold")
    if not 0 <= threshold < 1:
        raise ValueError(f"keep.threshold: must be in [0, 1) (got {threshold!r})")
    wide = n > 65536
    if data["index_bytes"] != (4 if wide else 2) or isinstance(data["index_bytes"], bool):
        raise ValueError(f"index_bytes: must be {4 if wide else 2} for {n} tokens (got {data['index_bytes']!r})")
    heads = [_int(h, f"heads[{l}]", 1, 2**16) for l, h in enumerate(_list(data["heads"], "heads"))]
    if not heads:
        raise ValueError("heads: the page needs at least one layer (got [])")
    for name in ("layers", "pruned"):
        per_layer = _list(data[name], name)
        if len(per_layer) != len(heads):
            raise ValueError(f"{name}: must hold {len(heads)} layers, as heads says (got {len(per_layer)})")
        for l, views in enumerate(per_layer):
            views = _list(views, f"{name}[{l}]")
            if len(views) != heads[l] + 1:
                raise ValueError(f"{name}[{l}]: must hold {heads[l] + 1} views (the mean and {heads[l]} heads; "
                                 f"got {len(views)})")
            for v, view in enumerate(views):
                (_view(view, f"{name}[{l}][{v}]", n, top_k, wide) if name == "layers"
                 else _lost(view, f"{name}[{l}][{v}]"))
    _view(data["rollout"], "rollout", n, top_k, wide)
    _lost(data["rollout_pruned"], "rollout_pruned")
    _flow(data["flow"], "flow", n, top_k)
    if "flows" in data:
        flows = _list(data["flows"], "flows")
        if len(flows) != n:
            raise ValueError(f"flows: must hold one flow per token ({n}; got {len(flows)})")
        for token, flow in enumerate(flows):
            _flow(flow, f"flows[{token}]", n, top_k, token=False)


def _view(view: Any, name: str, n: int, top_k: int, wide: bool) -> None:
    view = _dict(view, name, VIEW, VIEW + ("flags",))
    counts = _array(view["counts"], f"{name}.counts", "<u2", n)
    if counts.size and int(counts.max()) > top_k:
        raise ValueError(f"{name}.counts: a token keeps {int(counts.max())} keys, more than keep.top_k {top_k}")
    kept = int(counts.sum())
    keys = _array(view["keys"], f"{name}.keys", "<u4" if wide else "<u2", kept)
    if keys.size and int(keys.max()) >= n:
        raise ValueError(f"{name}.keys: key {int(keys.max())} is not a token ({n} tokens)")
    scale = _array(view["scale"], f"{name}.scale", "<f4", n)
    if not (np.isfinite(scale) & (scale >= 0)).all():
        raise ValueError(f"{name}.scale: every scale must be finite and >= 0 (got {scale[~(scale >= 0) | ~np.isfinite(scale)][0]})")
    _array(view["weights"], f"{name}.weights", "<u2", kept)
    if "flags" in view:
        flags = _array(view["flags"], f"{name}.flags", "u1", kept)
        if flags.size and int(flags.max()) > 2:
            raise ValueError(f"{name}.flags: a flag is 0 (finite), 1 (NaN) or 2 (+inf) (got {int(flags.max())})")


def _lost(lost: Any, name: str) -> None:
    lost = _dict(lost, name, LOST, LOST + ("nonfinite",))
    _int(lost["edges"], f"{name}.edges", 0, 2**63)
    unknown = "nonfinite" in lost
    if unknown:
        _int(lost["nonfinite"], f"{name}.nonfinite", 1, 2**63)
    for field in ("weight", "total"):
        if unknown and lost[field] is not None:
            raise ValueError(f"{name}.{field}: must be null where nonfinite counts unknown values (got {lost[field]!r})")
        if not unknown:
            _number(lost[field], f"{name}.{field}")


def _flow(flow: Any, name: str, n: int, top_k: int, *, token: bool = True) -> None:
    """One flow: ``{"token", "index", "value"}`` or ``{"token", "skipped"}`` (in ``flows``, without ``token``)."""
    fields = ("token",) if token else ()
    if isinstance(flow, dict) and "skipped" in flow:
        flow = _dict(flow, name, fields + ("skipped",), fields + ("skipped",))
        _text(flow["skipped"], f"{name}.skipped")
    else:
        flow = _dict(flow, name, fields + ("index", "value"), fields + ("index", "value"))
        index, value = _list(flow["index"], f"{name}.index"), _list(flow["value"], f"{name}.value")
        if len(index) != len(value) or len(index) > top_k:
            raise ValueError(f"{name}: index and value must have the same length, at most keep.top_k {top_k} "
                             f"(got {len(index)} and {len(value)})")
        for r, (j, x) in enumerate(zip(index, value)):
            _index(j, f"{name}.index[{r}]", n)
            if _number(x, f"{name}.value[{r}]") < 0:
                raise ValueError(f"{name}.value[{r}]: a flow is >= 0 (got {x!r})")
    if token:
        _index(flow["token"], f"{name}.token", n)


def _dict(value: Any, name: str, required, allowed) -> dict:
    if not isinstance(value, dict):
        raise ValueError(f"{name}: must be an object (got {type(value).__name__})")
    missing = [key for key in required if key not in value]
    if missing:
        raise ValueError(f"{name}: has no field {missing[0]!r}")
    extra = [key for key in value if key not in allowed]
    if extra:
        raise ValueError(f"{name}: has an unknown field {extra[0]!r}")
    return value


def _list(value: Any, name: str) -> List[Any]:
    if not isinstance(value, list):
        raise ValueError(f"{name}: must be a list (got {type(value).__name__})")
    return value


def _text(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{name}: must be a string (got {type(value).__name__})")
    return value


def _number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name}: must be a finite number (got {value!r})")
    return float(value)


def _int(value: Any, name: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name}: must be an integer in [{low}, {high}] (got {value!r})")
    return value


def _index(value: Any, name: str, n: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < n:
        raise ValueError(f"{name}: must be a token index in [0, {n}) (got {value!r})")
    return value


def _array(text: Any, name: str, dtype: str, length: int) -> np.ndarray:
    """A base64 field decoded to ``length`` little-endian values of ``dtype``."""
    try:
        raw = base64.b64decode(_text(text, name), validate=True)
    except binascii.Error:
        raise ValueError(f"{name}: is not base64") from None
    size = np.dtype(dtype).itemsize
    if len(raw) != length * size:
        raise ValueError(f"{name}: must hold {length} values of {size} bytes (got {len(raw)} bytes)")
    return np.frombuffer(raw, dtype=dtype)
