"""Where tgattn finds data: an explicit path, else ``TGATTN_DATA``, else PyG's download.

tgattn never copies data into the project. Tests, benchmarks and notebooks read the public
data sets from a folder laid out like ``../shared/data`` (``planetoid/<Name>/raw``,
``tinyshakespeare/input.txt``).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional, Union

PathLike = Union[str, os.PathLike]

TINY_SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"


def data_dir(root: Optional[PathLike] = None) -> Optional[Path]:
    """The data folder: ``root`` if given, else ``$TGATTN_DATA``, else ``None``.

    Raises:
        FileNotFoundError: when the folder named by ``root`` or ``TGATTN_DATA`` does not exist.
    """
    source = "root" if root is not None else "TGATTN_DATA"
    root = root if root is not None else os.environ.get("TGATTN_DATA")
    if root is None:
        return None
    path = Path(root).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"data folder {str(path)!r} (from {source}) does not exist")
    return path


def load_planetoid(name: str, root: Optional[PathLike] = None):
    """A Planetoid citation graph (``"Cora"``, ``"CiteSeer"``, ``"PubMed"``), public split.

    With a data folder (``root`` or ``TGATTN_DATA``) holding ``planetoid/<name>/raw``, the raw
    files are copied to a temporary folder (the shared one may be read-only) and processed
    there, offline; without SciPy (which PyG's reader needs), :mod:`tgattn.planetoid_raw` reads
    them in place into the same graph. Without a data folder, PyG downloads the data into
    ``~/.cache/tgattn``.

    Raises:
        ValueError: for an unknown name.
        FileNotFoundError: when the data folder lacks ``planetoid/<name>/raw``.
    """
    from torch_geometric.datasets import Planetoid

    known = {"cora": "Cora", "citeseer": "CiteSeer", "pubmed": "PubMed"}
    if name.lower() not in known:
        raise ValueError(f"unknown Planetoid dataset {name!r}; choose one of {sorted(known.values())}")
    name = known[name.lower()]
    base = data_dir(root)
    if base is None:
        return Planetoid(str(Path.home() / ".cache" / "tgattn" / "planetoid"), name)[0]
    raw = base / "planetoid" / name / "raw"
    if not raw.is_dir():
        raise FileNotFoundError(f"{raw} not found: the data folder {base} has no Planetoid {name} raw files")
    try:
        import scipy.sparse  # noqa: F401  (PyG's reader unpickles SciPy matrices)
    except ImportError:
        from .planetoid_raw import read_planetoid

        return read_planetoid(raw, name)
    with tempfile.TemporaryDirectory(prefix="tgattn-planetoid-") as tmp:
        shutil.copytree(raw, Path(tmp) / name / "raw")
        return Planetoid(tmp, name)[0]


def load_tiny_shakespeare(root: Optional[PathLike] = None) -> str:
    """The Tiny Shakespeare corpus (1,115,394 characters) as one string.

    Reads ``tinyshakespeare/input.txt`` from the data folder (``root`` or ``TGATTN_DATA``);
    without one, downloads it once into ``~/.cache/tgattn``.
    """
    base = data_dir(root)
    if base is None:
        path = Path.home() / ".cache" / "tgattn" / "tinyshakespeare" / "input.txt"
        if not path.exists():
            import urllib.request

            path.parent.mkdir(parents=True, exist_ok=True)
            urllib.request.urlretrieve(TINY_SHAKESPEARE_URL, path)
    else:
        path = base / "tinyshakespeare" / "input.txt"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: the data folder {base} has no Tiny Shakespeare corpus")
    return path.read_text(encoding="utf-8")
