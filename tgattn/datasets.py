"""Where tgattn finds data: an explicit path, else ``TGATTN_DATA``, else PyG's download.

tgattn never copies data into the project. Tests, benchmarks and notebooks read the public
data sets from a folder laid out like ``../shared/data`` (``planetoid/<Name>/raw``,
``tinyshakespeare/input.txt``).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Optional, Union

PathLike = Union[str, os.PathLike]

TINY_SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
TINY_SHAKESPEARE_BYTES = 1_115_394  # ASCII: as many characters
TINY_SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"


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
    there, offline. Without one, PyG downloads the data into ``~/.cache/tgattn``.

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
    with tempfile.TemporaryDirectory(prefix="tgattn-planetoid-") as tmp:
        shutil.copytree(raw, Path(tmp) / name / "raw")
        return Planetoid(tmp, name)[0]


def load_tiny_shakespeare(root: Optional[PathLike] = None) -> str:
    """The Tiny Shakespeare corpus (1,115,394 characters) as one string.

    Reads ``tinyshakespeare/input.txt`` from the data folder (``root`` or ``TGATTN_DATA``) as
    it is (any corpus laid out like the shared data). Without a data folder, downloads the
    corpus once into ``~/.cache/tgattn`` through a temporary file that is checked (length and
    SHA-256) before it takes the final name, and checks that copy on every load.

    Raises:
        FileNotFoundError: when the data folder has no corpus.
        OSError: when the download fails (nothing is saved).
        ValueError: when the download or the cached copy is not the corpus (truncated).
    """
    base = data_dir(root)
    if base is not None:
        path = base / "tinyshakespeare" / "input.txt"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: the data folder {base} has no Tiny Shakespeare corpus")
        return path.read_text(encoding="utf-8")
    path = Path.home() / ".cache" / "tgattn" / "tinyshakespeare" / "input.txt"
    if not path.exists():
        _download(TINY_SHAKESPEARE_URL, path, check=_is_tiny_shakespeare)
    data = path.read_bytes()
    problem = _is_tiny_shakespeare(data)
    if problem:
        raise ValueError(
            f"{path} is not the Tiny Shakespeare corpus ({problem}; an interrupted download?): "
            "delete it to download it again, or pass a data folder (root or TGATTN_DATA)"
        )
    return data.decode("utf-8")


def _is_tiny_shakespeare(data: bytes) -> str:
    """What is wrong with ``data`` as the Tiny Shakespeare corpus; ``""`` when it is the corpus."""
    if len(data) != TINY_SHAKESPEARE_BYTES:
        return f"{len(data):,} bytes instead of {TINY_SHAKESPEARE_BYTES:,}"
    digest = hashlib.sha256(data).hexdigest()
    if digest != TINY_SHAKESPEARE_SHA256:
        return f"SHA-256 {digest[:12]}... instead of {TINY_SHAKESPEARE_SHA256[:12]}..."
    return ""


def _download(url: str, path: PathLike, *, check: Callable[[bytes], str], timeout: float = 60.0) -> None:
    """Download ``url`` to ``path`` atomically: ``path`` appears only once complete and checked.

    The bytes go to a temporary file in the same folder, ``check(data)`` returns ``""`` or what
    is wrong with them, and ``os.replace`` gives the file its name. On any failure the
    temporary file is removed and ``path`` is left as it was.

    Raises:
        OSError: when the download fails.
        ValueError: when ``check`` finds a problem.
    """
    import urllib.request

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=timeout) as response:
            shutil.copyfileobj(response, out)
            out.flush()
            os.fsync(out.fileno())
        problem = check(Path(tmp).read_bytes())
        if problem:
            raise ValueError(f"the download from {url} is not the expected file ({problem}); nothing was saved")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
